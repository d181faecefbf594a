"""Per-layer TurboQuant and affine cache lists for a model, head-dim checks, the bits spec.

`make_turboquant_cache_factory(...)` returns a `make_cache(model)` with the shape of
mlx-lm's `make_prompt_cache`: it asks the model for its plain caches and replaces every
full-attention layer's (a plain mlx-lm `KVCache`) with a TurboQuantKVCache, or a
DelayedTurboQuantKVCache when `quantized_kv_start` > 0. Every other layer keeps its plain
mlx-lm cache: sliding-window layers (RotatingKVCache) stay in the model dtype because a
rotating buffer overwrites positions in place, and the first list a factory makes that has
such layers logs ONE warning naming them. Every cache it makes has the factory's decode
path (`decode`: engine.attention.sdpa.DECODE_PATHS).

`make_affine_cache_factory(bits, group_size)` does the same with AffineKVCache (mlx-lm's
`kv_bits` quantization, batchable); `check_affine_head_dims` refuses a full-attention layer
whose head dim is not a multiple of the group size. TurboQuant and affine KV are mutually
exclusive: `cache_factory_for` given both picks TurboQuant and logs one warning.

`check_head_dims(model)` is the engine-start check: a full-attention layer whose key or
value head dim is not one the codec supports raises ValueError naming the layer and dim.
Head dims come from the layer's attention module: its `head_dim`, else its projections'
output width per KV head (the output width of quantized linears is unpacked too).
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache, make_prompt_cache

from tqserve.engine.codec.turboquant import MAX_BITS, MIN_BITS, SUPPORTED_HEAD_DIMS
from tqserve.engine.attention import cuda_decode
from tqserve.engine.kv.affine import AffineKVCache, check_affine_settings
from tqserve.engine.attention.sdpa import install_attention, on_cuda
from tqserve.engine.kv.delayed import DelayedTurboQuantKVCache
from tqserve.engine.kv.turboquant import TurboQuantConfig, TurboQuantKVCache

logger = logging.getLogger(__name__)

CacheFactory = Callable[[Any], list[Any]]
_SPEC = re.compile(r"k(\d+)v(\d+)")


def parse_turboquant(spec: str) -> tuple[int, int]:
    """"k4v4" -> (4, 4): key bits and value bits, each 1..8."""
    match = _SPEC.fullmatch(spec.strip().lower())
    bits = (int(match.group(1)), int(match.group(2))) if match else None
    if bits is None or any(b not in range(MIN_BITS, MAX_BITS + 1) for b in bits):
        raise ValueError(f"turboquant spec {spec!r} is not k<bits>v<bits> with bits in "
                         f"{MIN_BITS}..{MAX_BITS} (e.g. k4v4, k8v3)")
    return bits


def _projection_dim(attn: Any, name: str) -> int | None:
    proj = getattr(attn, name, None)
    heads = getattr(attn, "n_kv_heads", None)
    if proj is None or heads is None or not hasattr(proj, "weight"):
        return None
    return int(proj.weight.shape[0]) // int(heads)


def _layer_dims(layer: Any) -> tuple[int, int]:
    attn = getattr(layer, "self_attn", None)
    head_dim = getattr(attn, "head_dim", None)
    keys = head_dim if head_dim is not None else _projection_dim(attn, "k_proj")
    values = _projection_dim(attn, "v_proj") or keys
    if keys is None or values is None:
        raise ValueError(f"cannot find the head dim of {type(attn).__name__}")
    return int(keys), int(values)


def check_head_dims(model: Any) -> dict[int, int]:
    """Full-attention layer index -> head dim; ValueError names a layer the codec refuses."""
    dims = {}
    for i, cache in enumerate(make_prompt_cache(model)):
        if type(cache) is not KVCache:
            continue
        key_dim, value_dim = _layer_dims(model.layers[i])
        for kind, dim in (("key", key_dim), ("value", value_dim)):
            if dim not in SUPPORTED_HEAD_DIMS:
                raise ValueError(
                    f"layer {i}: {kind} head dim {dim} is not supported by TurboQuant "
                    f"(supported: {', '.join(map(str, SUPPORTED_HEAD_DIMS))})")
        if key_dim != value_dim:
            raise ValueError(f"layer {i}: key head dim {key_dim} != value head dim {value_dim}")
        dims[i] = key_dim
    return dims


def check_affine_head_dims(model: Any, group_size: int) -> list[int]:
    """Full-attention layer indices; ValueError names a layer whose key or value head dim is
    not a multiple of `group_size`."""
    layers = []
    for i, cache in enumerate(make_prompt_cache(model)):
        if type(cache) is not KVCache:
            continue
        for kind, dim in zip(("key", "value"), _layer_dims(model.layers[i])):
            if dim % group_size:
                raise ValueError(f"layer {i}: {kind} head dim {dim} is not a multiple of "
                                 f"kv-group-size {group_size}")
        layers.append(i)
    return layers


def cache_factory_for(model: Any, turboquant: str | None, quantized_kv_start: int = 0,
                      kv_quant: int | None = None, kv_group_size: int = 64,
                      decode: str = "auto") -> CacheFactory | None:
    """The engine-start choice: None for mlx-lm's plain caches, else a TurboQuant factory,
    else (`kv_quant` bits) an affine one.

    Checks every full-attention layer's head dim now (ValueError naming the layer), so a
    model the cache cannot serve is refused before any request; TurboQuant also installs
    the rotated attention port into mlx-lm's dispatch. Given both, TurboQuant wins and one
    warning is logged. `quantized_kv_start` applies to TurboQuant only (ValueError with
    affine KV, which quantizes from the first token). `decode` is TurboQuant's decode path.
    """
    if turboquant is None:
        if kv_quant is None:
            if on_cuda():
                install_attention()  # short query blocks avoid cuDNN's per-shape graphs
            return None
        if quantized_kv_start > 0:
            raise ValueError("--quantized-kv-start applies to TurboQuant only; --kv-quant "
                             "quantizes from the first token")
        factory = make_affine_cache_factory(kv_quant, kv_group_size)
        check_affine_head_dims(model, kv_group_size)
        install_attention()  # on MLX-CUDA affine attention dequantizes (affine_sdpa)
        return factory
    k_bits, v_bits = parse_turboquant(turboquant)
    check_head_dims(model)
    install_attention()
    if kv_quant is not None:
        logger.warning("turboquant %s and kv-quant %d are mutually exclusive: using "
                       "TurboQuant, ignoring kv-quant", turboquant, kv_quant)
    if decode == "auto":
        _warm_cuda_kernels(model, k_bits, v_bits)
    return make_turboquant_cache_factory(k_bits, v_bits, quantized_kv_start, decode=decode)


def _warm_cuda_kernels(model: Any, k_bits: int, v_bits: int) -> None:
    """On MLX's CUDA backend, build the TurboQuant kernels for this model's shapes now
    (behind one log line), so that no request pays their JIT compile."""
    if not cuda_decode.available(SUPPORTED_HEAD_DIMS[0], 1):
        return
    dims = check_head_dims(model)
    if not dims:
        return
    attn = model.layers[next(iter(dims))].self_attn
    heads, kv_heads = getattr(attn, "n_heads", None), getattr(attn, "n_kv_heads", None)
    if not heads or not kv_heads:
        return
    proj = getattr(attn, "q_proj", None)
    dtype = getattr(proj, "scales", getattr(proj, "weight", None))
    dtype = dtype.dtype if dtype is not None else mx.bfloat16
    seconds = warm_up_kernels(dims, heads // kv_heads, k_bits, v_bits, dtype)
    logger.info("TurboQuant k%dv%d CUDA kernels built in %.1f s (head dims %s, group %d, %s)",
                k_bits, v_bits, seconds, sorted(set(dims.values())), heads // kv_heads, dtype)


def warm_up_kernels(head_dims: dict[int, int], group: int, k_bits: int, v_bits: int,
            dtype: mx.Dtype, seed: int = 0) -> float:
    """Build (JIT-compile) the kernels for these shapes now, so no request pays for it:
    one encode and one decode step per distinct head dim. Returns the seconds spent."""
    tic = time.perf_counter()
    for head_dim in sorted(set(head_dims.values())):
        if not cuda_decode.available(head_dim, group):
            continue
        cache = TurboQuantKVCache(k_bits, v_bits, head_dim, seed=seed, decode="auto")
        kv = mx.zeros((1, 1, 2, head_dim), dtype=dtype) + 1
        cache.update_and_fetch(kv, kv)
        fetched, _ = cache.update_and_fetch(kv[:, :, :1], kv[:, :, :1])
        q = mx.ones((1, group, 1, head_dim), dtype=dtype)
        mx.eval(cuda_decode.decode_attention(q, fetched, 1.0))
    return time.perf_counter() - tic


def _layer_replacing_factory(label: str, full_layers: Callable[[Any], dict[int, int]],
                             make_layer: Callable[[int], Any]) -> CacheFactory:
    """mlx-lm's cache list with every full-attention layer's cache made by `make_layer`
    (given the layer's head dim); the first list with other layers logs ONE warning."""
    warned = False
    layers_by_model: dict[int, dict[int, int]] = {}

    def make_cache(model: Any) -> list[Any]:
        nonlocal warned
        if id(model) not in layers_by_model:
            layers_by_model[id(model)] = full_layers(model)
        layers = layers_by_model[id(model)]
        caches = make_prompt_cache(model)
        plain = [i for i in range(len(caches)) if i not in layers]
        if plain and not warned:
            warned = True
            logger.warning("%s: layers %s keep plain %s caches (sliding window or not full "
                           "attention)", label, plain,
                           sorted({type(caches[i]).__name__ for i in plain}))
        for i, head_dim in layers.items():
            caches[i] = make_layer(head_dim)
        return caches

    return make_cache


def make_affine_cache_factory(bits: int, group_size: int = 64) -> CacheFactory:
    """A `make_cache(model) -> list` of AffineKVCache for full-attention layers."""
    check_affine_settings(bits, group_size)
    return _layer_replacing_factory(
        "kv-quant", lambda model: dict.fromkeys(check_affine_head_dims(model, group_size), 0),
        lambda head_dim: AffineKVCache(bits, group_size))


def make_turboquant_cache_factory(k_bits: int, v_bits: int, quantized_kv_start: int = 0,
                                  seed: int = 0, decode: str = "auto") -> CacheFactory:
    """A `make_cache(model) -> list` of TurboQuant caches for full-attention layers."""
    # Validate the bits and the decode path now, not at the first request.
    TurboQuantConfig.create(k_bits, v_bits, SUPPORTED_HEAD_DIMS[0], seed, decode=decode)
    if quantized_kv_start < 0:
        raise ValueError(f"quantized_kv_start must be >= 0, got {quantized_kv_start}")

    def make_layer(head_dim: int) -> Any:
        if quantized_kv_start > 0:
            return DelayedTurboQuantKVCache(quantized_kv_start, k_bits, v_bits, head_dim,
                                            seed=seed, decode=decode)
        return TurboQuantKVCache(k_bits, v_bits, head_dim, seed=seed, decode=decode)

    return _layer_replacing_factory("TurboQuant", check_head_dims, make_layer)
