"""Affine KV caches: serial == slot batch bytes through every batch operation
(AffineSlotsKVCache), equality with mlx-lm's QuantizedKVCache (bytes, memory, attention,
greedy tokens), the engine's Runner, and the config / factory / CLI wiring."""

from __future__ import annotations

import copy
import logging
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models import base, qwen3
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from tqserve.api.cli import _config, build_parser
from tqserve.engine.config import Config
from tqserve.engine.kv.affine import PLANES, AffineKVCache
from tqserve.engine.kv.factory import (cache_factory_for, check_affine_head_dims,
                                        make_affine_cache_factory)
from tqserve.engine.kv.affine import AffineSlotsKVCache
from tqserve.engine.kv.slots import slot_batch_of
from tqserve.engine.kv.turboquant import TurboQuantKVCache
from tqserve.engine.model import LoadedModel
from tqserve.engine.runner import Runner
from tqserve.engine.sampling import SamplingParams
from tqserve.engine.scheduler import SchedulerCore
from tqserve.engine.step import TokenOut
from tests.unit.test_kv_quant_slots import D as DIM
from tests.unit.test_kv_quant_slots import H as HEADS
from tests.unit.test_kv_quant_slots import Mirror, Planes, run_batch_scenario

PROMPTS = ("def fibonacci(n):\n    if n < 2:\n", "import os\nimport sys\n\nclass Config:\n",
           "for i in range(10):\n    print(")
ATTN_TOL = 1e-5  # slot batch (masked) vs one row: float32 summation order only


def planes(cache: AffineKVCache) -> Planes:
    """A single row's written planes."""
    return {n: np.array(a) for n, a in cache.written().items()}


def quantized_planes(cache: QuantizedKVCache) -> Planes:
    """mlx-lm's QuantizedKVCache written planes, under our plane names."""
    keys, values = cache.keys_and_values()
    return {n: np.array(a) for n, a in zip(PLANES, (*keys, *values))}


@pytest.mark.parametrize("bits, group_size", [(8, 64), (4, 32)])
def test_serial_and_batched_rows_hold_identical_bytes(bits: int, group_size: int) -> None:
    mirror = Mirror(lambda: AffineKVCache(bits, group_size), planes)
    run_batch_scenario(mirror)
    assert isinstance(mirror.batch, AffineSlotsKVCache)
    assert (mirror.batch.bits, mirror.batch.group_size) == (bits, group_size)


@pytest.mark.parametrize("bits, group_size", [(8, 64), (4, 32)])
def test_single_row_equals_mlx_lm_quantized_cache(bits: int, group_size: int) -> None:
    """Same bytes, dtypes and resident size (both grow in steps of 256 positions)."""
    mirror = Mirror(AffineKVCache, planes)
    ours, theirs = AffineKVCache(bits, group_size), QuantizedKVCache(group_size, bits)
    for length in (5, 250, 1, 300):
        k, v = mirror.kv(1, length)
        for cache in (ours, theirs):
            cache.update_and_fetch(k, v)
        np.testing.assert_equal(planes(ours), quantized_planes(theirs))
        assert ours.nbytes == theirs.nbytes and ours.offset == theirs.offset
    assert ours.trim(7) == theirs.trim(7) == 7
    k, v = mirror.kv(1, 2)
    fetched = ours.update_and_fetch(k, v)
    theirs.update_and_fetch(k, v)
    np.testing.assert_equal(planes(ours), quantized_planes(theirs))
    assert [a.dtype for a in (*fetched[0], *fetched[1])] == [mx.uint32, mx.float32,
                                                              mx.float32] * 2


