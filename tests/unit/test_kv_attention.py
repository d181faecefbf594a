"""The rotated attention port: equals SDPA over decoded K/V, fused == plain, the env
selection, mlx-lm dispatch, the factory on real and random models, and end to end."""

from __future__ import annotations

import copy
import logging
import sys
import types
from typing import Any

import attrs
import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models import base, gemma3_text, qwen3
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

from tqserve.engine.codec.turboquant import EncodedVectors
from tqserve.engine.attention import sdpa as attention
from tqserve.engine.attention.sdpa import install_attention, turboquant_sdpa
from tqserve.engine.kv.delayed import DelayedTurboQuantKVCache
from tqserve.engine.kv.factory import check_head_dims, make_turboquant_cache_factory
from tqserve.engine.kv.turboquant import TurboQuantSlotsKVCache
from tqserve.engine.kv.slots import slot_batch_of
from tqserve.engine.kv.turboquant import TurboQuantKVCache
from tqserve.engine.model import LoadedModel
from tqserve.engine.runner import Runner
from tqserve.engine.sampling import SamplingParams
from tqserve.engine.step import NewRow, PrefillChunk, StepPlan

DIM = 128
KV_HEADS, Q_HEADS = 2, 4
SCALE = DIM**-0.5
PORT_TOL = 2e-5  # port vs SDPA over decoded K/V: float32 rotation round-off on O(1) outputs
FUSED_TOL = 1e-5  # fused vs plain decode
PROMPTS = ("def fibonacci(n):\n    if n < 2:\n", "import os\nimport sys\n\nclass Config:\n",
           "for i in range(10):\n    print(")


def _random(shape: tuple[int, ...], seed: int) -> mx.array:
    return mx.array(np.random.default_rng(seed).standard_normal(shape).astype(np.float32))


def _filled(length: int, seed: int, fused: bool, bits: tuple[int, int] = (4, 3)) -> Any:
    cache = TurboQuantKVCache(*bits, DIM, seed=1, decode="auto" if fused else "unfused")
    cache.update_and_fetch(_random((1, KV_HEADS, length, DIM), seed),
                           _random((1, KV_HEADS, length, DIM), seed + 1) * 4)
    return cache


def _reference(queries: mx.array, cache: TurboQuantKVCache, mask: Any) -> mx.array:
    """Standard SDPA over the decoded keys and values in the ORIGINAL basis."""
    planes = cache.written()
    keys = cache.config.key_codec.decode(EncodedVectors(planes["key_codes"], planes["key_norms"]))
    values = cache.config.value_codec.decode(
        EncodedVectors(planes["value_codes"], planes["value_norms"]))
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=SCALE, mask=mask)


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("length", [1, 5])
def test_port_equals_sdpa_over_decoded_kv(fused: bool, length: int) -> None:
    cache = _filled(9, seed=0, fused=fused)
    fetched, _ = cache.update_and_fetch(_random((1, KV_HEADS, length, DIM), 5),
                                        _random((1, KV_HEADS, length, DIM), 6))
    queries = _random((1, Q_HEADS, length, DIM), 7) * 3
    mask = cache.make_mask(length)  # None for decode, "causal" for a prefill block
    out = turboquant_sdpa(queries, fetched, SCALE, mask)
    assert out.shape == queries.shape and out.dtype == mx.float32
    np.testing.assert_allclose(np.array(out), np.array(_reference(queries, cache, mask)),
                               atol=PORT_TOL)


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("length", [1, 3])
def test_port_over_slot_rows_matches_each_row_alone(fused: bool, length: int) -> None:
    rows = [_filled(n, seed=10 * n, fused=fused) for n in (4, 11, 7)]
    batch = slot_batch_of([copy.deepcopy(r) for r in rows])
    keys = _random((3, KV_HEADS, length, DIM), 1)
    values = _random((3, KV_HEADS, length, DIM), 2)
    queries = _random((3, Q_HEADS, length, DIM), 3)
    mask = batch.make_mask(length)
    assert isinstance(batch, TurboQuantSlotsKVCache) and batch.lengths == [4, 11, 7]
    out = turboquant_sdpa(queries, batch.update_and_fetch(keys, values)[0], SCALE, mask)
    for i, row in enumerate(rows):
        row.update_and_fetch(keys[i : i + 1], values[i : i + 1])
        want = _reference(queries[i : i + 1], row, row.make_mask(length))
        np.testing.assert_allclose(np.array(out[i : i + 1]), np.array(want), atol=PORT_TOL)


