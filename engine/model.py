"""Model loading: local directory or hub id, dtype policy, fingerprint, limits.

`load_model` is the one way every path (serving, generate, bench, tests) loads a
model, so that the fingerprint and the dtype policy are the same everywhere.

dtype `auto` resolves to float32 on MLX's CPU backend (its bf16/fp16 and quantized
matmuls are several times slower than float32 there) and to the model's own
dtype on a GPU (Metal or CUDA).

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
from typing import Any

import attrs
import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.utils import load as mlx_lm_load

from tqserve import blas

DTYPES = ("auto", "float32", "bfloat16", "float16")
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
    """sha256 over config, every weight file, the tokenizer files and the dtype."""
    h = hashlib.sha256()
    names = sorted(p.name for p in path.iterdir() if p.is_file())
    for name in names:
        if name.endswith((".json", ".safetensors", ".model", ".txt", ".jinja")):
            h.update(name.encode())
            h.update(_file_digest(path / name).encode())
    h.update(dtype.encode())
    return h.hexdigest()[:32]


def _resolve_path(model: str | Path) -> Path:
    path = Path(model)
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


def load_model(model: str | Path = DEFAULT_MODEL, dtype: str = "auto") -> LoadedModel:
    """Load a model directory or hub id and apply the dtype policy."""
    path = _resolve_path(model)
    resolved = resolve_dtype(dtype)
    try:
        net, tokenizer = mlx_lm_load(str(path))[:2]
    except Exception as exc:
        raise ModelLoadError(f"cannot load model at {str(model)!r}: {exc}") from exc
    if resolved == "model":
        first_weight = tree_flatten(net.parameters())[0][1]  # type: ignore[index]
        resolved = str(first_weight.dtype).split(".")[-1]
    else:
        net.set_dtype(getattr(mx, resolved))
    if resolved == "float32":
        keep_float32_exact()
    if mx.default_device() == mx.cpu:
        blas.warn_if_slow()  # once per process: the embedded API says it too (tqserve.blas)
    mx.eval(net.parameters(), _private_arrays(net))
    config = json.loads((path / "config.json").read_text())
    eos = set(tokenizer.eos_token_ids or [])
    if tokenizer.eos_token_id is not None:
        eos.add(int(tokenizer.eos_token_id))
    context = int(config.get("max_position_embeddings") or 4096)
    return LoadedModel(
        model=net,
        tokenizer=tokenizer,
        path=path,
        dtype=resolved,
        fingerprint=fingerprint(path, resolved),
        num_layers=len(net.layers),
        head_dims=_head_dims(net),
        context_length=context,
        eos_token_ids=frozenset(int(e) for e in eos),
        vocab_size=int(config.get("vocab_size", len(tokenizer.vocab))),
    )
