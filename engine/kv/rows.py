"""KvTensorRows: encoded KV planes of a batch of rows that share one position axis.

A plane is any array of shape (B, H, T_alloc, W) (codes, norms, plain keys: any dtype).
Every plane of one KvTensorRows shares the row bookkeeping, as in mlx-lm's BatchKVCache:

* `idx`: the shared write index. Positions [0, idx) of the position axis are written.
* `left_padding[i]`: physical padding at the start of row i; its valid region is
  [left_padding[i], idx) and its offset (tokens held) is idx - left_padding[i].
* Allocation: a block that does not fit grows every plane by whole steps of 256 positions
  (`STEP`), like BatchKVCache. merge/extend/filter allocate exactly the positions they keep,
  so the next append grows again. `nbytes` counts every allocated byte of every plane
  (padding and unwritten slack included): it is the resident size, not the valid size.

Every operation moves encoded bytes only (slices, pads, gathers, concatenations); nothing
here decodes, so a row's bytes are the same whichever batch holds it.
Rows are validated with exceptions: wrong plane names or shapes raise ValueError.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import _BaseCache, create_attention_mask

STEP = 256
Planes = dict[str, mx.array]


def row_indices(indices: Sequence[int] | mx.array) -> list[int]:
    """Batch row indices as ints, from a sequence or an mx.array (as mlx-lm passes them)."""
    return [int(i) for i in np.asarray(indices).reshape(-1)]


def _roll_right(x: mx.array, shifts: mx.array) -> mx.array:
    """Roll each row of x (B, H, T, W) right along T by shifts[b] (mlx-lm's dynamic_roll)."""
    n = x.shape[2]
    index = (mx.arange(n)[None, None, :, None] - shifts[:, None, None, None]) % n
    return mx.take_along_axis(x, index, axis=2)


class KvTensorRows:
    """Named (B, H, T_alloc, W) planes with shared row positions (see the module doc)."""

    def __init__(self, left_padding: Sequence[int] = (0,)) -> None:
        if any(p < 0 for p in left_padding):
            raise ValueError(f"left padding must be >= 0, got {list(left_padding)}")
        self._planes: Planes | None = None
        self._left_padding = [int(p) for p in left_padding]
        self._idx = 0
        self._right_padding: list[int] | None = None

    @classmethod
    def from_planes(cls, planes: Mapping[str, mx.array],
                    left_padding: Sequence[int] | None = None) -> KvTensorRows:
        """Rows holding `planes` (B, H, T, W) written up to T, with the given padding (zeros
        by default); {} gives empty rows (one unless `left_padding` says how many)."""
        if not planes:
            return cls((0,) if left_padding is None else left_padding)
        shapes = {a.shape[:3] if a.ndim == 4 else a.shape for a in planes.values()}
        if len(shapes) != 1 or any(a.ndim != 4 for a in planes.values()):
            raise ValueError(f"planes must be (B, H, T, W) with one B, H, T: {sorted(shapes)}")
        (num_rows, _, length), = shapes
        rows = cls([0] * num_rows if left_padding is None else left_padding)
        if rows.num_rows != num_rows or max(rows._left_padding, default=0) > length:
            raise ValueError(f"left padding {list(rows._left_padding)} for {num_rows} rows "
                             f"of {length} positions")
        rows._planes = dict(planes)
        rows._idx = length
        return rows

    @property
    def num_rows(self) -> int:
        """Rows in the batch."""
        return len(self._left_padding)

    @property
    def idx(self) -> int:
        """The shared write index: positions [0, idx) are written."""
        return self._idx

    @property
    def left_padding(self) -> tuple[int, ...]:
        """Physical padding at the start of each row."""
        return tuple(self._left_padding)

    @property
    def offsets(self) -> tuple[int, ...]:
        """Tokens held by each row (idx - left padding)."""
        return tuple(self._idx - p for p in self._left_padding)

    @property
    def empty(self) -> bool:
        """True until the first append allocates the planes."""
        return self._planes is None

    @property
    def nbytes(self) -> int:
        """Allocated bytes of every plane (padding and growth slack included)."""
        return sum(a.nbytes for a in self._planes.values()) if self._planes else 0

    @property
    def planes(self) -> Planes:
        """The allocated planes (B, H, T_alloc, W); {} while empty."""
        return dict(self._planes or {})

    def valid_planes(self) -> Planes:
        """Views of the written positions [0, idx) of every plane (padding included)."""
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
                kept = self._aligned(name, block, prev)
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

    @classmethod
    def merge(cls, parts: Sequence[KvTensorRows]) -> KvTensorRows:
        """One batch of every row of `parts`, in order, right-aligned to the longest."""
        if not parts:
            raise ValueError("merge needs at least one KvTensorRows")
        merged = cls([])
        target = max(p.idx for p in parts)
        template = next((p._planes for p in parts if p._planes is not None), None)
        for p in parts:
            if template is not None and p._planes is not None and set(p._planes) != set(template):
                raise ValueError(f"planes {sorted(p._planes)} != {sorted(template)}")
            merged._left_padding += [lp + target - p.idx for lp in p._left_padding]
        merged._idx = target
        if template is not None:
            merged._planes = {
                name: mx.concatenate([p._aligned(name, like, target) for p in parts])
                for name, like in template.items()}
        return merged

    def _aligned(self, name: str, like: mx.array, target: int) -> mx.array:
        """This batch's written positions of plane `name`, left-padded to `target`."""
        if self._planes is None:
            return mx.zeros((self.num_rows, like.shape[1], target, like.shape[3]), like.dtype)
        written = self._planes[name][:, :, : self._idx]
        if target == self._idx:
            return written
        return mx.pad(written, [(0, 0), (0, 0), (target - self._idx, 0), (0, 0)])

    def extend(self, other: KvTensorRows) -> None:
        """Append other's rows after this batch's rows (in place), right-aligned."""
        merged = KvTensorRows.merge([self, other])
        self._planes, self._left_padding, self._idx = (
            merged._planes, merged._left_padding, merged._idx)

    def take(self, keep: Sequence[int]) -> None:
        """Keep rows `keep` in that order (in place); positions are unchanged."""
        if any(i not in range(self.num_rows) for i in keep):
            raise ValueError(f"row indices {list(keep)} outside 0..{self.num_rows - 1}")
        if self._planes is not None:
            index = mx.array(list(keep), dtype=mx.int32)
            self._planes = {n: a[index] for n, a in self._planes.items()}
        self._left_padding = [self._left_padding[i] for i in keep]

    def filter(self, keep: Sequence[int]) -> None:
        """Keep rows `keep` in that order, then shift away the padding they all share."""
        self.take(keep)
        self.unpad(self.shared_padding())

    def shared_padding(self) -> int:
        """Leading positions that are written and padding in every row: what `unpad` may
        drop. A prefill group's rows may all still be inside their padding (their first
        prompt token not yet written), so it is capped at the write index."""
        return min(min(self._left_padding, default=0), self._idx)

    def unpad(self, shared: int) -> None:
        """Drop the first `shared` positions, padding in every row (0 <= shared <= padding)."""
        if shared < 0 or shared > min(min(self._left_padding, default=self._idx), self._idx):
            raise ValueError(f"cannot drop {shared} positions of padding {self._left_padding}")
        if shared == 0:
            return
        if self._planes is not None:
            self._planes = {n: a[:, :, shared:] for n, a in self._planes.items()}
        self._idx -= shared
        self._left_padding = [p - shared for p in self._left_padding]

    def pad_to(self, target: int) -> None:
        """Left-pad every row so that the write index becomes `target` (>= idx)."""
        if target < self._idx:
            raise ValueError(f"cannot pad write index {self._idx} down to {target}")
        if target == self._idx:
            return
        if self._planes is not None:
            self._planes = {n: self._aligned(n, a, target) for n, a in self._planes.items()}
        self._left_padding = [p + target - self._idx for p in self._left_padding]
        self._idx = target

    def extract(self, i: int) -> Planes:
        """Row i's written planes (1, H, offset_i, W) without padding, as fresh arrays."""
        if i not in range(self.num_rows):
            raise ValueError(f"row {i} outside 0..{self.num_rows - 1}")
        start = self._left_padding[i]
        return {n: mx.contiguous(a[i : i + 1, :, start : self._idx])
                for n, a in (self._planes or {}).items()}

    def trim(self, n: int) -> int:
        """Drop the last n positions of every row, at most the shortest row's offset."""
        n = max(0, min(n, min(self.offsets, default=self._idx)))
        self._idx -= n
        return n

    def trim_rows(self, amounts: Sequence[int]) -> None:
        """Drop the last amounts[i] positions of row i (speculative rollback).

        Contract: 0 <= amounts[i] <= offsets[i], one amount per row, else ValueError and
        nothing changes. Afterwards row i holds offsets[i] - amounts[i] positions and its
        kept bytes are unchanged. The shared part (the smallest amount) lowers the write
        index; each row's rest is rolled to its left padding (encoded bytes only)."""
        amounts = [int(a) for a in amounts]
        if len(amounts) != self.num_rows or any(
                not 0 <= a <= off for a, off in zip(amounts, self.offsets)):
            raise ValueError(f"cannot trim {amounts} from rows holding {list(self.offsets)}")
        shared = min(amounts, default=0)
        self._idx -= shared
        self.shift_rows([a - shared for a in amounts])

    def shift_rows(self, amounts: Sequence[int]) -> None:
        """Turn the last amounts[i] positions of row i into left padding: the row ends
        amounts[i] positions earlier while the write index stays (see `trim_rows`)."""
        amounts = [int(a) for a in amounts]
        if len(amounts) != self.num_rows or any(
                not 0 <= a <= off for a, off in zip(amounts, self.offsets)):
            raise ValueError(f"cannot shift {amounts} in rows holding {list(self.offsets)}")
        if not any(amounts):
            return
        if self._planes is not None:
            shifts = mx.array(amounts)
            self._planes = {n: _roll_right(a[:, :, : self._idx], shifts)
                            for n, a in self._planes.items()}
        self._left_padding = [p + a for p, a in zip(self._left_padding, amounts)]

    def prepare(self, *, left_padding: Sequence[int] | None = None,
                right_padding: Sequence[int] | None = None) -> None:
        """mlx-lm's batch prefill hooks: add left padding (empty rows only) or note the
        right padding of the next right-padded block, which `finalize` moves to the left."""
        if left_padding is not None:
            if self._planes is not None:
                raise ValueError("left padding can only be added to empty rows")
            if len(left_padding) != self.num_rows:
                raise ValueError(f"{len(left_padding)} paddings for {self.num_rows} rows")
            self._left_padding = [p + int(q) for p, q in zip(self._left_padding, left_padding)]
        if right_padding is not None and max(right_padding, default=0) > 0:
            if len(right_padding) != self.num_rows:
                raise ValueError(f"{len(right_padding)} paddings for {self.num_rows} rows")
            self._right_padding = [int(q) for q in right_padding]

    def finalize(self) -> None:
        """Roll the noted right padding of each row to its left (after a padded prefill)."""
        if self._right_padding is None:
            return
        if self._planes is not None:
            shifts = mx.array(self._right_padding)
            self._planes = {n: _roll_right(a[:, :, : self._idx], shifts)
                            for n, a in self._planes.items()}
        self._left_padding = [p + q for p, q in zip(self._left_padding, self._right_padding)]
        self._right_padding = None


class SingleRowView:
    """The position side of mlx-lm's protocol for a one-row cache on `self.rows`."""

    rows: KvTensorRows

    def _reshape_empty(self, num_rows: int) -> None:
        self.rows = KvTensorRows([0] * num_rows)

    @property
    def offset(self) -> int:
        """Tokens held."""
        return self.rows.idx

    def make_mask(self, N: int, return_array: bool = False,
                  window_size: int | None = None) -> Any:
        """The mask a KVCache at this offset makes: None, "causal" or an array."""
        return create_attention_mask(N, self.offset, return_array, window_size)


class BatchRowsView:
    """The position side of mlx-lm's protocol for a batched cache on `self.rows`
    (as BatchKVCache: per-row offset and left padding arrays, a padded causal mask)."""

    rows: KvTensorRows

    @property
    def offset(self) -> mx.array:
        """Tokens held per row (int32 array)."""
        return mx.array(self.rows.offsets, dtype=mx.int32)

    @property
    def left_padding(self) -> mx.array:
        """Physical left padding per row (int32 array)."""
        return mx.array(self.rows.left_padding, dtype=mx.int32)

    def prepare(self, *, left_padding: Sequence[int] | None = None,
                lengths: Sequence[int] | None = None,
                right_padding: Sequence[int] | None = None) -> None:
        """mlx-lm's batch prefill hook (`lengths` is unused, as in BatchKVCache)."""
        self.rows.prepare(left_padding=left_padding, right_padding=right_padding)

    def finalize(self) -> None:
        """Move right padding noted by `prepare` to the left."""
        self.rows.finalize()

    def make_mask(self, N: int, return_array: bool = False, **kwargs: Any) -> mx.array:
        """Causal boolean mask (B, 1, N, idx + N) hiding each row's padding."""
        return create_causal_mask(N, offset=self.rows.idx, left_padding=self.left_padding,
                                  **kwargs)


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
        """Positions written (the shared write index; padding included for batches)."""
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
        """Drop the last n positions (at most the shortest row); returns how many."""
        return self.rows.trim(n)

    def trim_rows(self, amounts: Sequence[int]) -> None:
        """Drop the last amounts[i] positions of row i (KvTensorRows.trim_rows)."""
        self.rows.trim_rows(amounts)
