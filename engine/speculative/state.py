"""Proposer state of paired snapshots: what a draft model or an MTP head holds for one row
at a snapshot's token boundary, its planes for the SSD tier, and the layout a file's
planes must have.

A snapshot of a row that speculates with `draft` or `mtp` (engine.snapshot.Snapshot.paired)
holds, next to the target's KV for its T tokens, the proposer's state for exactly those T
tokens; a row built from it gets both or neither (Speculator.restore_state):

* draft: the draft model's KV per layer for the same T positions. The proposer first
  catches its cache up to T (DraftProposer.state_at: the forward its next proposal would
  run anyway). Like the target's KV it can be cut to any length.
* mtp: the head's KV for the true pairs (h_j, x_{j+1}), j < N, and the target's pre-norm
  hidden states h_N .. h_{T-1} the head has not consumed yet (engine.speculative.mtp).
  N < T (a pair's token lies inside the boundary). Cut to L tokens it keeps the head's KV
  and h_N .. h_{L-1}, so it needs L > N: `minimum` = N + 1 joins the snapshot's reuse bound
  (a prompt's snapshot, taken before the head ran, has N = 0 and serves any length; a
  finished row's has N close to T and serves continuations of it). A row whose head
  started over (MtpProposer folds long plain runs) has no exact state at any boundary: it
  publishes no paired snapshot at all.

Planes, named after the method: "draft.<layer>.keys|values" (1, heads, T, dim); "mtp.0.keys|
values" (1, heads, N, dim) and "mtp.hidden" (1, T - N, hidden size). Header `extra` fields:
`paired` (the state identity: "draft:<draft fingerprint>", "mtp:<head fingerprint>") and
`paired_minimum`. `StateLayout.check` refuses, before a byte is decoded, any missing or
extra plane, shape, dtype or field that does not fit this engine's draft model / MTP head;
`PairedLayout` checks a paired file's header: the target's planes against the target's
PlaneLayout, the rest against the StateLayout.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import mlx.core as mx

from tqserve.engine.snapshot import array_plane, dtype_name, plane_array
from tqserve.engine.snapshot_layout import PlaneLayout

Shape = tuple[int, ...]
PAIRED_FIELD = "paired"
MINIMUM_FIELD = "paired_minimum"


def paired_minimum(extra: Mapping[str, Any]) -> int:
    """The reuse bound a paired file's header adds (0 for a state-free file)."""
    value = extra.get(MINIMUM_FIELD, 0)
    return value if type(value) is int else 0


@attrs.frozen(kw_only=True)
class ProposerState:
    """One row's proposer state for the first `offset` tokens (see the module doc).
    Immutable by convention: a row restored from it gets new arrays (slices)."""

    identity: str
    prefix: str
    layers: tuple[tuple[mx.array, mx.array], ...]  # per layer (keys, values): (1, H, N, D)
    hidden: mx.array | None   # mtp: (1, offset - N, hidden); draft: None (N = offset)
    offset: int

    @property
    def num_cached(self) -> int:
        """Positions the proposer's KV holds (N)."""
        return int(self.layers[0][0].shape[2]) if self.layers else 0

    @property
    def minimum(self) -> int:
        """The shortest length this state can be cut to."""
        return 0 if self.hidden is None else self.num_cached + 1

    @property
    def nbytes(self) -> int:
        hidden = self.hidden.nbytes if self.hidden is not None else 0
        return sum(k.nbytes + v.nbytes for k, v in self.layers) + hidden

    def cut(self, length: int) -> ProposerState:
        """The state for the first `length` tokens, by reference (new slices)."""
        if not max(1, self.minimum) <= length <= self.offset:
            raise ValueError(f"cannot cut the {self.prefix} state of {self.offset} tokens "
                             f"(minimum {self.minimum}) to {length}")
        if self.hidden is None:
            return attrs.evolve(self, offset=length, layers=tuple(
                (k[:, :, :length], v[:, :, :length]) for k, v in self.layers))
        num = self.num_cached
        return attrs.evolve(self, offset=length, hidden=self.hidden[:, :length - num],
                            layers=tuple((k[:, :, :num], v[:, :, :num]) for k, v in self.layers))

    def planes(self) -> list[tuple[str, bytes, Shape, str]]:
        out = []
        for i, (keys, values) in enumerate(self.layers):
            out += [array_plane(f"{self.prefix}.{i}.keys", keys),
                    array_plane(f"{self.prefix}.{i}.values", values)]
        if self.hidden is not None:
            out.append(array_plane(f"{self.prefix}.hidden", self.hidden))
        return out

    def header_fields(self) -> dict[str, int | str]:
        return {PAIRED_FIELD: self.identity, MINIMUM_FIELD: self.minimum}