def test_fused_equals_plain_decode() -> None:
    worst = 0.0
    for bits in ((4, 4), (3, 5), (8, 2), (1, 7)):
        rows = [_filled(n, seed=n, fused=True, bits=bits) for n in (30, 300)]
        batch = slot_batch_of(rows)
        mask = batch.make_mask(1)
        fetched, _ = batch.update_and_fetch(_random((2, KV_HEADS, 1, DIM), 8),
                                            _random((2, KV_HEADS, 1, DIM), 9))
        queries = _random((2, Q_HEADS, 1, DIM), 4) * 5
        plain = attention._plain_attention(queries, fetched, SCALE, mask)
        fused = attention._fused_attention(queries, fetched, SCALE)
        worst = max(worst, float(mx.max(mx.abs(plain - fused))))
    assert worst < FUSED_TOL


def _count_fused(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls = [0]
    real = attention._fused_attention

    def spy(*args: Any) -> mx.array:
        calls[0] += 1
        return real(*args)

    monkeypatch.setattr(attention, "_fused_attention", spy)
    return calls


def test_decode_path_is_kept_by_every_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    off = TurboQuantKVCache(4, 4, DIM, decode="unfused")
    delayed = DelayedTurboQuantKVCache(2, 4, 4, DIM, decode="unfused")
    assert TurboQuantKVCache(4, 4, DIM).fused_decode
    with pytest.raises(ValueError, match="decode must be one of auto, compiled, unfused"):
        TurboQuantKVCache(4, 4, DIM, decode="fast")
    x = _random((1, KV_HEADS, 3, DIM), 0)
    off.update_and_fetch(x, x)
    delayed.update_and_fetch(x, x)
    delayed.update_and_fetch(x[:, :, :1], x[:, :, :1])  # converts now, keeping "unfused"
    batch = slot_batch_of([off])
    kept = [off, batch, batch.extract(0), copy.deepcopy(off), TurboQuantKVCache.from_state(
        off.state), TurboQuantSlotsKVCache.from_state(batch.state), delayed.quantized,
        slot_batch_of([delayed]).extract(0).quantized]
    assert [c.fused_decode for c in kept] == [False] * len(kept)
    calls = _count_fused(monkeypatch)
    queries = _random((1, Q_HEADS, 1, DIM), 1)
    for cache in kept:
        turboquant_sdpa(queries, cache.update_and_fetch(x[:, :, :1], x[:, :, :1])[0], SCALE, None)
    assert calls == [0]
    on = TurboQuantKVCache(4, 4, DIM)
    prefill = _random((1, Q_HEADS, 3, DIM), 2)
    turboquant_sdpa(prefill, on.update_and_fetch(x, x)[0], SCALE, "causal")  # always plain
    turboquant_sdpa(queries, on.update_and_fetch(x[:, :, :1], x[:, :, :1])[0], SCALE, None)
    assert calls == [1]


def test_install_attention_dispatches_and_is_idempotent() -> None:
    install_attention()
    wrapper = base.scaled_dot_product_attention
    install_attention()
    assert base.scaled_dot_product_attention is wrapper
    assert qwen3.scaled_dot_product_attention is wrapper
    assert gemma3_text.scaled_dot_product_attention is wrapper
    queries, keys = _random((1, Q_HEADS, 2, DIM), 0), _random((1, KV_HEADS, 5, DIM), 1)
    plain = wrapper(queries, keys, keys, cache=None, scale=SCALE, mask="causal")
    np.testing.assert_array_equal(np.array(plain), np.array(
        mx.fast.scaled_dot_product_attention(queries, keys, keys, scale=SCALE, mask="causal")))
    donor = _filled(6, seed=3, fused=True)
    fetched, same = donor.update_and_fetch(keys[:, :, :1], keys[:, :, :1])
    # A KV-shared consumer layer gets the donor's (keys, values) and no cache of its own.
    shared = wrapper(queries[:, :, :1], fetched, same, cache=None, scale=SCALE, mask=None)
    np.testing.assert_allclose(np.array(shared), np.array(
        _reference(queries[:, :, :1], donor, None)), atol=PORT_TOL)
    with pytest.raises(ValueError, match="sinks"):
        wrapper(queries, fetched, same, cache=donor, scale=SCALE, mask=None,
                sinks=mx.zeros((Q_HEADS,)))


def test_install_attention_leaves_other_functions(monkeypatch: pytest.MonkeyPatch) -> None:
    own = types.ModuleType("mlx_lm.models.tq_custom")
    own.scaled_dot_product_attention = lambda *a, **k: None  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, own.__name__, own)
    before = own.scaled_dot_product_attention  # type: ignore[attr-defined]
    install_attention()
    assert own.scaled_dot_product_attention is before  # type: ignore[attr-defined]


