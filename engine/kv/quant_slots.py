"""Affine and TurboQuant KV in per-row slots: rows join and leave without copying the others.

The decode batch's caches for `AffineKVCache` and `TurboQuantKVCache` layers, on the same
encoded planes as their single rows (affine: key_wq, key_scales, key_biases and the value
three; TurboQuant: key_codes, key_norms, value_codes, value_norms) held in a `SlotRows`
(engine/kv/slot_rows.py): row i in slot i, LEFT-aligned at [0, lengths[i]). So:

* a step encodes its block and writes row i's positions at its own length; attention
  reads positions [0, longest row) with the mask of `make_mask` (each row's own length,
  causal inside the block). `offset` is the lengths as an array (per-row RoPE offsets).
  TurboQuant fetches a `RotatedKV` whose rows start at 0 and end at their own lengths
  (`ends`), so the fused decode (compiled ops, or the CUDA kernel) needs no mask;
* `extend` writes only the joining rows (single rows or slot batches of the kind) into
  free slots, `filter` with `retire_order` moves at most one row per retirement,
  `trim_rows` lowers lengths (speculative rollback): encoded bytes only, never decoded;
* `extract(i)` is row i as the single-row class (its bytes): what prefix snapshots hold.
Settings (bits, group size; a TurboQuantConfig with its fused-decode selection) come from
the first row that joins and must match every later one (ValueError). `state` is the
planes up to the longest row, the lengths array, then the settings.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import _BaseCache

from tqserve.engine.attention import cuda_decode
from tqserve.engine.kv.affine import PLANES as AFFINE_PLANES
from tqserve.engine.kv.affine import AffineKVCache, Quantized
from tqserve.engine.attention.sdpa import RotatedKV
from tqserve.engine.kv.rows import KvTensorRows, row_indices
from tqserve.engine.kv.slot_rows import Planes, SlotRows
from tqserve.engine.kv.turboquant import PLANES as TQ_PLANES
from tqserve.engine.kv.turboquant import TurboQuantConfig, TurboQuantKVCache


def tensor_rows_of(rows: KvTensorRows) -> list[Planes]:
    """Each row's written planes (1, H, offset, W) of a KvTensorRows, as views ({} for a
    row that holds no position)."""
    planes = rows.planes
    return [{n: a[i:i + 1, :, :rows.idx] for n, a in planes.items()} if planes and rows.idx
            else {} for i in range(rows.num_rows)]


class SlotsCache(_BaseCache):
    """What every slot batch shares: a SlotRows, the position side of the protocol."""

    slots: SlotRows

    def extend(self, other: Any) -> None:
        """Append the rows of `other` (single rows or batches) in free slots."""
        raise NotImplementedError

    @classmethod
    def merge(cls, caches: Sequence[Any]) -> Any:
        """A slot batch of the rows of `caches` (single rows or batches), in order."""
        out = cls()
        for cache in caches:
            out.extend(cache)
        return out

    @property
    def num_rows(self) -> int:
        return self.slots.num_rows

    @property
    def lengths(self) -> list[int]:
        """Tokens held per row."""
        return self.slots.lengths

    @property
    def offset(self) -> mx.array:
        """Per-row lengths (RoPE offsets of the next positions)."""
        return self.slots.offset

    def make_mask(self, N: int, return_array: bool = False, **kwargs: Any) -> mx.array | None:
        """(rows, 1, N, longest + N): query q of row i sees positions <= lengths[i] + q;
        None for one decode position of rows of equal length (SlotRows.mask)."""
        return self.slots.mask(N)

    def filter(self, batch_indices: Sequence[int] | mx.array) -> None:
        """Keep rows `batch_indices` in that order; only rows whose slot changes move."""
        self.slots.take(row_indices(batch_indices))

    def trim_rows(self, amounts: Sequence[int]) -> None:
        """Drop the last amounts[i] positions of row i (0 <= amounts[i] <= its length, else
        ValueError and nothing changes); no byte moves."""
        self.slots.trim_rows(amounts)

    def trim(self, n: int) -> int:
        """Uniform trim of every row, as far as the shortest allows; returns how many."""
        n = max(0, min([n, *self.slots.lengths]))
        self.slots.trim_rows([n] * self.num_rows)
        return n

    def is_trimmable(self) -> bool:
        return True

    def size(self) -> int:
        return max(self.slots.lengths, default=0)

    def empty(self) -> bool:
        return self.slots.empty

    @property
    def nbytes(self) -> int:
        """Allocated bytes of the slot planes (free slots and slack included)."""
        return self.slots.nbytes

    def _planes_state(self, names: Sequence[str]) -> tuple[Any, ...]:
        fetched = self.slots.fetch()
        return (*(fetched.get(n) for n in names), self.slots.offset)

    def _set_planes_state(self, names: Sequence[str], v: Sequence[Any]) -> None:
        lengths = [int(x) for x in v[len(names)].tolist()]
        self.slots = SlotRows()
        planes = {n: a for n, a in zip(names, v) if a is not None}
        self.slots.add_rows([{n: a[i:i + 1, :, :p] for n, a in planes.items()} if p and planes
                             else None for i, p in enumerate(lengths)])


class AffineSlotsKVCache(SlotsCache):
    """A batch of affine-quantized rows in slots (module doc)."""

    def __init__(self, bits: int | None = None, group_size: int | None = None) -> None:
        """Empty; the settings are taken from the first row that joins, unless given."""
        self.bits = bits
        self.group_size = group_size
        self.slots = SlotRows()

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Quantized, Quantized]:
        """Quantize (rows, H, L, D) keys and values, write each row at its length; fetch
        the (wq, scales, biases) of keys and of values up to the longest row."""
        if keys.ndim != 4 or values.shape[:3] != keys.shape[:3] or keys.shape[0] != self.num_rows:
            raise ValueError(f"expected keys and values ({self.num_rows}, H, L, D), got "
                             f"{keys.shape} and {values.shape}")
        if self.bits is None or self.group_size is None:
            raise ValueError("an affine slot batch without rows has no settings")
        encoded = (*mx.quantize(keys, group_size=self.group_size, bits=self.bits),
                   *mx.quantize(values, group_size=self.group_size, bits=self.bits))
        self.slots.append(dict(zip(AFFINE_PLANES, encoded)))
        p = self.slots.fetch()
        return ((p["key_wq"], p["key_scales"], p["key_biases"]),
                (p["value_wq"], p["value_scales"], p["value_biases"]))

    def extend(self, other: Any) -> None:
        """Append the rows of `other` (an AffineKVCache or another affine slot batch): only
        their bytes are written."""
        if isinstance(other, AffineSlotsKVCache):
            settings, rows = (other.bits, other.group_size), [
                other.slots.row(i) for i in range(other.num_rows)]
        elif isinstance(other, AffineKVCache):
            settings, rows = (other.bits, other.group_size), tensor_rows_of(other.rows)
        else:
            raise TypeError(f"a {type(other).__name__} cannot join an affine slot batch")
        if self.bits is None:
            self.bits, self.group_size = settings
        elif settings != (self.bits, self.group_size):
            raise ValueError(f"cannot combine affine caches of bits/group size "
                             f"{self.bits}/{self.group_size} and {settings[0]}/{settings[1]}")
        self.slots.add_rows([r or None for r in rows])

    def extract(self, idx: int) -> AffineKVCache:
        """Row idx as a single-row AffineKVCache (a copy of its bytes)."""
        if self.bits is None or self.group_size is None:
            raise ValueError("an affine slot batch without rows has no settings")
        row = AffineKVCache(self.bits, self.group_size)
        row.rows = KvTensorRows.from_planes(self.slots.extract(idx))
        return row

    @property
    def state(self) -> tuple[Any, ...]:
        """The six planes up to the longest row (or Nones), lengths, bits, group_size."""
        return (*self._planes_state(AFFINE_PLANES), self.bits, self.group_size)

    @state.setter
    def state(self, v: Sequence[Any]) -> None:
        self._set_planes_state(AFFINE_PLANES, v)
        self.bits, self.group_size = int(v[7]), int(v[8])


class TurboQuantSlotsKVCache(SlotsCache):
    """A batch of TurboQuant rows in slots (module doc)."""

    def __init__(self, config: TurboQuantConfig | None = None) -> None:
        """Empty; the config is taken from the first row that joins, unless given."""
        self.config = config
        self.slots = SlotRows()

    @property
    def fused_decode(self) -> bool:
        """Whether decode steps take the fused attention path (fixed by the config)."""
        return self.config is not None and self.config.fused_decode

    def _config(self) -> TurboQuantConfig:
        if self.config is None:
            raise ValueError("a TurboQuant slot batch without rows has no config")
        return self.config

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[RotatedKV, RotatedKV]:
        """Encode (rows, H, L, head_dim) keys and values, write each row at its length;
        fetch a RotatedKV of the rows' allocated planes with their own ends."""
        config = self._config()
        d = config.head_dim
        if keys.ndim != 4 or keys.shape[-1] != d or values.shape != keys.shape or (
                keys.shape[0] != self.num_rows):
            raise ValueError(f"expected keys and values ({self.num_rows}, H, L, {d}), got "
                             f"{keys.shape} and {values.shape}")
        self.write(keys, values)
        fetched = self.fetch()
        return fetched, fetched

    def write(self, keys: mx.array, values: mx.array) -> None:
        """Encode and write a block of every row (no fetch)."""
        key_codec, value_codec = self._config().key_codec, self._config().value_codec
        if cuda_decode.can_encode(key_codec, value_codec):
            k, v = cuda_decode.encode(keys, values, key_codec, value_codec)
        else:
            k, v = key_codec.encode(keys), value_codec.encode(values)
        self.slots.append({"key_codes": k.codes, "key_norms": k.norms,
                           "value_codes": v.codes, "value_norms": v.norms})

    def fetch(self) -> RotatedKV:
        """The rows' allocated planes (rows, H, T_alloc, W), rows [0, lengths[i])."""
        config = self._config()
        planes = self.slots.planes()
        lengths = tuple(self.slots.lengths)
        return RotatedKV(**{n: planes[n] for n in TQ_PLANES}, key_codec=config.key_codec,
                         value_codec=config.value_codec, fused_decode=config.fused_decode,
                         length=max(lengths, default=0), ends=lengths)

    def extend(self, other: Any) -> None:
        """Append the rows of `other` (a TurboQuantKVCache or another TurboQuant slot
        batch): only their bytes are written."""
        if isinstance(other, TurboQuantSlotsKVCache):
            config, rows = other.config, [other.slots.row(i) for i in range(other.num_rows)]
        elif isinstance(other, TurboQuantKVCache):
            config, rows = other.config, tensor_rows_of(other.rows)
        else:
            raise TypeError(f"a {type(other).__name__} cannot join a TurboQuant slot batch")
        self.add(config, rows)

    def add(self, config: TurboQuantConfig | None, rows: Sequence[Planes]) -> None:
        """Append rows given as plane dicts ({} for an empty row) encoded with `config`."""
        if self.config is None:
            self.config = config
        elif config is not None and config != self.config:
            raise ValueError(f"cannot combine TurboQuant caches {self.config} and {config}")
        self.slots.add_rows([r or None for r in rows])

    def extract(self, idx: int) -> TurboQuantKVCache:
        """Row idx as a single-row TurboQuantKVCache (a copy of its bytes, same config)."""
        return TurboQuantKVCache.of(self._config(),
                                    KvTensorRows.from_planes(self.slots.extract(idx)))

    @property
    def state(self) -> tuple[Any, ...]:
        """The four planes up to the longest row (or Nones), lengths, the config fields."""
        return (*self._planes_state(TQ_PLANES), *self._config().scalars())

    @state.setter
    def state(self, v: Sequence[Any]) -> None:
        self._set_planes_state(TQ_PLANES, v)
        self.config = TurboQuantConfig.from_scalars(v[5:])
