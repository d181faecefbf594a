"""Seeded sampling is per row (alone == inside a batch); logprobs come from the model."""

from __future__ import annotations

import mlx.core as mx
import pytest
import trio

from tqserve.actors.engine import open_engine
from tqserve.actors.messages import Token
from tqserve.engine.config import Config
from tqserve.engine.request import GenerateRequest
from tqserve.engine.sampling import SamplingParams
from tests.e2e.reference import PROMPTS, reference

LOGPROB_TOLERANCE = 1e-4  # nats; float32 batch-shape rounding is ~1e-5


async def collect(engine, prompt, params, out):
    async for event in engine.generate(GenerateRequest(prompt=prompt, params=params)):
        if isinstance(event, Token):
            out.append(event)


async def test_seeded_rows_alone_and_in_a_mixed_batch(draft_model):
    seeded = [SamplingParams(max_tokens=16, temperature=0.9, seed=s, top_p=0.95) for s in (11, 22)]
    async with open_engine(Config(max_batch=8), loaded=draft_model) as engine:
        alone = []
        for p, params in zip(PROMPTS, seeded):
            out: list[Token] = []
            await collect(engine, p, params, out)
            alone.append([t.token_id for t in out])
        batched = [[], []]
        noise = [[] for _ in range(4)]
        async with trio.open_nursery() as nursery:
            for k in range(4):  # unseeded and other-seeded rows around them
                params = SamplingParams(max_tokens=12 + k, temperature=1.0,
                                        seed=None if k % 2 else 100 + k)
                nursery.start_soon(collect, engine, PROMPTS[5 + k], params, noise[k])
            for k, (p, params) in enumerate(zip(PROMPTS, seeded)):
                nursery.start_soon(collect, engine, p, params, batched[k])
    assert [[t.token_id for t in b] for b in batched] == alone
    assert alone[0] != alone[1]


async def test_logprobs_match_mlx_lm_log_softmax(draft_model):
    prompt = PROMPTS[2]
    want, _, ref_logprobs = reference(draft_model, prompt, 12)
    params = SamplingParams(max_tokens=12, temperature=0.0, logprobs=True, top_logprobs=5)
    async with open_engine(Config(), loaded=draft_model) as engine:
        out: list[Token] = []
        async with trio.open_nursery() as nursery:  # inside a batch with another row
            nursery.start_soon(collect, engine, PROMPTS[0],
                               SamplingParams(max_tokens=12, temperature=0.8, seed=1), [])
            nursery.start_soon(collect, engine, prompt, params, out)
    assert [t.token_id for t in out] == want
    for tok, lp in zip(out, ref_logprobs):
        assert tok.logprob == pytest.approx(lp[tok.token_id].item(), abs=LOGPROB_TOLERANCE)
        ref_top = mx.argsort(-lp)[:5].tolist()
        assert [t for t, _ in tok.top_logprobs] == ref_top
        for t, v in tok.top_logprobs:
            assert v == pytest.approx(lp[t].item(), abs=LOGPROB_TOLERANCE)