def _greedy(model: Any, prompt: list[int], cache: list[Any], n: int) -> tuple[list[int], Any]:
    steps = generate_step(mx.array(prompt), model, max_tokens=n, prompt_cache=cache,
                          sampler=lambda x: mx.argmax(x, axis=-1))
    tokens, logprobs = zip(*((int(t), np.array(lp)) for t, lp in steps))
    return list(tokens), np.stack(logprobs)


def test_k8v8_greedy_tokens_equal_plain(draft_model: LoadedModel) -> None:
    install_attention()
    model, factory = draft_model.model, make_turboquant_cache_factory(8, 8)
    for prompt in PROMPTS:
        ids = draft_model.tokenizer.encode(prompt)
        plain, plain_lp = _greedy(model, ids, make_prompt_cache(model), 16)
        quant, _ = _greedy(model, ids, factory(model), 16)
        if quant != plain:
            first = next(i for i, (a, b) in enumerate(zip(plain, quant)) if a != b)
            top2 = np.sort(plain_lp[first])[-2:]
            assert top2[1] - top2[0] < 0.05, (prompt, first, top2)


def _teacher_forced(model: Any, ids: list[int], cache: list[Any], n: int) -> np.ndarray:
    """Log-probs for the last n positions: prefill ids[:-n], then decode one at a time."""
    logits = [model(mx.array(ids[:-n])[None], cache=cache)[0, -1]]
    logits += [model(mx.array([[t]]), cache=cache)[0, -1] for t in ids[-n:-1]]
    stacked = mx.stack(logits)
    return np.array(stacked - mx.logsumexp(stacked, axis=-1, keepdims=True))


def test_k4v4_logits_kl_is_small(draft_model: LoadedModel) -> None:
    install_attention()
    model, factory = draft_model.model, make_turboquant_cache_factory(4, 4)
    kls = []
    for prompt in PROMPTS:
        ids = draft_model.tokenizer.encode(prompt)
        ids += _greedy(model, ids, make_prompt_cache(model), 24)[0]
        plain = _teacher_forced(model, ids, make_prompt_cache(model), 24)
        quant = _teacher_forced(model, ids, factory(model), 24)
        kls.append((np.exp(plain) * (plain - quant)).sum(axis=-1))
    mean_kl = float(np.mean(kls))
    assert 1e-4 < mean_kl < 0.06, mean_kl  # measured 0.019 (float32, CPU)


def _generate(model: Any, factory: Any, prompts: dict[str, list[int]], n: int,
              late: str | None = None) -> dict[str, list[int]]:
    """Greedy tokens per row through the Runner. Rows other than `late` prefill and join
    together; `late` prefills in two chunks over the next two steps, then joins; each row
    is released once it has n tokens."""
    runner = Runner(model, make_cache=factory)
    params = SamplingParams(temperature=0.0, max_tokens=n)
    new = {x: NewRow(request_id=x, row_id=i, prompt=tuple(p), params=params)
           for i, (x, p) in enumerate(prompts.items())}
    early = [x for x in prompts if x != late]
    plans = [StepPlan(new_rows=tuple(new[x] for x in early), join=tuple(early), prefill=tuple(
        PrefillChunk(request_id=x, start=0, end=len(prompts[x]) - 1) for x in early))]
    if late is not None:
        half, end = len(prompts[late]) // 2, len(prompts[late]) - 1
        plans += [StepPlan(new_rows=(new[late],),
                           prefill=(PrefillChunk(request_id=late, start=0, end=half),)),
                  StepPlan(prefill=(PrefillChunk(request_id=late, start=half, end=end),),
                           join=(late,))]
    tokens: dict[str, list[int]] = {x: [] for x in prompts}
    done: set[str] = set()
    while len(done) < len(prompts):
        finished = tuple(x for x, t in tokens.items() if len(t) >= n and x not in done)
        done.update(finished)
        plan = plans.pop(0) if plans else StepPlan()
        for out in runner.execute(attrs.evolve(plan, release=finished)).outputs:
            tokens[out.request_id] += out.tokens
    return {x: t[:n] for x, t in tokens.items()}


@pytest.mark.parametrize("start", [0, 8])
def test_runner_batched_equals_single_rows(draft_model: LoadedModel, start: int) -> None:
    install_attention()
    model, factory = draft_model.model, make_turboquant_cache_factory(8, 4, start)
    prompts = {x: draft_model.tokenizer.encode(p) for x, p in zip("abc", PROMPTS)}
    prompts["a"] = prompts["a"][:6]  # a finishes and retires first
    batched = _generate(model, factory, prompts, 12, late="c")
    for name, prompt in prompts.items():
        assert _generate(model, factory, {name: prompt}, 12)[name] == batched[name], name


