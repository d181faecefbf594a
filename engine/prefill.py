"""Batched prefill of prompt groups (engine.scheduler's module doc says who forms them).

A group's rows are prefilled together in the slot store the decode batch uses
(engine.kv.slots): each step's chunk is ONE forward of shape (rows, columns) into one
slot batch per layer. A row's tokens start at column 0 and padding fills the columns
after them (right padding): row i writes its block at its own length, and after the
forward every row is trimmed back to the positions it really holds (`trim_rows`: no byte
moves), so padding never stays in the cache and each row is left-aligned as in the decode
batch. The mask is each row's own length, causal inside the block, so a row's KV does not
depend on the other rows beyond float rounding of the batched matmuls. When the group
completes, its slot batch joins the decode batch (as it is if the batch is empty, else
its rows' bytes are written into free slots).

Caches without slots (a layer kind the slot store does not know, e.g. a rotating
sliding-window layer, or recurrent state) fall back to one cache and one forward per row:
the plan is the same, only the execution differs.
"""

from __future__ import annotations

from typing import Any, Sequence

import attrs
import mlx.core as mx

from tqserve.engine.kv.slots import slot_batch_of, slot_kind
from tqserve.engine.step import PrefillChunk
from tqserve.engine.snapshot import Snapshot, extract_snapshot

PAD_TOKEN = 0  # any id: padded positions are trimmed before any real query sees them


@attrs.define
class _Group:
    rows: list[str]
    fresh: list[list[Any]]          # the rows' empty caches until the first chunk
    cache: list[Any] | None = None  # their slot batches, built at the group's first chunk


def _arrays(tree: Any) -> list[mx.array]:
    """Every array inside nested tuples/lists (cache states mix arrays and scalars)."""
    if isinstance(tree, mx.array):
        return [tree]
    if isinstance(tree, (tuple, list)):
        return [a for item in tree for a in _arrays(item)]
    return []


class PrefillGroups:
    """The runner's prefilling groups: their slot batches and forwards."""

    def __init__(self, model: Any) -> None:
        self._model = model
        self._groups: dict[int, _Group] = {}
        self._group_of: dict[str, int] = {}

    @staticmethod
    def can_batch(fresh: list[Any]) -> bool:
        """Whether rows with these (empty) caches can be prefilled as one batch: every
        layer has slots (plain, affine, TurboQuant, delayed TurboQuant)."""
        return all(slot_kind(c) is not None for c in fresh)

    def add(self, request_id: str, group: int, fresh: list[Any]) -> None:
        """A new row of `group` with empty caches `fresh` (`can_batch`)."""
        entry = self._groups.setdefault(group, _Group(rows=[], fresh=[]))
        if entry.cache is not None:
            raise RuntimeError(f"{request_id} joined prefill group {group} after it started")
        entry.rows.append(request_id)
        entry.fresh.append(fresh)
        self._group_of[request_id] = group

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._group_of

    def release(self, request_ids: Sequence[str]) -> None:
        """Drop these rows (cancelled mid-prefill) from their groups' caches."""
        for rid in request_ids:
            group_id = self._group_of.pop(rid, None)
            if group_id is None:
                continue
            group = self._groups[group_id]
            index = group.rows.index(rid)
            keep = [i for i in range(len(group.rows)) if i != index]
            del group.rows[index]
            if group.cache is None:
                del group.fresh[index]
            if not group.rows:
                del self._groups[group_id]
            elif group.cache is not None:
                for c in group.cache:
                    c.filter(keep)

    def run(self, chunks: Sequence[PrefillChunk], prompts: dict[str, tuple[int, ...]]) -> int:
        """One forward per group for this step's chunks of batched groups; returns the
        positions processed (padding included)."""
        by_group: dict[int, dict[str, PrefillChunk]] = {}
        for chunk in chunks:
            by_group.setdefault(chunk.group, {})[chunk.request_id] = chunk
        num_positions = 0
        for group_id, mine in by_group.items():
            group = self._groups[group_id]
            if set(mine) != set(group.rows):
                raise RuntimeError(f"prefill group {group_id}: chunks for {sorted(mine)}, "
                                   f"rows {sorted(group.rows)}")
            columns = next(iter(mine.values())).columns
            tokens, padding = [], []
            for rid in group.rows:
                chunk = mine[rid]
                real = list(prompts[rid][chunk.start:chunk.end])
                tokens.append(real + [PAD_TOKEN] * (columns - len(real)))
                padding.append(columns - len(real))
            if group.cache is None:
                group.cache = [slot_batch_of(layer) for layer in zip(*group.fresh)]
                group.fresh = []
            self._model(mx.array(tokens), cache=group.cache)
            if any(padding):
                for c in group.cache:
                    c.trim_rows(padding)
            mx.eval(_arrays([c.state for c in group.cache]))
            num_positions += columns * len(group.rows)
        return num_positions

    def snapshot(self, request_id: str) -> Snapshot | None:
        """A completed row's prompt KV, extracted from its group's cache."""
        group = self._groups.get(self._group_of.get(request_id, -1))
        if group is None or group.cache is None:
            return None
        return extract_snapshot(group.cache, group.rows.index(request_id))

    def take(self, request_id: str) -> tuple[list[str], list[Any]] | None:
        """The completed group of `request_id` (its rows, in batch order, and its slot
        batches), removed from the books; None if the row's group was already taken."""
        group_id = self._group_of.get(request_id)
        if group_id is None:
            return None
        group = self._groups.pop(group_id)
        for rid in group.rows:
            del self._group_of[rid]
        if group.cache is None:
            raise RuntimeError(f"prefill group {group_id} joined before any prefill")
        return group.rows, group.cache

    @property
    def nbytes(self) -> int:
        """Bytes of every group's slot batches."""
        return sum(c.nbytes for g in self._groups.values() for c in (g.cache or ()))

    def clear(self) -> None:
        """Forget every group (after a failed step)."""
        self._groups.clear()
        self._group_of.clear()
