"""Warm-up (engine.warmup): every batch bucket runs once, nothing is left behind, and the
requests served afterwards get the tokens they get without it."""

from __future__ import annotations

import logging

import attrs
import pytest
import trio

from tqserve.actors.engine import open_engine
from tqserve.actors.messages import Token
from tqserve.engine.config import Config
from tqserve.engine.kv.slots import RowSlotsKVCache
from tqserve.engine.request import GenerateRequest
from tqserve.engine.runner import Runner
from tqserve.engine.sampling import SamplingParams
from tqserve.engine.warmup import (WARMUP_NEW_TOKENS, WARMUP_PROMPT_TOKENS, batch_buckets,
                                   wanted, warm_up)
from tests.e2e.reference import PROMPTS


def test_buckets_and_setting():
    assert batch_buckets(1) == (1,)
    assert batch_buckets(8) == (1, 2, 4, 8)
    assert batch_buckets(6) == (1, 2, 4, 6)
    assert batch_buckets(32) == (1, 2, 4, 8, 16, 32)
    with pytest.raises(ValueError, match="max_batch"):
        batch_buckets(0)
    assert wanted("on") and not wanted("off")
    assert not wanted("auto")  # the tests run on MLX's CPU backend
    with pytest.raises(ValueError, match="--warmup must be one of auto, on, off"):
        Config(warmup="always")


def test_warm_up_runs_each_bucket_and_leaves_the_runner_empty(draft_model, monkeypatch):
    runner = Runner(draft_model.model)
    lines: list[str] = []
    decode_masks: set[bool] = set()  # whether decode steps attended with a mask
    make_mask = RowSlotsKVCache.make_mask

    def recording(self, N, **kwargs):
        mask = make_mask(self, N, **kwargs)
        if N == 1:
            decode_masks.add(mask is not None)
        return mask

    monkeypatch.setattr(RowSlotsKVCache, "make_mask", recording)
    report = warm_up(runner, max_batch=5, prefill_chunk=16, max_step_tokens=64,
                     vocab_size=draft_model.vocab_size, progress=lines.append)
    assert report.batches == (1, 2, 4, 5)
    rows = sum(report.batches)
    # every prompt position once (prefill, then each row's one-position joins; every
    # second prompt one token shorter) and one position per decode step of each row
    # after its first token
    assert report.num_forward_tokens >= rows * (WARMUP_PROMPT_TOKENS + WARMUP_NEW_TOKENS - 3)
    assert report.num_steps > len(report.batches) * WARMUP_NEW_TOKENS
    assert [line.split(",")[0] for line in lines] == [
        "warm-up: batch 1 (1/4)", "warm-up: batch 2 (2/4)", "warm-up: batch 4 (3/4)",
        "warm-up: batch 5 (4/4)", "warm-up: done"]
    assert decode_masks == {True, False}  # both attention paths ran
    stats = runner.statistics()
    assert (stats.num_rows, stats.num_batch_rows, stats.kv_bytes, stats.num_snapshots) == \
        (0, 0, 0, 0)
    runner.close()


async def _tokens(engine, prompt: str, params: SamplingParams) -> list[int]:
    return [e.token_id async for e in engine.generate(GenerateRequest(prompt=prompt,
                                                                        params=params))
            if isinstance(e, Token)]


async def _serve_batch(config: Config, loaded) -> tuple[list[list[int]], int]:
    params = [SamplingParams(max_tokens=10, temperature=0.0),
              SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, seed=7),
              SamplingParams(max_tokens=8, temperature=0.0)]
    out: list[list[int]] = [[] for _ in params]
    async with open_engine(config, loaded=loaded) as engine:
        async def one(i: int) -> None:
            out[i] = await _tokens(engine, PROMPTS[i], params[i])

        async with trio.open_nursery() as nursery:
            for i in range(len(params)):
                nursery.start_soon(one, i)
        return out, engine.runner.statistics().num_forward_tokens


async def test_engine_with_warmup_serves_the_same_tokens(draft_model, caplog):
    caplog.set_level(logging.INFO, logger="tqserve.warmup")
    config = Config(max_batch=4, prefill_chunk=32, max_step_tokens=64, prefix_cache=False)
    cold, cold_forward = await _serve_batch(config, draft_model)
    warm, warm_forward = await _serve_batch(attrs.evolve(config, warmup="on"), draft_model)
    assert warm == cold
    assert [len(t) for t in warm] == [10, 10, 8]
    assert warm_forward > cold_forward  # the warm-up's forwards ran on the same runner
    progress = [r.getMessage() for r in caplog.records if r.name == "tqserve.warmup"]
    assert len(progress) == 4 and progress[0].startswith("warm-up: batch 1 (1/3)")
    assert progress[-1].startswith("warm-up: done, 3 batch sizes")
