"""Model loading: local directory or hub id, dtype policy, fingerprint, limits.

`load_model` is the one way every path (serving, generate, bench, tests) loads a
model, so that the fingerprint and the dtype policy are the same everywhere.

dtype `auto` resolves to float32 on MLX's CPU backend (its bf16/fp16 and quantized
matmuls are several times slower than float32 there) and to the model's own
dtype on a GPU (Metal or CUDA).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import attrs
import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.utils import load as mlx_lm_load

DTYPES = ("auto", "float32", "bfloat16", "float16")
DEFAULT_MODEL = Path(__file__).resolve().parent.parent / "models" / "pycoder-draft-4m"
_CHUNK = 1 << 20


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
    mx.eval(net.parameters())
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
