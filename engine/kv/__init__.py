"""KV cache classes on mlx-lm's cache protocol: one family. A single row of each kind
(plain mlx-lm KVCache, TurboQuant, delayed TurboQuant, affine) and, for every batch (the
prefill groups and the decode batch), the per-row slots of each kind (slots.py:
`slot_batch_of`); the per-model cache factory. How attention reads these planes (the
rotated attention port, the fused decode, the CUDA kernels) is engine.attention's."""

from tqserve.engine.kv.affine import AffineKVCache
from tqserve.engine.kv.delayed import DelayedTurboQuantKVCache
from tqserve.engine.kv.delayed_slots import DelayedTurboQuantSlotsKVCache
from tqserve.engine.kv.factory import (
    cache_factory_for,
    check_affine_head_dims,
    check_head_dims,
    make_affine_cache_factory,
    make_turboquant_cache_factory,
    parse_turboquant,
)
from tqserve.engine.kv.quant_slots import AffineSlotsKVCache, TurboQuantSlotsKVCache
from tqserve.engine.kv.rows import KvTensorRows
from tqserve.engine.kv.slots import RowSlotsKVCache, slot_batch, slot_batch_of
from tqserve.engine.kv.turboquant import TurboQuantConfig, TurboQuantKVCache

__all__ = [
    "AffineKVCache",
    "AffineSlotsKVCache",
    "DelayedTurboQuantKVCache",
    "DelayedTurboQuantSlotsKVCache",
    "KvTensorRows",
    "RowSlotsKVCache",
    "TurboQuantConfig",
    "TurboQuantKVCache",
    "TurboQuantSlotsKVCache",
    "cache_factory_for",
    "check_affine_head_dims",
    "check_head_dims",
    "make_affine_cache_factory",
    "make_turboquant_cache_factory",
    "parse_turboquant",
    "slot_batch",
    "slot_batch_of",
]
