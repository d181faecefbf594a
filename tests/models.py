"""Tiny random-weight model directories for tests (qwen3, gemma3_text).

Each builder writes a directory that `mlx_lm.load` (and so `engine.model.load_model`)
accepts: config.json, model.safetensors (float16, seeded with `mx.random.seed`, so the
same arguments give the same bytes) and the bundled model's tokenizer files (vocab 8192).
Sizes are kept tiny (hidden 32, one KV head) so every directory stays under 2 MB.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

from tqserve.engine.model import DEFAULT_MODEL

VOCAB = 8192  # the bundled tokenizer's vocabulary
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
SEED = 1234
HIDDEN = 32
HEAD_SCALE = 8.0  # an untied output head 8x mlx's init: varied tokens, few near-ties


def _write(path: Path, config: dict[str, Any], model: Any) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    weights = {k: v.astype(mx.float16) for k, v in tree_flatten(model.parameters())}
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})
    (path / "config.json").write_text(json.dumps(config, indent=2))
    for name in TOKENIZER_FILES:
        shutil.copyfile(DEFAULT_MODEL / name, path / name)
    return path


def _sharpen(lm_head: Any) -> None:
    lm_head.weight = lm_head.weight * HEAD_SCALE


def make_qwen3_dir(tmp_path: Path, head_dim: int = 128, *, num_layers: int = 2,
                   name: str | None = None) -> Path:
    """A qwen3 model (1 KV head of `head_dim`; 2 query heads, 1 from head_dim 512 on, to
    stay small; an untied output head) under tmp_path."""
    from mlx_lm.models import qwen3

    config = {
        "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"],
        "hidden_size": HIDDEN, "num_hidden_layers": num_layers, "intermediate_size": 64,
        "num_attention_heads": 2 if head_dim < 512 else 1, "num_key_value_heads": 1,
        "head_dim": head_dim, "rms_norm_eps": 1e-6, "vocab_size": VOCAB,
        "max_position_embeddings": 4096, "rope_theta": 1000000.0, "tie_word_embeddings": False,
        "bos_token_id": None, "eos_token_id": 0, "torch_dtype": "float16",
    }
    mx.random.seed(SEED)
    model = qwen3.Model(qwen3.ModelArgs.from_dict(config))
    _sharpen(model.lm_head)
    return _write(tmp_path / (name or f"qwen3-hd{head_dim}"), config, model)


def make_gemma3_dir(tmp_path: Path, sliding_window: int = 8, head_dim: int = 128, *,
                    num_layers: int = 4, sliding_window_pattern: int = 2,
                    name: str | None = None) -> Path:
    """A gemma3_text model under tmp_path: layer i is full attention when
    i % sliding_window_pattern == sliding_window_pattern - 1, else a sliding-window layer
    of `sliding_window` positions (with the defaults: layers 0, 2 sliding; 1, 3 full)."""
    from mlx_lm.models import gemma3_text

    config = {
        "model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"],
        "hidden_size": HIDDEN, "num_hidden_layers": num_layers, "intermediate_size": 64,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": head_dim,
        "rms_norm_eps": 1e-6, "vocab_size": VOCAB, "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0, "query_pre_attn_scalar": head_dim,
        "sliding_window": sliding_window, "sliding_window_pattern": sliding_window_pattern,
        "max_position_embeddings": 4096, "eos_token_id": 0, "torch_dtype": "float16",
    }
    mx.random.seed(SEED)
    model = gemma3_text.Model(gemma3_text.ModelArgs.from_dict(config))
    _sharpen(model.lm_head)  # kept in the weights, so sanitize leaves the head untied
    return _write(tmp_path / (name or f"gemma3-sw{sliding_window}-hd{head_dim}"), config, model)
