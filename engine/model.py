"""Model loading: local directory, hub id or GGUF file; dtype policy, fingerprint, limits.

`load_model` is the one way every path (serving, generate, bench, tests) loads a
model, so that the fingerprint and the dtype policy are the same everywhere.

dtype `auto` resolves to float32 on MLX's CPU backend (its bf16/fp16 and quantized
matmuls are several times slower than float32 there) and to the model's own
dtype on a GPU (Metal or CUDA).

Quantized weights (an mlx-community 4/8-bit checkpoint, a GGUF file's Q4_0/Q4_1/Q8_0
tensors; engine.gguf loads the latter) follow `quantized_weights`: `keep` leaves them
packed (MLX's quantized matmuls, a quarter of the memory at 4 bits), `dequantize` turns
every quantized layer into a plain one in the resolved dtype at load, and `auto` (the
default) dequantizes on MLX's CPU backend, where its quantized matmuls are slower than
float32 ones (2 idle cores, OpenBLAS: SmolLM2-135M Q4_1 decodes 7.3 tok/s packed, 9.8
dequantized to float32, prefill 10 vs 187 tok/s; a 4-bit pycoder-29m dequantized decodes
at 0.96x the float32 checkpoint, packed at 0.66x: docs/models.md), and keeps them packed
on a GPU. The choice is in the fingerprint.

float32 on MLX's CUDA backend: MLX runs float32 matmuls as TF32 unless the environment
variable MLX_ENABLE_TF32 is 0, which it reads once, at its first float32 matmul. TF32
keeps 10 mantissa bits, so a row's projections differ with its batch's size by ~1e-3,
enough to move a TurboQuant or affine KV code and then a token. A float32 model is
loaded with MLX_ENABLE_TF32=0 unless the user set it (`keep_float32_exact`); where MLX
had read it already, one warning says so.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any, cast

import attrs
import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.utils import dequantize_model
from mlx_lm.utils import load as mlx_lm_load

from tqserve import blas

DTYPES = ("auto", "float32", "bfloat16", "float16")
QUANTIZED_WEIGHTS = ("auto", "keep", "dequantize")
DEFAULT_MODEL = Path(__file__).resolve().parent.parent / "models" / "pycoder-draft-4m"
_CHUNK = 1 << 20
TF32_ENV = "MLX_ENABLE_TF32"
logger = logging.getLogger(__name__)


class ModelLoadError(ValueError):
    """The model path, id or files cannot be used (the user's input is at fault)."""


@attrs.frozen(kw_only=True)
class LoadedModel:
    """A loaded model with everything the engine needs to know about it."""

    model: Any
    tokenizer: Any
    path: Path
    dtype: str
    fingerprint: str
    num_layers: int
    head_dims: tuple[int, ...]
    context_length: int
    eos_token_ids: frozenset[int]
    vocab_size: int
    # "packed" (quantized layers kept), "dequantized" (they were quantized) or "none"
    quantized_weights: str = "none"


def resolve_dtype(requested: str) -> str:
    """Map `auto` to the dtype this backend runs fastest; pass others through."""
    if requested not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {requested!r}")
    if requested != "auto":
        return requested
    return "float32" if mx.default_device() == mx.cpu else "model"


def auto_on_gpu(setting: str) -> bool:
    """An `auto | on | off` setting (--warmup, --fast-decode) as a decision: `auto` means on
    a GPU only, where first shapes compile kernels and a decode step is host-bound."""
    return setting == "on" or (setting == "auto" and mx.default_device() != mx.cpu)


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def fingerprint(path: Path, dtype: str) -> str:
    """sha256 over config, every weight file, the tokenizer files and the dtype (of a GGUF
    file: the file and the dtype)."""
    h = hashlib.sha256()
    if path.is_file():
        h.update(_file_digest(path).encode())
        h.update(dtype.encode())
        return h.hexdigest()[:32]
    names = sorted(p.name for p in path.iterdir() if p.is_file())
    for name in names:
        if name.endswith((".json", ".safetensors", ".model", ".txt", ".jinja")):
            h.update(name.encode())
            h.update(_file_digest(path / name).encode())
    h.update(dtype.encode())
    return h.hexdigest()[:32]


def _resolve_path(model: str | Path) -> Path:
    path = Path(model)
    if path.is_file():  # a GGUF file (engine.gguf says so where it is not one)
        return path.resolve()
    if path.exists():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"model directory {str(model)!r} has no config.json")
        return path.resolve()
    if isinstance(model, str) and model.count("/") == 1 and not model.startswith((".", "/")):
        try:
            from mlx_lm.utils import _download

            return Path(_download(model))
        except Exception as exc:  # network/hub failures are the user's to fix
            raise ModelLoadError(f"cannot fetch model {model!r} from the hub: {exc}") from exc
    raise ModelLoadError(f"model {str(model)!r} is neither a directory nor a hub id")


def _head_dims(model: Any) -> tuple[int, ...]:
    dims = []
    for layer in model.layers:
        attn = getattr(layer, "self_attn", None)
        head_dim = getattr(attn, "head_dim", None)
        if head_dim is None and attn is not None and hasattr(attn, "k_proj"):
            head_dim = attn.k_proj.weight.shape[0] // attn.n_kv_heads
        dims.append(int(head_dim) if head_dim is not None else 0)
    return tuple(dims)


