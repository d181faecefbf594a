"""The model matrix: tiny random-weight models of the mlx-lm families people serve.

Each family is built from mlx-lm's own model class (config + its seeded init, a few
layers, hidden 64, the bundled tokenizer's 8,192-token vocabulary) in float weights or
quantized with mlx's affine quantization as mlx-community ships them (4- and 8-bit, group
32). `CLAIMS` says what tqserve serves for each family; tests/e2e/test_model_matrix.py
proves every cell and docs/supported-models.md is `table()` (a test keeps them equal).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

from tqserve.engine.model import DEFAULT_MODEL

VOCAB = 8192
SEED = 7
GROUP = 32
BASE: dict[str, Any] = {
    "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "rms_norm_eps": 1e-6,
    "vocab_size": VOCAB, "max_position_embeddings": 4096, "rope_theta": 10000.0,
    "tie_word_embeddings": True, "eos_token_id": 0,
}
_SLIDING = {"sliding_window": 8}
FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {},
    "mistral": {},
    "qwen3": {},
    "phi3": {"tie_word_embeddings": False, "hidden_size": 128, "num_attention_heads": 2,
             "num_key_value_heads": 1},  # phi3's head dim is hidden / heads
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                  "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True},
    "deepseek_v3": {"kv_lora_rank": 16, "q_lora_rank": None, "qk_rope_head_dim": 8,
                    "qk_nope_head_dim": 8, "v_head_dim": 16, "n_routed_experts": 4,
                    "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                    "first_k_dense_replace": 1, "n_shared_experts": 1, "n_group": 1,
                    "topk_group": 1, "rope_scaling": None},
    "ministral3": {**_SLIDING, "layer_types": ["sliding_attention", "full_attention"],
                   "rope_parameters": {"rope_theta": 10000.0, "llama_4_scaling_beta": 0.1,
                                       "original_max_position_embeddings": 4096}},
    "gemma3_text": {**_SLIDING, "sliding_window_pattern": 2, "query_pre_attn_scalar": 64,
                    "rope_local_base_freq": 10000.0, "num_hidden_layers": 4},
    "gemma4_text": {**_SLIDING, "num_hidden_layers": 6, "global_head_dim": 128,
                    "num_kv_shared_layers": 2, "vocab_size_per_layer_input": VOCAB,
                    "hidden_size_per_layer_input": 16, "sliding_window_pattern": 3,
                    "num_key_value_heads": 1},
    "gpt_oss": {**_SLIDING, "num_local_experts": 4, "num_experts_per_tok": 2,
                "layer_types": ["sliding_attention", "full_attention"], "rope_scaling": None},
    "qwen3_5": {"num_hidden_layers": 4, "full_attention_interval": 2,
                "linear_num_value_heads": 2, "linear_num_key_heads": 2,
                "linear_key_head_dim": 32, "linear_value_head_dim": 32,
                "rope_parameters": {"type": "default", "mrope_section": [1, 1, 0],
                                    "rope_theta": 10000, "partial_rotary_factor": 0.25}},
    "mamba2": {"num_heads": 4, "head_dim": 16, "state_size": 16, "n_groups": 1, "conv_kernel": 4,
               "expand": 1, "use_bias": False, "use_conv_bias": True,
               "time_step_limit": [0.0, 1e9], "time_step_rank": 8,
               "layer_norm_epsilon": 1e-5},
}
WEIGHTS = ("float", "q4", "q8")

# What each family's layers are, and so what the prefix cache and TurboQuant can do there:
# "full": every layer full attention; "sliding": sliding-window layers beside full ones;
# "hybrid": recurrent (gated delta-net) layers beside full attention; "recurrent": no
# attention at all.
LAYERS = {"llama": "full", "mistral": "full", "qwen3": "full", "phi3": "full",
          "qwen3_moe": "full", "deepseek_v3": "full", "ministral3": "sliding",
          "gemma3_text": "sliding", "gemma4_text": "sliding", "gpt_oss": "sliding",
          "qwen3_5": "hybrid", "mamba2": "recurrent"}
REFUSED = "refused at start"
CLAIMS = {  # per layer kind: prefix cache, TurboQuant, speculation
    "full": ("yes", "yes", "yes"),
    "sliding": ("off (warned)", "full-attention layers", REFUSED),
    "hybrid": ("exact boundaries", "full-attention layers", REFUSED),
    "recurrent": ("off (warned)", "none (warned: no attention layers)", REFUSED),
}

# TurboQuant refused at start, with the reason its error names
TURBOQUANT_REFUSED = {"deepseek_v3": "head dim",  # multi-head latent attention
                      "gpt_oss": "attention sinks"}


def claims(family: str) -> tuple[str, str, str]:
    """(prefix cache, TurboQuant, speculation) as the docs table states them."""
    prefix, turbo, spec = CLAIMS[LAYERS[family]]
    if family in TURBOQUANT_REFUSED:
        turbo = f"{REFUSED} ({TURBOQUANT_REFUSED[family]})"
    return prefix, turbo, spec


def build(out: Path, family: str, weights: str = "float") -> Path:
    """Write the family's model directory under `out` (same arguments, same bytes)."""
    from mlx_lm.utils import _get_classes, quantize_model

    config: dict[str, Any] = {**BASE, "model_type": family, **FAMILIES[family]}
    mx.random.seed(SEED)
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    if weights != "float":
        model, config = quantize_model(model, config, group_size=GROUP,
                                       bits=int(weights.removeprefix("q")))
    path = out / f"{family}-{weights}"
    path.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(model.parameters())),
                        metadata={"format": "mlx"})
    (path / "config.json").write_text(json.dumps(config, indent=1))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(DEFAULT_MODEL / name, path / name)
    return path


def table() -> str:
    """The supported-models table (markdown) that docs/supported-models.md holds."""
    lines = ["| family | layers | greedy = mlx-lm (alone, batched) | weights | prefix cache "
             "| TurboQuant | speculation |", "|" + "---|" * 7]
    for family, kind in LAYERS.items():
        prefix, turbo, lookup = claims(family)
        lines.append(f"| {family} | {kind} | yes | float, 4-bit, 8-bit | {prefix} | {turbo} "
                     f"| {lookup} |")
    return "\n".join(lines)
