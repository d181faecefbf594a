"""The decode fast path (engine.fastpath): fused projections and compiled decode layers
compute what the model computes, alone, batched with uneven rows, and through the Runner.

Runs on whatever backend MLX has (the CPU here, bit-equal in float32; on CUDA the same
file checks the fused matmuls within bf16 rounding)."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models.cache import make_prompt_cache

from tqserve import blas
from tqserve.engine import fastpath
from tqserve.engine.kv.factory import cache_factory_for
from tqserve.engine.runner import Runner
from tqserve.engine.sampling import SamplingParams
from tqserve.engine.scheduler import SchedulerCore

PROMPT = [5, 77, 300, 12, 9, 1000, 44, 8, 19, 250]
# Bit-equal where every element of a matmul is one dot product in a fixed order: float32 on
# the CPU backend with MLX's own reference BLAS. OpenBLAS (loaded by default on Linux:
# tqserve.blas) blocks one fused matmul differently from three: float32 rounding, ~1e-5
# on these logits, within CPU_ROUNDING.
ON_CPU = mx.default_device() == mx.cpu
EXACT = ON_CPU and blas.loaded is None
CPU_ROUNDING = 1e-4
# Elsewhere (MLX-CUDA runs float32 matmuls in TF32, and a fused matmul rounds differently
# from three), greedy tokens may part only where the reference's top two logprobs are this
# close: a TurboQuant code flip moves a logit by more than the plain cache's rounding does.
CUDA_NEAR_TIE_NATS = 0.05


@pytest.fixture()
def model(draft_model: Any) -> Any:
    """A fused copy of the bundled model (the session's model stays as it was)."""
    fused, count = fastpath.fuse_projections(draft_model.model, copy=True)
    assert count == 2 * len(draft_model.model.layers)  # attention and MLP of every layer
    return fused


def _decode_logits(model: Any, forward: Any, rows: list[list[int]], steps: int = 5) -> mx.array:
    """Prefill each row alone (rows may differ in length), then decode them together."""
    from tqserve.engine.kv.slots import slot_batch

    caches = []
    last = []
    for ids in rows:
        cache = make_prompt_cache(model)
        model(mx.array(ids)[None], cache=cache)
        caches.append(cache)
        last.append(ids[-1])
    batch = [slot_batch(c) for c in caches[0]]
    for other in caches[1:]:
        for mine, theirs in zip(batch, other):
            mine.extend(theirs)
    y = mx.array(last)[:, None]
    out = []
    for _ in range(steps):
        logits = forward(y, batch)[:, -1, :]
        out.append(logits)
        y = mx.argmax(logits, axis=-1)[:, None]
    return mx.stack(out)


def _close(a: mx.array, b: mx.array) -> bool:
    if EXACT:
        return bool(mx.array_equal(a, b))
    return bool(mx.allclose(a, b, atol=CPU_ROUNDING if ON_CPU else 5e-2))


def test_fused_projections_leave_the_model_alone_and_compute_the_same(draft_model: Any,
                                                                      model: Any) -> None:
    original = draft_model.model
    layer = original.layers[0]
    assert type(layer.self_attn.q_proj) is nn.Linear and "qkv_proj" not in layer.self_attn
    fused_layer = model.layers[0]
    assert "qkv_proj" in fused_layer.self_attn and "q_proj" not in fused_layer.self_attn
    assert fused_layer.mlp["gate_up_proj"].weight.shape[0] == 2 * layer.mlp.up_proj.weight.shape[0]
    assert model.model.embed_tokens is original.model.embed_tokens  # shared, not copied
    rows = [PROMPT, PROMPT[:6]]
    plain = _decode_logits(original, lambda y, c: original(y, cache=c), rows)
    fused = _decode_logits(model, lambda y, c: model(y, cache=c), rows)
    assert _close(plain, fused)
    again, count = fastpath.fuse_projections(model)  # already fused: nothing to do
    assert again is model and count == 0


@pytest.mark.parametrize("rows", [[PROMPT], [PROMPT, PROMPT], [PROMPT, PROMPT[:6], PROMPT[:3]]],
                         ids=["single", "equal", "uneven"])
def test_compiled_decode_layers_equal_the_model(draft_model: Any, model: Any,
                                                rows: list[list[int]]) -> None:
    """Single row (no mask), equal rows (no mask, one slice write), uneven rows (mask,
    scatter write, per-row RoPE offsets)."""
    original = draft_model.model
    plain = _decode_logits(original, lambda y, c: original(y, cache=c), rows)
    compiled = _decode_logits(model, fastpath.DecodeForward(model), rows)
    assert _close(plain, compiled)


def _greedy(model: Any, prompts: list[list[int]], fast: bool, make_cache: Any = None,
            n: int = 8) -> tuple[dict[str, list[int]], dict[str, list[float]]]:
    """Greedy tokens per row, and each token's top-2 logprob gap."""
    core = SchedulerCore(max_batch=4, prefill_chunk=64, eos_token_ids=())
    runner = Runner(model, make_cache, fast_decode=fast)
    assert (runner._decode is not None) == fast
    for i, p in enumerate(prompts):
        core.add(f"r{i}", tuple(p), SamplingParams(max_tokens=n, temperature=0.0,
                                                   top_logprobs=2))
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    gaps: dict[str, list[float]] = {f"r{i}": [] for i in range(len(prompts))}
    while core.has_work():
        plan, _ = core.schedule()
        result = runner.execute(plan)
        core.postprocess(result)
        for out in result.outputs:
            tokens[out.request_id] += list(out.tokens)
            gaps[out.request_id] += [top[0][1] - top[1][1] for top in out.top_logprobs or ()]
    runner.close()
    return tokens, gaps


def _same_up_to_near_ties(got: list[int], want: list[int], gaps: list[float]) -> bool:
    if got == want or ON_CPU:  # float32 rounding never parts greedy tokens here
        return got == want
    i = next(k for k, (a, b) in enumerate(zip(got, want)) if a != b)
    return gaps[i] < CUDA_NEAR_TIE_NATS


@pytest.mark.parametrize("scheme", [None, "k4v4"], ids=["plain", "turboquant"])
def test_runner_with_fast_decode_gives_the_same_greedy_tokens(draft_model: Any, model: Any,
                                                              scheme: str | None) -> None:
    prompts = [PROMPT, PROMPT[:7], PROMPT[2:]]
    make_cache = cache_factory_for(model, scheme) if scheme else None
    want, gaps = _greedy(draft_model.model, prompts, False,
                         cache_factory_for(draft_model.model, scheme) if scheme else None)
    got, _ = _greedy(model, prompts, True, make_cache)
    assert all(len(t) == 8 for t in got.values())
    for rid in want:
        assert _same_up_to_near_ties(got[rid], want[rid], gaps[rid]), (rid, got, want, gaps)


def test_fast_decode_setting() -> None:
    on_gpu = mx.default_device() != mx.cpu
    assert fastpath.wanted("on") and not fastpath.wanted("off")
    assert fastpath.wanted("auto") == on_gpu
    assert not fastpath.wanted("on", distributed=True)


def test_models_without_qwen3_layers_keep_their_forward() -> None:
    from mlx_lm.models import llama

    args = llama.ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=2,
                           intermediate_size=128, num_attention_heads=2, rms_norm_eps=1e-6,
                           vocab_size=100, num_key_value_heads=1)
    tiny = llama.Model(args)
    assert not fastpath.DecodeForward.supports(tiny)
    assert Runner(tiny, fast_decode=True)._decode is None
    fused, count = fastpath.fuse_projections(tiny, copy=True)
    assert count == 4  # llama's projections fuse all the same
