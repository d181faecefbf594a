"""The decode batch: its rows in order, their batch cache, the forward in flight; and
one row's host state in the runner (`RowState`).

Plain, affine and TurboQuant layers keep per-row slots (engine.kv.slots.slot_batch_of): a
joining row or prefill group (already in slots) writes only its own KV into free slots, and a retirement
moves at most one row (`retire_order`). Other kinds (rotating sliding-window layers) join
through their class's `merge` and `extend` and keep physical left padding per row. The
in-flight forward's logits (`pending`, one row each, in the batch's order when launched)
are filtered with the rows, so a row released between a launch and its read goes with
its extra position.
"""

from __future__ import annotations

from typing import Any

import attrs
import mlx.core as mx

from tqserve.engine.kv_budget import allocated_rows
from tqserve.engine.kv.slots import as_decode_batch, is_slot_batch, retire_order, slot_capacity
from tqserve.engine.sampling import RowSampler
from tqserve.engine.structured import RowGrammar


@attrs.define
class RowState:
    """One row's host state in the runner: its sampler, prompt, own caches (until it
    joins the batch), last token and grammar; generated tokens only when speculating."""
    sampler: RowSampler
    prompt: tuple[int, ...]
    cache: list[Any] | None
    last_token: int
    grammar: RowGrammar | None = None
    generated: list[int] = attrs.Factory(list)


class DecodeBatch:
    """The batch's rows (ids, in cache order), its cache and its forward in flight."""

    def __init__(self) -> None:
        self.ids: list[str] = []
        self.cache: list[Any] | None = None
        self.pending: tuple[mx.array, list[str]] | None = None  # in-flight logits, their rows

    def release(self, gone: set[str]) -> None:
        """Rows `gone` leave the batch, its cache and the logits in flight."""
        if not gone.intersection(self.ids):
            return
        if all(is_slot_batch(c) for c in self.cache or ()):
            keep = retire_order(len(self.ids), [i for i, rid in enumerate(self.ids)
                                                if rid in gone])
        else:
            keep = [i for i, rid in enumerate(self.ids) if rid not in gone]
        self.ids = [self.ids[i] for i in keep]
        if self.pending is not None:
            logits, rows = self.pending
            self.pending = (logits[mx.array(keep)], [rows[i] for i in keep]) if keep else None
        if not keep:
            self.cache = None
            return
        for c in self.cache or ():
            c.filter(keep)

    def join(self, request_id: str, cache: list[Any]) -> None:
        """One row's own (single-row) caches join at the end."""
        if self.cache is None:
            self.cache = [as_decode_batch(c) for c in cache]
        else:
            for mine, theirs in zip(self.cache, cache):
                mine.extend(theirs if is_slot_batch(mine) else type(theirs).merge([theirs]))
        self.ids.append(request_id)

    def join_group(self, request_ids: list[str], cache: list[Any]) -> None:
        """A completed prefill group's slot batches join at once: as they are into an
        empty batch (into a fresh store if rows cancelled mid-prefill left it more slots
        than a store of its rows gets: `kv_budget.allocated_rows`, what the budget
        charges), else one `extend` (its rows' bytes into free slots)."""
        if self.cache is None:
            spare = slot_capacity(cache)[0] > allocated_rows(len(request_ids))
            self.cache = [type(c).merge([c]) for c in cache] if spare else list(cache)
        else:
            for mine, theirs in zip(self.cache, cache):
                mine.extend(theirs)
        self.ids += request_ids

    def take_pending(self) -> tuple[mx.array, list[str]] | None:
        pending, self.pending = self.pending, None
        return pending

    def clear(self) -> None:
        self.ids = []
        self.cache = None
        self.pending = None

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.cache) if self.cache else 0

    @property
    def capacity(self) -> tuple[int, int]:
        return slot_capacity(self.cache)
