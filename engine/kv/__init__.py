"""KV cache classes on mlx-lm's cache protocol: one family on one position store
(slot_rows.py). For every batch (the prefill groups and the decode batch) the per-row
slots of each kind (slots.py: `slot_batch_of`); a single row of each kind (plain is
mlx-lm's KVCache; TurboQuant, affine and delayed TurboQuant are their slot classes seen
as one sequence, slot_cache.OneRow); the per-model cache factory. How attention reads
these planes (the rotated attention port, the fused decode, the CUDA kernels) is
engine.attention's."""

from tqserve.engine.kv.affine import AffineKVCache, AffineSlotsKVCache
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
from tqserve.engine.kv.slots import RowSlotsKVCache, slot_batch, slot_batch_of
from tqserve.engine.kv.turboquant import (TurboQuantConfig, TurboQuantKVCache,
                                          TurboQuantSlotsKVCache)

__all__ = [
    "AffineKVCache",
    "AffineSlotsKVCache",
    "DelayedTurboQuantKVCache",
    "DelayedTurboQuantSlotsKVCache",
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