@pytest.mark.parametrize("bits, group_size", [(8, 64), (4, 128)])
@pytest.mark.parametrize("length", [1, 3])
def test_batched_attention_equals_mlx_lm_quantized_attention(bits: int, group_size: int,
                                                              length: int) -> None:
    """mlx-lm's dispatch over a slot batch of rows of their own lengths (GQA, boolean mask)
    == QuantizedKVCache attention of each row alone."""
    rng = np.random.default_rng(0)

    def rand(*shape: int) -> mx.array:
        return mx.array(rng.standard_normal(shape).astype(np.float32))

    dim, kv_heads, q_heads, scale = 128, 2, 4, 128**-0.5
    rows, refs = [], []
    for n in (4, 11, 7):
        k, v = rand(1, kv_heads, n, dim), rand(1, kv_heads, n, dim) * 3
        rows.append(AffineKVCache(bits, group_size))
        refs.append(QuantizedKVCache(group_size, bits))
        for cache in (rows[-1], refs[-1]):
            cache.update_and_fetch(k, v)
    batch = slot_batch_of(rows)
    assert batch.lengths == [4, 11, 7]
    keys, values, queries = (rand(3, kv_heads, length, dim), rand(3, kv_heads, length, dim),
                             rand(3, q_heads, length, dim))
    mask = batch.make_mask(length)
    fetched = batch.update_and_fetch(keys, values)
    out = base.scaled_dot_product_attention(mx.array(queries), fetched[0], fetched[1],
                                            cache=batch, scale=scale, mask=mask)
    for i, ref in enumerate(refs):
        ref_mask = ref.make_mask(length, return_array=False, window_size=None)
        ref_kv = ref.update_and_fetch(keys[i : i + 1], values[i : i + 1])
        # mx.array(...): mlx-lm's quantized attention scales its queries in place.
        want = base.scaled_dot_product_attention(mx.array(queries[i : i + 1]), ref_kv[0],
                                                 ref_kv[1], cache=ref, scale=scale,
                                                 mask=ref_mask)
        np.testing.assert_allclose(np.array(out[i : i + 1]), np.array(want), atol=ATTN_TOL)


