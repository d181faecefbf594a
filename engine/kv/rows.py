"""KvTensorRows: encoded KV planes of one row (or of rows written together).

A plane is any array of shape (B, H, T_alloc, W) (codes, norms, affine words, plain keys:
any dtype). Every plane of one KvTensorRows shares one write index `idx`: positions
[0, idx) of the position axis are written, for every row alike. This is a single
sequence's cache (B = 1; a block of B > 1 rows is accepted while empty, and they then
share the offset, as mlx-lm's single-row caches allow). Batches of rows with their own
lengths live in the slot store (engine/kv/slot_rows.py), never here.

* Allocation: a block that does not fit grows every plane by whole steps of 256
  positions (`STEP`), like mlx-lm's KVCache. `nbytes` counts every allocated byte of every
  plane (unwritten slack included): it is the resident size, not the valid size.
* Every operation moves encoded bytes only (slices, concatenations); nothing here
  decodes, so a row's bytes are the ones it was written with.
Rows are validated with exceptions: wrong plane names or shapes raise ValueError.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import _BaseCache, create_attention_mask

STEP = 256
Planes = dict[str, mx.array]


def row_indices(indices: Sequence[int] | mx.array) -> list[int]:
    """Batch row indices as ints, from a sequence or an mx.array (as mlx-lm passes them)."""
    return [int(i) for i in np.asarray(indices).reshape(-1)]


class KvTensorRows:
    """Named (B, H, T_alloc, W) planes with one write index (see the module doc)."""

    def __init__(self, num_rows: int = 1) -> None:
        if num_rows < 1:
            raise ValueError(f"rows must be >= 1, got {num_rows}")
        self._planes: Planes | None = None
        self._num_rows = int(num_rows)
        self._idx = 0

    @classmethod
    def from_planes(cls, planes: Mapping[str, mx.array]) -> KvTensorRows:
        """Rows holding `planes` (B, H, T, W) written up to T; {} gives one empty row."""
        if not planes:
            return cls()
        shapes = {a.shape[:3] if a.ndim == 4 else a.shape for a in planes.values()}
        if len(shapes) != 1 or any(a.ndim != 4 for a in planes.values()):
            raise ValueError(f"planes must be (B, H, T, W) with one B, H, T: {sorted(shapes)}")
        (num_rows, _, length), = shapes
        rows = cls(num_rows)
        rows._planes = dict(planes)
        rows._idx = length
        return rows

    @property
    def num_rows(self) -> int:
        """Rows (B)."""
        return self._num_rows

    @property
    def idx(self) -> int:
        """The write index: positions [0, idx) are written (the offset of every row)."""
        return self._idx

    @property
    def empty(self) -> bool:
        """True until the first append allocates the planes."""
        return self._planes is None

    @property
    def nbytes(self) -> int:
        """Allocated bytes of every plane (growth slack included)."""
        return sum(a.nbytes for a in self._planes.values()) if self._planes else 0

    @property
    def planes(self) -> Planes:
        """The allocated planes (B, H, T_alloc, W); {} while empty."""
        return dict(self._planes or {})

    def valid_planes(self) -> Planes:
        """Views of the written positions [0, idx) of every plane."""
        return {n: a[:, :, : self._idx] for n, a in (self._planes or {}).items()}

    def append(self, blocks: Mapping[str, mx.array]) -> None:
        """Write one block of L positions for every row: blocks[name] is (B, H, L, W)."""
        self._check_blocks(blocks)
        length = next(iter(blocks.values())).shape[2]
        prev = self._idx
        if self._planes is None or prev + length > next(iter(self._planes.values())).shape[2]:
            grow = STEP * ((STEP + length - 1) // STEP)
            grown = {}
            for name, block in blocks.items():
                b, h, _, w = block.shape
                kept = (self._planes[name][:, :, :prev] if self._planes is not None
                        else mx.zeros((b, h, 0, w), block.dtype))
                grown[name] = mx.concatenate([kept, mx.zeros((b, h, grow, w), block.dtype)], axis=2)
            self._planes = grown
        self._idx = prev + length
        for name, block in blocks.items():
            self._planes[name][:, :, prev : self._idx] = block

    def _check_blocks(self, blocks: Mapping[str, mx.array]) -> None:
        if not blocks:
            raise ValueError("append needs at least one plane")
        shapes = {n: a.shape for n, a in blocks.items()}
        if len({(len(s), s[0], s[2]) for s in shapes.values()}) != 1 or any(
                len(s) != 4 or s[0] != self.num_rows for s in shapes.values()):
            raise ValueError(f"blocks must be (B={self.num_rows}, H, L, W), one L: {shapes}")
        if self._planes is not None:
            if set(blocks) != set(self._planes):
                raise ValueError(f"planes {sorted(blocks)} != held {sorted(self._planes)}")
            for name, shape in shapes.items():
                held = self._planes[name].shape
                if (shape[1], shape[3]) != (held[1], held[3]):
                    raise ValueError(f"plane {name!r}: block {shape} vs held {held}")

    def extract(self, i: int) -> Planes:
        """Row i's written planes (1, H, idx, W), as fresh arrays."""
        if i not in range(self.num_rows):
            raise ValueError(f"row {i} outside 0..{self.num_rows - 1}")
        return {n: mx.contiguous(a[i : i + 1, :, : self._idx])
                for n, a in (self._planes or {}).items()}

    def trim(self, n: int) -> int:
        """Drop the last n positions (at most what is written); returns how many."""
        n = max(0, min(n, self._idx))
        self._idx -= n
        return n


