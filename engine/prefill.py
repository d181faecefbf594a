"""Batched prefill of prompt groups (engine.scheduler's module doc says who forms them).

A group's rows are left-padded to the longest prompt and prefilled together: each step's
chunk is ONE forward of shape (rows, columns) into one batch cache, built from the cache
class's own `merge` of fresh rows and `prepare(left_padding=...)` (mlx-lm's BatchGenerator
protocol: plain, TurboQuant, delayed and affine caches all speak it). Padding positions
are masked by the batch cache (`make_mask` with left padding), so a row's KV and logits do
not depend on the other rows beyond float rounding of the batched matmuls. When the group
completes, the whole batch cache joins the decode batch at once (one `extend`).

Caches that cannot be batched this way (a layer kind the snapshots do not know, e.g. a
rotating sliding-window layer) fall back to one cache and one forward per row: the plan is
the same, only the execution differs.
"""

from __future__ import annotations

from typing import Any, Sequence

import attrs
import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache

from tqserve.engine.arrays import int_list
from tqserve.engine.step import PrefillChunk
from tqserve.engine.snapshot import Snapshot, extract_snapshot, snapshot_kinds

PAD_TOKEN = 0  # any id: padded positions are masked out of every real row's attention


@attrs.define
class _Group:
    rows: list[str]
    pads: list[int]
    fresh: list[list[Any]]          # the rows' empty caches until the first chunk
    cache: list[Any] | None = None  # their batch, built at the group's first chunk


def _batch_of(fresh: Sequence[list[Any]], pads: list[int]) -> list[Any]:
    """Empty batch caches, one per layer, for rows with left padding `pads`."""
    out = []
    for layer in zip(*fresh):
        if type(layer[0]) is KVCache:
            out.append(BatchKVCache(pads))
            continue
        batch = type(layer[0]).merge(list(layer))
        batch.prepare(left_padding=pads)
        out.append(batch)
    return out


def _keep_rows(cache: Any, keep: list[int]) -> None:
    """Keep rows `keep` of a group's batch cache. mlx-lm's BatchKVCache.filter shifts away
    the padding its rows share even past what is written: when every row left is still
    inside its padding (the longest row cancelled early) it dropped positions that do not
    exist and the next chunk's attention failed to broadcast. Here the shift stops at the
    write index, as engine.kv's own caches do (KvTensorRows.shared_padding); the layout
    the scheduler plans the group's columns from is unchanged either way."""
    if type(cache) is not BatchKVCache:
        cache.filter(keep)
        return
    index = mx.array(keep, dtype=mx.int32)
    if cache.keys is not None:
        cache.keys, cache.values = cache.keys[index], cache.values[index]
    cache.offset = cache.offset[index]
    cache.left_padding = cache.left_padding[index]
    shared = min(min(int_list(cache.left_padding)), cache._idx)
    if shared > 0 and cache.keys is not None and cache.values is not None:  # _idx 0 if empty
        cache.keys = cache.keys[..., shared:, :]
        cache.values = cache.values[..., shared:, :]
        cache._idx -= shared
        cache.left_padding -= shared


def _arrays(tree: Any) -> list[mx.array]:
    """Every array inside nested tuples/lists (cache states mix arrays and scalars)."""
    if isinstance(tree, mx.array):
        return [tree]
    if isinstance(tree, (tuple, list)):
        return [a for item in tree for a in _arrays(item)]
    return []


class PrefillGroups:
    """The runner's prefilling groups: their batch caches and forwards."""

    def __init__(self, model: Any) -> None:
        self._model = model
        self._groups: dict[int, _Group] = {}
        self._group_of: dict[str, int] = {}

    @staticmethod
    def can_batch(fresh: list[Any]) -> bool:
        """Whether rows with these (empty) caches can be prefilled as one batch (not with
        recurrent "state" layers: left padding would run through their recurrence)."""
        kinds = snapshot_kinds(fresh)
        return kinds is not None and "state" not in kinds

    def add(self, request_id: str, group: int, pad: int, fresh: list[Any]) -> None:
        """A new row of `group` with `pad` positions of left padding and empty caches
        `fresh` (`can_batch`)."""
        entry = self._groups.setdefault(group, _Group(rows=[], pads=[], fresh=[]))
        if entry.cache is not None:
            raise RuntimeError(f"{request_id} joined prefill group {group} after it started")
        entry.rows.append(request_id)
        entry.pads.append(pad)
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
            del group.rows[index], group.pads[index]
            if group.cache is None:
                del group.fresh[index]
            if not group.rows:
                del self._groups[group_id]
            elif group.cache is not None:
                for c in group.cache:
                    _keep_rows(c, keep)

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
            tokens = []
            for rid in group.rows:
                chunk = mine[rid]
                real = list(prompts[rid][chunk.start:chunk.end])
                tokens.append([PAD_TOKEN] * (columns - len(real)) + real)
            if group.cache is None:
                group.cache = _batch_of(group.fresh, group.pads)
                group.fresh = []
            self._model(mx.array(tokens), cache=group.cache)
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
        """The completed group of `request_id` (its rows, in batch order, and its batch
        cache), removed from the books; None if the row's group was already taken."""
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
        """Bytes of every group's batch cache."""
        return sum(c.nbytes for g in self._groups.values() for c in (g.cache or ()))

    def clear(self) -> None:
        """Forget every group (after a failed step)."""
        self._groups.clear()
        self._group_of.clear()