def test_nbytes_counts_allocated_encoded_bytes() -> None:
    mirror = Mirror(AffineKVCache, planes)
    rows = []
    for n in (5, 7):
        rows.append(AffineKVCache(4, 32))
        rows[-1].update_and_fetch(*mirror.kv(1, n))
    per_position = HEADS * 2 * (DIM * 4 // 32 * 4 + 2 * DIM // 32 * 4)  # wq + scales, biases
    assert rows[0].nbytes == 256 * per_position  # one step of growth
    batch = slot_batch_of(rows)
    assert batch.nbytes == 2 * 256 * per_position  # two row slots of one step
    batch.filter([1])
    assert batch.nbytes == 2 * 256 * per_position  # the freed slot stays allocated
    assert slot_batch_of([AffineKVCache(4, 32), AffineKVCache(4, 32)]).nbytes == 0


def test_state_from_kv_cache_and_copies() -> None:
    mirror = Mirror(lambda: AffineKVCache(8, 32), planes)
    run_batch_scenario(mirror)
    for name in mirror.order:
        single = mirror.serial[name]
        restored = AffineKVCache.from_state(single.state)
        assert (restored.bits, restored.group_size, restored.offset) == (8, 32, single.offset)
        np.testing.assert_equal(planes(restored), planes(single))
    batch = AffineSlotsKVCache.from_state(copy.deepcopy(mirror.batch).state)
    assert (batch.bits, batch.group_size) == (8, 32)
    assert batch.offset.tolist() == mirror.batch.offset.tolist()
    for i in range(len(mirror.order)):
        np.testing.assert_equal(planes(batch.extract(i)), planes(mirror.batch.extract(i)))
    empty = AffineSlotsKVCache.from_state(
        slot_batch_of([AffineKVCache(8, 32), AffineKVCache(8, 32)]).state)
    assert empty.empty() and empty.offset.tolist() == [0, 0]
    plain, direct = KVCache(), AffineKVCache(8, 32)
    for length in (4, 3):
        k, v = mirror.kv(1, length)
        plain.update_and_fetch(k, v)
        direct.update_and_fetch(k, v)
    converted = AffineKVCache.from_kv_cache(plain, 8, 32)
    assert converted.offset == 7
    np.testing.assert_equal(planes(converted), planes(direct))
    assert AffineKVCache.from_kv_cache(KVCache(), 4, 64).empty()
    with pytest.raises(TypeError, match="KVCache"):
        AffineKVCache.from_kv_cache(converted, 8, 32)  # type: ignore[arg-type]


def test_invalid_inputs_raise() -> None:
    with pytest.raises(ValueError, match="bits must be one of"):
        AffineKVCache(5, 64)
    with pytest.raises(ValueError, match="group size must be one of"):
        AffineKVCache(8, 48)
    cache = AffineKVCache(8, 64)
    with pytest.raises(ValueError, match="head dim 96"):
        cache.update_and_fetch(mx.zeros((1, HEADS, 1, 96)), mx.zeros((1, HEADS, 1, 96)))
    with pytest.raises(ValueError, match="expected keys"):
        cache.update_and_fetch(mx.zeros((1, HEADS, 1, 64)), mx.zeros((1, HEADS, 2, 64)))
    two = slot_batch_of([AffineKVCache(8, 64), AffineKVCache(8, 64)])
    with pytest.raises(ValueError, match=r"expected keys and values \(2, "):
        two.update_and_fetch(mx.zeros((3, HEADS, 1, DIM)), mx.zeros((3, HEADS, 1, DIM)))
    with pytest.raises(ValueError, match="cannot combine"):
        slot_batch_of([AffineKVCache(8, 64), AffineKVCache(4, 64)])
    with pytest.raises(ValueError, match="cannot combine"):
        slot_batch_of([AffineKVCache(8, 64)]).extend(slot_batch_of([AffineKVCache(8, 32)]))


def _greedy(model: Any, prompt: list[int], cache: list[Any], n: int) -> tuple[list[int], Any]:
    steps = generate_step(mx.array(prompt), model, max_tokens=n, prompt_cache=cache,
                          sampler=lambda x: mx.argmax(x, axis=-1))
    tokens, logprobs = zip(*((int(t), np.array(lp)) for t, lp in steps))
    return list(tokens), np.stack(logprobs)


def _serve(loaded: LoadedModel, factory: Any, prompts: dict[str, list[int]],
           max_tokens: dict[str, int]) -> dict[str, list[int]]:
    """Greedy tokens per request through SchedulerCore + Runner (sync loop, 3 rows)."""
    core = SchedulerCore(max_batch=3, prefill_chunk=8, eos_token_ids=[])
    runner = Runner(loaded.model, make_cache=factory)
    for rid, prompt in prompts.items():
        core.add(rid, tuple(prompt), SamplingParams(temperature=0.0, max_tokens=max_tokens[rid]))
    tokens: dict[str, list[int]] = {rid: [] for rid in prompts}
    while core.has_work():
        plan, _ = core.schedule()
        for event in core.postprocess(runner.execute(plan)):
            if isinstance(event, TokenOut):
                tokens[event.request_id] += event.token_ids
    assert runner.kv_bytes() == 0
    return tokens


def test_runner_batched_equals_single_rows_and_mlx_lm_kv_bits_8(draft_model: LoadedModel) -> None:
    """Rows of different lengths join at different steps (prefill chunks of 8) and retire at
    different steps: the batch gives each row's single-row tokens, which are mlx-lm's
    generate_step tokens with its own QuantizedKVCache(bits=8)."""
    model, factory = draft_model.model, make_affine_cache_factory(8, 64)
    prompts = {x: draft_model.tokenizer.encode(p) for x, p in zip("abc", PROMPTS)}
    max_tokens = {"a": 10, "b": 16, "c": 13}
    batched = _serve(draft_model, factory, prompts, max_tokens)
    for rid, prompt in prompts.items():
        single = _serve(draft_model, factory, {rid: prompt}, max_tokens)[rid]
        assert batched[rid] == single, rid
        reference = [QuantizedKVCache(group_size=64, bits=8) for _ in model.layers]
        assert single == _greedy(model, prompt, reference, max_tokens[rid])[0][:len(single)], rid
    ours, ours_lp = _greedy(model, prompts["b"], factory(model), 16)
    theirs, theirs_lp = _greedy(model, prompts["b"],
                                [QuantizedKVCache(64, 8) for _ in model.layers], 16)
    assert ours == theirs
    np.testing.assert_array_equal(ours_lp, theirs_lp)  # same bytes, same attention function


def test_config_turboquant_wins_with_one_warning(draft_model: LoadedModel,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    config = Config(turboquant="k4v4", kv_quant=8)
    with caplog.at_level(logging.WARNING):
        factory = cache_factory_for(draft_model.model, config.turboquant,
                                    config.quantized_kv_start, config.kv_quant,
                                    config.kv_group_size)
        assert factory is not None
        caches = factory(draft_model.model)
        factory(draft_model.model)
    assert [type(c) for c in caches] == [TurboQuantKVCache] * len(draft_model.model.layers)
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "kv-quant" in warnings[0].getMessage()


def test_config_and_factory_choose_affine(draft_model: LoadedModel) -> None:
    config = Config(kv_quant=4, kv_group_size=128)
    factory = cache_factory_for(draft_model.model, config.turboquant, config.quantized_kv_start,
                                config.kv_quant, config.kv_group_size)
    assert factory is not None
    caches = factory(draft_model.model)
    assert all(type(c) is AffineKVCache and (c.bits, c.group_size) == (4, 128) for c in caches)
    assert cache_factory_for(draft_model.model, None) is None
    with pytest.raises(ValueError, match="quantized-kv-start"):
        cache_factory_for(draft_model.model, None, 8, 8, 64)


@pytest.mark.parametrize("fields, needle", [({"kv_quant": 5}, "kv-quant"),
                                            ({"kv_quant": 8.0}, "kv-quant"),
                                            ({"kv_group_size": 48}, "kv-group-size")])
def test_config_refuses_bad_kv_quant(fields: dict[str, Any], needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        Config(**fields)


def test_head_dim_not_a_multiple_of_group_size_is_refused() -> None:
    args = qwen3.ModelArgs(
        model_type="qwen3", hidden_size=64, num_hidden_layers=2, intermediate_size=96,
        num_attention_heads=2, rms_norm_eps=1e-6, vocab_size=97, num_key_value_heads=1,
        max_position_embeddings=256, head_dim=96, tie_word_embeddings=True, rope_theta=1e4)
    model = qwen3.Model(args)
    assert check_affine_head_dims(model, 32) == [0, 1]
    with pytest.raises(ValueError, match="layer 0: key head dim 96 .* kv-group-size 64"):
        cache_factory_for(model, None, kv_quant=8, kv_group_size=64)


def test_cli_maps_kv_quant_flags() -> None:
    args = build_parser().parse_args(["generate", "--prompt", "x", "--kv-quant", "4",
                                      "--kv-group-size", "32"])
    config = _config(args)
    assert (config.kv_quant, config.kv_group_size) == (4, 32)
    default = _config(build_parser().parse_args(["serve"]))
    assert (default.kv_quant, default.kv_group_size) == (None, 64)
    for bad in (["--kv-quant", "5"], ["--kv-group-size", "48"]):
        with pytest.raises(SystemExit) as exit_info:
            build_parser().parse_args(["serve", *bad])
        assert exit_info.value.code == 2


@pytest.mark.parametrize("bits,group_size", [(8, 64), (4, 32), (8, 128)])
@pytest.mark.parametrize("length,mask", [(1, None), (5, "causal")])
def test_affine_sdpa_matches_mlx_lm_quantized_attention(bits, group_size, length, mask):
    """affine_sdpa (what --kv-quant uses on MLX-CUDA) computes mlx-lm's quantized attention."""
    from tqserve.engine.attention.sdpa import affine_sdpa

    cache = AffineKVCache(bits, group_size)
    k = mx.random.normal((2, 2, 40, 128), key=mx.random.key(1))
    v = mx.random.normal((2, 2, 40, 128), key=mx.random.key(2))
    cache.update_and_fetch(k[:, :, :35], v[:, :, :35])
    keys, values = cache.update_and_fetch(k[:, :, 35:35 + length], v[:, :, 35:35 + length])
    queries = mx.random.normal((2, 8, length, 128), key=mx.random.key(3))
    ours = affine_sdpa(queries, keys, values, 0.1, mask, group_size, bits)
    reference = base.quantized_scaled_dot_product_attention(
        queries, keys, values, scale=0.1, mask=mask, group_size=group_size, bits=bits)
    assert ours.shape == reference.shape == queries.shape
    assert np.max(np.abs(np.array(ours) - np.array(reference))) < 1e-4
