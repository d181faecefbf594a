"""GGUF models: a llama-family GGUF file as mlx-lm's `llama` model, tokenizer and template.

`load_gguf(path)` checks the header (engine.gguf_file), maps the metadata onto mlx-lm's
`llama.ModelArgs`, reads the weights with `mx.load` (MLX turns Q4_0 / Q4_1 / Q8_0 blocks
into its affine layout: `weight` / `scales` / `biases`, group size 32), quantizes exactly
the layers the file stores quantized (bits per tensor: a Q4_1 file keeps its Q8_0
embedding) and loads the weights strictly. GGUF keeps the q/k rows in the order of
llama.cpp's RoPE, which pairs adjacent dimensions: that is mlx-lm's `rope_traditional`,
so the rows load unchanged (un-permuting them, as the HF converters do, would need the
other RoPE). Whether the weights stay packed is engine.model's choice (--quantized-weights).

The tokenizer is built from the file (`tokenizer.ggml.*`): byte-level BPE tokens and
merges (`tokenizer.ggml.model` gpt2) with the pre-tokenizer `tokenizer.ggml.pre` names,
control tokens as special tokens, the chat template from `tokenizer.chat_template`; it is
written as tokenizer.json + tokenizer_config.json into a temporary directory and loaded by
mlx-lm's own tokenizer loader, so the result is the TokenizerWrapper (streaming BPE
detokenizer, EOS ids, tool parser inference) a checkpoint directory gives.

Refused at start, one line each: an architecture other than llama, a tensor type other
than those of engine.gguf_file, a SentencePiece (`llama`) or unknown tokenizer model, an
unknown pre-tokenizer, RoPE scaling, and a tensor the llama module does not expect.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import llama
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.tokenizer_utils import load as load_tokenizer
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from tqserve.engine.gguf_file import (QUANT_GROUP_SIZE, GGUFError, GGUFHeader, check_types,
                                      read_header)

ARCHITECTURES = ("llama",)
# GGUF tensor name parts -> mlx-lm llama module paths
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                 "output": "lm_head"}
_LAYER_NAMES = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
                "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
                "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
                "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?"
                 r"[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
CONTROL_TOKEN_TYPES = (3, 4)  # llama.cpp token types: 3 control, 4 user-defined


def _pre_tokenizer(pre: str) -> Any:
    """The HF pre-tokenizer for a `tokenizer.ggml.pre` name (llama.cpp's list)."""
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("gpt2", "default"):
        return byte_level
    if pre == "smollm":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                        byte_level])
    if pre in ("llama-bpe", "llama3"):
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    raise GGUFError(f"pre-tokenizer {pre!r} (tokenizer.ggml.pre) is not supported; "
                    "tqserve knows gpt2, default, smollm, llama-bpe")


def _hf_tokenizer(meta: dict[str, Any]) -> Tokenizer:
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise GGUFError(f"tokenizer model {kind!r} (tokenizer.ggml.model) is not supported; "
                        "tqserve builds byte-level BPE (gpt2) tokenizers")
    tokens = meta["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                               fuse_unk=False))
    tok.pre_tokenizer = _pre_tokenizer(str(meta.get("tokenizer.ggml.pre", "default")))
    tok.decoder = decoders.ByteLevel()
    types = meta.get("tokenizer.ggml.token_type")
    if types is not None:
        tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                                for i, t in enumerate(types) if t in CONTROL_TOKEN_TYPES])
    return tok


def _token(meta: dict[str, Any], name: str) -> str | None:
    index = meta.get(f"tokenizer.ggml.{name}_token_id")
    tokens = meta["tokenizer.ggml.tokens"]
    return tokens[int(index)] if index is not None and int(index) < len(tokens) else None


