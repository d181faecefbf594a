"""KV cache classes on mlx-lm's cache protocol: encoded rows, TurboQuant (single, batched,
delayed), the rotated attention port and the per-model cache factory."""

from engine.kv.attention import (
    FUSED_DECODE_ENV,
    MixedRowsKV,
    RotatedKV,
    fused_decode_from_env,
    install_attention,
    turboquant_sdpa,
)
from engine.kv.delayed import BatchedDelayedTurboQuantKVCache, DelayedTurboQuantKVCache
from engine.kv.factory import (
    cache_factory_for,
    check_head_dims,
    make_turboquant_cache_factory,
    parse_turboquant,
)
from engine.kv.rows import KvTensorRows
from engine.kv.turboquant import (
    BatchedTurboQuantKVCache,
    TurboQuantConfig,
    TurboQuantKVCache,
)

__all__ = [
    "FUSED_DECODE_ENV",
    "BatchedDelayedTurboQuantKVCache",
    "BatchedTurboQuantKVCache",
    "DelayedTurboQuantKVCache",
    "KvTensorRows",
    "MixedRowsKV",
    "RotatedKV",
    "TurboQuantConfig",
    "TurboQuantKVCache",
    "cache_factory_for",
    "check_head_dims",
    "fused_decode_from_env",
    "install_attention",
    "make_turboquant_cache_factory",
    "parse_turboquant",
    "turboquant_sdpa",
]
