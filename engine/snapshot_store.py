"""The RAM tier's snapshots: their arrays, held by key on the runner thread.

The books (which key covers which tokens, the budget, eviction) are the prefix cache's
(actors.prefix_cache); only keys and numbers cross. A snapshot enters by `hold`, from a
released batch row or a row whose prefill just completed (the runner extracts it), or by
`restore`, from planes the SSD tier read (actors.spill), rebuilt against this engine's
caches. A row whose proposer keeps state (draft, MTP) pairs every snapshot with that
state for the same tokens (engine.speculative.state); where no paired state is exact, no
snapshot is kept. A spill order serializes a snapshot to bytes on this thread and drops
it (`spill`); write-through serializes one that stays (`payload`). After a failed step
`retain(keys)` drops the snapshots nobody indexed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import attrs

from tqserve.engine.snapshot import (Snapshot, describe, from_planes, header_extra,
                                     layer_kind, snapshot_kinds, to_planes)
from tqserve.engine.snapshot_layout import PlaneLayout, plane_layout
from tqserve.engine.speculative.speculator import Plane, Speculator
from tqserve.engine.speculative.state import StateLayout
from tqserve.engine.step import SnapshotMade, SpillPayload

CacheFactory = Callable[[Any], list[Any]]


class SnapshotStore:
    """Snapshots by key, for one model and its cache factory (and proposer, if any)."""

    def __init__(self, model: Any, make_cache: CacheFactory,
                 speculator: Speculator | None) -> None:
        self._model = model
        self._make_cache = make_cache
        self._speculator = speculator
        self._held: dict[str, Snapshot] = {}
        self._layout: PlaneLayout | None = None

    def __getitem__(self, key: str) -> Snapshot:
        return self._held[key]

    def __len__(self) -> int:
        return len(self._held)

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self._held.values())

    @property
    def layout_known(self) -> bool:
        """Whether the plane layout was probed already (the probe runs a forward)."""
        return self._layout is not None

    def hold(self, key: str, rid: str, snap: Snapshot | None,
             context: Callable[[], tuple[int, ...]]) -> SnapshotMade | None:
        """Keep a non-empty snapshot of row `rid` under `key`, paired with the row's
        proposer state for its tokens (`context()`: prompt then generated; no exact
        state: no snapshot); what the step reports of it."""
        if snap is None or snap.offset == 0:
            return None
        spec = self._speculator
        state = spec.state_identity(rid) if spec is not None else ""
        if state and spec is not None:
            paired = spec.state_at(rid, context()[:snap.offset])
            if paired is None:
                return None
            snap = attrs.evolve(snap, paired=paired)
        self._held[key] = snap
        return SnapshotMade(key=key, request_id=rid, offset=snap.offset,
                            minimum_reusable_offset=snap.reusable_from,
                            num_bytes=snap.nbytes, state=state)

    def spill(self, key: str) -> SpillPayload:
        """The snapshot under `key` as bytes, dropped from RAM."""
        return spill_payload(key, self._held.pop(key))

    def payload(self, key: str) -> SpillPayload:
        """The snapshot under `key` as bytes; it stays held (write-through)."""
        return spill_payload(key, self._held[key])

    def restore(self, key: str, kinds: str, offset: int, boundary: int,
                planes: Mapping[str, Plane], state: str = "") -> int:
        """Hold a snapshot read from the SSD tier under `key`, with its proposer state
        `state` (an identity; "" for none); returns its bytes.

        ValueError if it does not fit this engine's caches or proposer."""
        paired, own = None, dict[str, Plane]()
        if state:  # both parts are checked before either is decoded
            if self._speculator is None:
                raise ValueError(f"no proposer here holds state {state!r:.80}")
            paired, own, planes = self._speculator.paired_planes(state, offset, planes)
        snap = from_planes(self._make_cache(self._model), kinds, offset, boundary, planes,
                           self.plane_layout())
        snap = attrs.evolve(snap, paired=paired.restore(offset, own) if paired else None)
        self._held[key] = snap
        return snap.nbytes

    def state_layouts(self) -> dict[str, StateLayout]:
        """Per speculation method whose rows publish paired snapshots: its state's planes."""
        return self._speculator.state_layouts() if self._speculator is not None else {}

    def plane_layout(self) -> PlaneLayout | None:
        """What a restorable snapshot of this model holds (probed once; None if the caches
        cannot be snapshotted)."""
        if self._layout is None:
            self._layout = plane_layout(self._model, self._make_cache(self._model))
        return self._layout

    def unsnapshottable_caches(self) -> list[str]:
        """Class names of this model's layer caches that cannot be snapshotted (sliding
        windows, recurrent state ...), sorted; empty when the prefix cache can serve it."""
        caches = self._make_cache(self._model)
        refused = sorted({type(c).__name__ for c in caches if layer_kind(c) is None})
        if not refused and snapshot_kinds(caches) is None:  # recurrent layers only
            refused = sorted({type(c).__name__ for c in caches})
        return refused

    def drop(self, key: str) -> None:
        """Forget a held snapshot (unknown keys are ignored)."""
        self._held.pop(key, None)

    def keys(self) -> set[str]:
        """Keys of the snapshots held now."""
        return set(self._held)

    def retain(self, keys: Iterable[str]) -> set[str]:
        """Drop every held snapshot not in `keys`; returns the keys still held."""
        keep = set(keys)
        for key in [k for k in self._held if k not in keep]:
            del self._held[key]
        return set(self._held)


def spill_payload(key: str, snap: Snapshot) -> SpillPayload:
    header = {**describe(snap), "offset": snap.offset,
              "minimum_reusable_offset": snap.minimum_reusable_offset,
              "extra": header_extra(snap)}
    return SpillPayload(key=key, header=header, planes=tuple(to_planes(snap)))