class SingleRowView:
    """The position side of mlx-lm's protocol for a one-row cache on `self.rows`."""

    rows: KvTensorRows

    def _reshape_empty(self, num_rows: int) -> None:
        self.rows = KvTensorRows(num_rows)

    @property
    def offset(self) -> int:
        """Tokens held."""
        return self.rows.idx

    def make_mask(self, N: int, return_array: bool = False,
                  window_size: int | None = None) -> Any:
        """The mask a KVCache at this offset makes: None, "causal" or an array."""
        return create_attention_mask(N, self.offset, return_array, window_size)


class PlanesCache(_BaseCache):
    """The storage side of mlx-lm's cache protocol for caches whose state is the named
    planes `PLANES` of a KvTensorRows (`self.rows`): sizes, trim, state planes."""

    PLANES: tuple[str, ...] = ()
    rows: KvTensorRows

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> Any:
        """Encode and append a (B, H, L, D) block; fetch what attention needs."""
        raise NotImplementedError

    def _planes_state(self) -> tuple[mx.array | None, ...]:
        planes = self.rows.valid_planes()
        return tuple(planes.get(n) for n in self.PLANES)

    @classmethod
    def _planes_from(cls, values: Sequence[mx.array | None]) -> dict[str, mx.array]:
        return {n: v for n, v in zip(cls.PLANES, values) if v is not None}

    def size(self) -> int:
        """Positions written."""
        return self.rows.idx

    def append_written(self, kv_cache: Any) -> None:
        """Encode and append what a plain mlx-lm KVCache holds (its written positions)."""
        if kv_cache.keys is not None and kv_cache.offset > 0:
            end = kv_cache.offset
            self.update_and_fetch(kv_cache.keys[..., :end, :], kv_cache.values[..., :end, :])

    def empty(self) -> bool:
        """True until the first append."""
        return self.rows.empty

    @property
    def nbytes(self) -> int:
        """Allocated bytes of the planes (KvTensorRows.nbytes)."""
        return self.rows.nbytes

    def is_trimmable(self) -> bool:
        """Always: positions can be dropped from the end."""
        return True

    def trim(self, n: int) -> int:
        """Drop the last n positions; returns how many."""
        return self.rows.trim(n)