def _gemma(head_dim: int = 128) -> Any:
    args = gemma3_text.ModelArgs(
        model_type="gemma3_text", hidden_size=64, num_hidden_layers=4, intermediate_size=96,
        num_attention_heads=2, head_dim=head_dim, num_key_value_heads=1, vocab_size=97,
        sliding_window=6, sliding_window_pattern=2, query_pre_attn_scalar=head_dim)
    mx.random.seed(0)
    model = gemma3_text.Model(args)
    mx.eval(model.parameters())
    return model


def test_gemma3_sliding_layers_stay_plain_and_warn_once(
        caplog: pytest.LogCaptureFixture) -> None:
    install_attention()
    model = _gemma()
    factory = make_turboquant_cache_factory(8, 8)
    with caplog.at_level(logging.WARNING, logger="tqserve.engine.kv.factory"):
        caches = factory(model)
        factory(model)
    assert len([r for r in caplog.records if "keep plain" in r.message]) == 1
    assert [type(c) for c in caches] == [RotatingKVCache, TurboQuantKVCache] * 2
    tokens, _ = _greedy(model, [1, 5, 9, 2, 7], caches, 12)  # past the window of 6
    assert len(tokens) == 12 and caches[1].offset == caches[3].offset == caches[0].offset > 12


def test_unsupported_head_dim_is_refused_naming_layer_and_dim() -> None:
    args = qwen3.ModelArgs(
        model_type="qwen3", hidden_size=64, num_hidden_layers=2, intermediate_size=96,
        num_attention_heads=2, rms_norm_eps=1e-6, vocab_size=97, num_key_value_heads=1,
        max_position_embeddings=256, head_dim=96, tie_word_embeddings=True, rope_theta=1e4)
    model = qwen3.Model(args)
    with pytest.raises(ValueError, match="layer 0: key head dim 96"):
        check_head_dims(model)
    with pytest.raises(ValueError, match="layer 0: key head dim 96"):
        make_turboquant_cache_factory(4, 4)(model)
    assert check_head_dims(_gemma()) == {1: 128, 3: 128}
    assert isinstance(make_prompt_cache(model)[0], KVCache)


@pytest.mark.parametrize("mask_kind", ["none", "causal", "bool", "additive"])
@pytest.mark.parametrize("length", [2, 5])
def test_short_block_attention_equals_the_fused_op(mask_kind, length):
    """The plain-ops attention that MLX-CUDA's short query blocks use (no per-shape cuDNN
    graph) computes what mx.fast.scaled_dot_product_attention does: GQA, the query block
    at the end of the key span, every mask kind mlx-lm passes."""
    from tqserve.engine.attention.sdpa import short_block_attention

    mx.random.seed(3)
    batch, heads, kv_heads, span, dim = 2, 8, 2, 37, 64
    q = mx.random.normal((batch, heads, length, dim))
    k = mx.random.normal((batch, kv_heads, span, dim))
    v = mx.random.normal((batch, kv_heads, span, dim))
    mask = {"none": None, "causal": "causal"}.get(mask_kind)
    if mask_kind in ("bool", "additive"):
        seen = (mx.arange(span)[None, None, None, :]
                <= (span - length + mx.arange(length))[None, None, :, None])
        seen = seen & (mx.arange(span)[None, None, None, :] >= mx.array([0, 5])[:, None, None,
                                                                               None])
        mask = seen if mask_kind == "bool" else mx.where(seen, 0.0, -mx.inf)
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask)
    got = short_block_attention(q, k, v, 0.125, mask)
    assert got.shape == want.shape
    assert mx.allclose(got, want, atol=1e-5).item()


@pytest.mark.parametrize("length", [3, 12])
def test_short_block_attention_stays_finite_where_a_query_sees_no_key(length):
    """Query positions whose every key is masked (row b masks keys [0, pads[b]), so its
    queries below pads[b] see none: what a left-padded prefill block once produced). The
    fused op (boolean mask) attends uniformly there; so must the short-block path, else
    NaN reaches the next layer's K/V and, through 0 * NaN, the real positions (issue 19:
    the MLX-CUDA batched prefill of unequal prompts)."""
    from tqserve.engine.attention.sdpa import short_block_attention

    mx.random.seed(4)
    pads = mx.array([0, length - 1, 2])
    k = mx.random.normal((3, 2, length, 32))
    v = mx.random.normal((3, 2, length, 32))
    q = mx.random.normal((3, 4, length, 32))
    positions = mx.arange(length)
    causal = positions[None, :] <= positions[:, None]                 # (queries, keys)
    mask = (causal[None] & (positions >= pads[:, None])[:, None])[:, None]  # (B, 1, L, L)
    assert not mask[1, 0, 0].any().item()  # row 1's first query sees no key
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.2, mask=mask)
    got = short_block_attention(q, k, v, 0.2, mask)
    assert not mx.isnan(got).any().item()
    assert mx.allclose(got, want, atol=1e-5).item()