def build_tokenizer(meta: dict[str, Any], context_length: int) -> TokenizerWrapper:
    """The file's tokenizer and chat template, loaded the way mlx-lm loads a checkpoint's."""
    if "tokenizer.ggml.tokens" not in meta:
        raise GGUFError("the file has no tokenizer (tokenizer.ggml.tokens)")
    tok = _hf_tokenizer(meta)
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
        "model_max_length": context_length,
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
    }
    for name in ("bos", "eos", "unknown", "padding"):
        text = _token(meta, name)
        if text is not None:
            key = {"unknown": "unk", "padding": "pad"}.get(name, name)
            config[f"{key}_token"] = text
    if "tokenizer.chat_template" in meta:
        config["chat_template"] = meta["tokenizer.chat_template"]
    eos = meta.get("tokenizer.ggml.eos_token_id")
    with tempfile.TemporaryDirectory(prefix="tqserve-gguf-") as tmp:
        tok.save(str(Path(tmp) / "tokenizer.json"))
        (Path(tmp) / "tokenizer_config.json").write_text(json.dumps(config))
        return load_tokenizer(Path(tmp), eos_token_ids=None if eos is None else [int(eos)])


def check_supported(header: GGUFHeader) -> None:
    """Refuse, in this order, an architecture, RoPE scaling or tensor type not served."""
    arch = header.metadata.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFError(f"architecture {arch!r} is not supported; tqserve loads GGUF "
                        f"files of architecture {', '.join(ARCHITECTURES)}")
    scaling = header.metadata.get(f"{arch}.rope.scaling.type", "none")
    if scaling != "none" or "rope_freqs.weight" in header.tensors:
        raise GGUFError(f"RoPE scaling ({scaling if scaling != 'none' else 'rope_freqs'}) "
                        "is not supported in GGUF files yet")
    check_types(header)


def model_args(header: GGUFHeader) -> llama.ModelArgs:
    """mlx-lm llama arguments from the `llama.*` metadata (of a checked header)."""
    meta = header.metadata
    arch = meta["general.architecture"]

    def get(key: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise GGUFError(f"metadata {arch}.{key} is missing")
        return value

    hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
    vocab = len(meta.get("tokenizer.ggml.tokens") or []) or int(get("vocab_size"))
    return llama.ModelArgs(
        model_type="llama", hidden_size=hidden, num_hidden_layers=int(get("block_count")),
        intermediate_size=int(get("feed_forward_length")), num_attention_heads=heads,
        num_key_value_heads=int(get("attention.head_count_kv", heads)),
        head_dim=int(get("attention.key_length", hidden // heads)),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        vocab_size=vocab, max_position_embeddings=int(get("context_length", 4096)),
        rope_theta=float(get("rope.freq_base", 10000.0)), rope_traditional=True,
        tie_word_embeddings="output.weight" not in header.tensors)


def module_path(name: str) -> str:
    """mlx-lm parameter path of a GGUF tensor or MLX key (`blk.3.attn_q.scales`)."""
    stem, _, leaf = name.rpartition(".")
    if stem in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[stem]}.{leaf}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{leaf}"
    raise GGUFError(f"tensor {name!r} is not part of a llama model")


def build_model(header: GGUFHeader, weights: dict[str, mx.array]) -> nn.Module:
    """The llama model with the file's weights (of a checked header); quantized layers stay
    packed here."""
    net = llama.Model(model_args(header))
    bits = {module_path(t.name).rpartition(".")[0]: t.bits
            for t in header.tensors.values() if t.bits}
    nn.quantize(net, class_predicate=lambda path, _: (
        {"group_size": QUANT_GROUP_SIZE, "bits": bits[path]} if path in bits else False))
    mapped = [(module_path(k), v) for k, v in weights.items()]
    try:
        net.load_weights(mapped, strict=True)
    except ValueError as exc:
        raise GGUFError(f"the weights do not fit a llama model: {exc}") from None
    return net


def load_gguf(path: Path) -> tuple[nn.Module, TokenizerWrapper, dict[str, Any]]:
    """Model (weights as stored), tokenizer and a config-like dict of a GGUF file."""
    header = read_header(path)
    check_supported(header)
    args = model_args(header)
    tokenizer = build_tokenizer(header.metadata, int(args.max_position_embeddings or 4096))
    try:
        weights = mx.load(str(path))
    except (RuntimeError, ValueError) as exc:
        raise GGUFError(f"MLX cannot read the weights: {exc}") from None
    net = build_model(header, weights)  # type: ignore[arg-type]
    config = {"max_position_embeddings": args.max_position_embeddings,
              "vocab_size": args.vocab_size, "model_type": "llama",
              "architecture": header.metadata.get("general.architecture")}
    return net, tokenizer, config