def keep_float32_exact() -> bool:
    """Ask MLX-CUDA for full-precision float32 matmuls (MLX_ENABLE_TF32=0 unless set) and
    check it with one 16x16 matmul whose exact sum TF32 cannot hold; False, with a
    warning, where float32 matmuls still run as TF32. True off CUDA (no TF32 there)."""
    cuda = getattr(mx, "cuda", None)
    if cuda is None or not cuda.is_available() or mx.default_device() != mx.gpu:
        return True
    os.environ.setdefault(TF32_ENV, "0")
    ones = mx.ones((16, 16), dtype=mx.float32)
    exact = ((ones * (1 + 2.0 ** -20)) @ ones)[0, 0].item() == 16 + 2.0 ** -16
    if not exact:
        logger.warning("float32 matmuls run as TF32 on this GPU (%s=%s, read by MLX before "
                       "the model loaded): batched rows may differ from single rows; start "
                       "the process with %s=0 for exact float32", TF32_ENV,
                       os.environ.get(TF32_ENV), TF32_ENV)
    return exact


def _private_arrays(net: Any) -> list[mx.array]:
    """Arrays modules keep outside their parameters (e.g. rope_utils' `_freqs` of Llama 3
    and Gemma 4 RoPE): built lazily at construction on this thread, they must be evaluated
    here; MLX cannot evaluate them later on the runner thread (no stream of this thread
    there: "There is no Stream(cpu, 0) in current thread")."""
    return [v for m in net.modules() for k, v in m.items()
            if k.startswith("_") and isinstance(v, mx.array)]


def _is_quantized(module: Any) -> bool:
    return hasattr(module, "scales") and hasattr(module, "group_size")


def apply_quantized_weights(net: Any, choice: str) -> tuple[Any, str]:
    """Keep or dequantize the quantized layers of `net` (module doc); returns the model
    and what was done: "packed", "dequantized" or "none" (no quantized layer)."""
    if choice not in QUANTIZED_WEIGHTS:
        raise ValueError(f"quantized_weights must be one of {', '.join(QUANTIZED_WEIGHTS)}, "
                         f"got {choice!r}")
    if not any(_is_quantized(m) for _, m in net.named_modules()):
        return net, "none"
    if choice == "keep" or (choice == "auto" and mx.default_device() != mx.cpu):
        return net, "packed"
    return dequantize_model(net), "dequantized"


def _load(path: Path, model: str | Path) -> tuple[Any, Any, dict[str, Any]]:
    """(model, tokenizer, config dict) of a GGUF file or an mlx-lm directory."""
    if path.is_file():
        from tqserve.engine.gguf import load_gguf
        from tqserve.engine.gguf_file import GGUFError

        try:
            return load_gguf(path)
        except GGUFError as exc:
            raise ModelLoadError(f"GGUF file {str(model)!r}: {exc}") from None
    try:
        net, tokenizer = mlx_lm_load(str(path))[:2]
    except Exception as exc:
        raise ModelLoadError(f"cannot load model at {str(model)!r}: {exc}") from exc
    return net, tokenizer, json.loads((path / "config.json").read_text())


def _float_dtype(net: Any) -> str:
    # without `destination`, tree_flatten returns the list of (name, leaf) pairs
    leaves = cast(list[tuple[str, mx.array]], tree_flatten(net.parameters()))
    floats = [v for _, v in leaves if mx.issubdtype(v.dtype, mx.floating)]
    return str(floats[0].dtype).split(".")[-1]


def load_model(model: str | Path = DEFAULT_MODEL, dtype: str = "auto",
               quantized_weights: str = "auto") -> LoadedModel:
    """Load a model directory, hub id or GGUF file; apply the dtype and quantized-weights
    policies (module doc)."""
    path = _resolve_path(model)
    resolved = resolve_dtype(dtype)
    net, tokenizer, config = _load(path, model)
    if resolved == "model":
        resolved = _float_dtype(net)
    else:  # floating parameters only: packed weights stay packed, their scales convert
        net.set_dtype(getattr(mx, resolved))
    net, weights = apply_quantized_weights(net, quantized_weights)
    scheme = resolved + ("+packed" if weights == "packed" else "")  # different numerics
    if resolved == "float32":
        keep_float32_exact()
    if mx.default_device() == mx.cpu:
        blas.warn_if_slow()  # once per process: the embedded API says it too (tqserve.blas)
    mx.eval(net.parameters(), _private_arrays(net))
    eos = set(tokenizer.eos_token_ids or [])
    if tokenizer.eos_token_id is not None:
        eos.add(int(tokenizer.eos_token_id))
    context = int(config.get("max_position_embeddings") or 4096)
    return LoadedModel(
        model=net,
        tokenizer=tokenizer,
        path=path,
        dtype=resolved,
        fingerprint=fingerprint(path, scheme),
        num_layers=len(net.layers),
        head_dims=_head_dims(net),
        context_length=context,
        eos_token_ids=frozenset(int(e) for e in eos),
        vocab_size=int(config.get("vocab_size", len(tokenizer.vocab))),
        quantized_weights=weights,
    )


def load_tokenizer(model: str | Path = DEFAULT_MODEL) -> Any | None:
    """The tokenizer alone (mlx-lm's wrapper, as load_model's) of a model directory or hub
    id, without its weights; None for a GGUF file (its vocabulary lives in the weights
    file) or where it cannot be loaded (the caller goes without: a router's keys)."""
    try:
        path = _resolve_path(model)
        if path.is_file():
            return None
        from mlx_lm.utils import load_tokenizer as mlx_lm_tokenizer

        return mlx_lm_tokenizer(path)
    except Exception as exc:  # a router's convenience: never fatal
        logger.warning("no tokenizer for %s: %s", model, exc)
        return None