@attrs.frozen(kw_only=True)
class StateLayout:
    """What a paired file's proposer planes must be. Plain data: `check` runs anywhere."""

    identity: str
    prefix: str
    layers: tuple[tuple[Shape, str], ...]  # per layer: keys/values shape without T, dtype
    hidden: tuple[Shape, str] | None       # mtp: hidden shape without T, dtype

    @classmethod
    def probe(cls, identity: str, prefix: str, layers: Sequence[tuple[mx.array, mx.array]],
              hidden: mx.array | None) -> StateLayout:
        """The layout of arrays a one-position probe produced (T axis 2, hidden's 1)."""
        mx.eval([a for pair in layers for a in pair] + ([hidden] if hidden is not None else []))
        return cls(identity=identity, prefix=prefix,
                   layers=tuple(((*k.shape[:2], *k.shape[3:]), dtype_name(k)) for k, _ in layers),
                   hidden=None if hidden is None else ((hidden.shape[0], *hidden.shape[2:]),
                                                       dtype_name(hidden)))

    def check(self, *, offset: int, planes: Mapping[str, tuple[Sequence[int], str]],
              fields: Mapping[str, Any] | None = None) -> int:
        """ValueError naming the first plane or field this engine's proposer cannot restore
        (`planes`: those under this prefix); returns N, the positions of its KV."""
        if offset < 1:
            raise ValueError(f"offset {offset}")
        expected, cached = set(), None
        for i, (pattern, dtype) in enumerate(self.layers):
            for part in ("keys", "values"):
                name = f"{self.prefix}.{i}.{part}"
                expected.add(name)
                shape, got = self._plane(planes, name)
                num = shape[2] if len(shape) == 4 else -1
                cached = num if cached is None else cached
                if (len(shape) != 4 or (*shape[:2], *shape[3:]) != pattern or got != dtype
                        or num != cached):
                    raise ValueError(f"plane {name} is {shape} {got}, this {self.prefix} state "
                                     f"needs {(*pattern[:2], cached, *pattern[2:])} {dtype}")
        cached = cached or 0
        if self.hidden is None and cached != offset:
            raise ValueError(f"{self.prefix} state of {cached} positions for offset {offset}")
        if self.hidden is not None:
            name = f"{self.prefix}.hidden"
            expected.add(name)
            shape, got = self._plane(planes, name)
            want = (self.hidden[0][0], offset - cached, *self.hidden[0][1:])
            if cached >= offset or shape != want or got != self.hidden[1]:
                raise ValueError(f"plane {name} is {shape} {got}, this {self.prefix} state "
                                 f"needs {want} {self.hidden[1]}")
        unknown = sorted(set(planes) - expected)
        if unknown:
            raise ValueError(f"unexpected planes {unknown[:3]}")
        if fields is not None:
            minimum = 0 if self.hidden is None else cached + 1
            for field, want_value in ((PAIRED_FIELD, self.identity), (MINIMUM_FIELD, minimum)):
                if fields.get(field) != want_value:
                    raise ValueError(f"{field} {fields.get(field)!r:.60} != {want_value!r}")
        return cached

    @staticmethod
    def _plane(planes: Mapping[str, tuple[Sequence[int], str]], name: str) -> tuple[Shape, str]:
        if name not in planes:
            raise ValueError(f"plane {name} is missing")
        shape, dtype = planes[name]
        return tuple(shape), dtype

    def split(self, names: Sequence[str]) -> tuple[list[str], list[str]]:
        """(this state's plane names, the others: the target's)."""
        own = [n for n in names if n.startswith(self.prefix + ".")]
        return own, [n for n in names if not n.startswith(self.prefix + ".")]

    def restore(self, offset: int,
                planes: Mapping[str, tuple[bytes, Sequence[int], str]]) -> ProposerState:
        """The state held by a file's planes (this prefix's only), checked first."""
        self.check(offset=offset, planes={n: (s, d) for n, (_, s, d) in planes.items()})
        layers = tuple((plane_array(f"{self.prefix}.{i}.keys", *planes[f"{self.prefix}.{i}.keys"]),
                        plane_array(f"{self.prefix}.{i}.values",
                                    *planes[f"{self.prefix}.{i}.values"]))
                       for i in range(len(self.layers)))
        hidden = None
        if self.hidden is not None:
            hidden = plane_array(f"{self.prefix}.hidden", *planes[f"{self.prefix}.hidden"])
        mx.eval([a for pair in layers for a in pair] + ([hidden] if hidden is not None else []))
        return ProposerState(identity=self.identity, prefix=self.prefix, layers=layers,
                             hidden=hidden, offset=offset)


@attrs.frozen(kw_only=True)
class PairedLayout:
    """A paired namespace's files: the target's planes and the proposer's."""

    target: PlaneLayout
    state: StateLayout

    def check_header(self, header: Any) -> None:
        """ValueError naming what does not fit (a storage SnapshotHeader, duck-typed)."""
        specs = {spec.name: (spec.shape, spec.dtype) for spec in header.planes}
        own, rest = self.state.split(list(specs))
        self.target.check_header(header, planes={n: specs[n] for n in rest})
        self.state.check(offset=header.offset, planes={n: specs[n] for n in own},
                         fields=header.extra)
