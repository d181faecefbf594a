"""Greedy output equals mlx_lm's generate_step, alone and inside batches with joins.

Runs through the whole embedded engine (actors, runner thread, batched cache).
Divergences are allowed only as proven near-ties (reference.classify) and counted.
"""

from __future__ import annotations

import pytest
import trio

from tqserve.actors.engine import open_engine
from tqserve.actors.messages import Done, Token
from tqserve.engine.config import Config
from tqserve.engine.request import GenerateRequest
from tqserve.engine.sampling import SamplingParams
from tests.e2e.reference import PROMPTS, classify, reference

MAX_TOKENS = 24


@pytest.fixture(params=["draft_model", "big_model"])
def loaded(request):
    return request.getfixturevalue(request.param)


_REFERENCES: dict[str, list] = {}


@pytest.fixture
def references(loaded):
    key = loaded.fingerprint
    if key not in _REFERENCES:
        _REFERENCES[key] = [reference(loaded, p, MAX_TOKENS) for p in PROMPTS]
    return _REFERENCES[key]


async def run_one(engine, prompt, max_tokens, tokens_out, started=None, wait_for=None):
    if wait_for is not None:
        await wait_for.wait()
    req = GenerateRequest(prompt=prompt, params=SamplingParams(max_tokens=max_tokens,
                                                               temperature=0.0))
    async for event in engine.generate(req):
        if isinstance(event, Token):
            tokens_out.append(event.token_id)
            if started is not None and event.index == 2:
                started.set()
        assert not (isinstance(event, Done) and event.finish_reason == "cancelled")


async def test_single_rows_match_mlx_lm(loaded, references):
    async with open_engine(Config(max_batch=1), loaded=loaded) as engine:
        for prompt, (want, _, _) in zip(PROMPTS, references):
            got: list[int] = []
            await run_one(engine, prompt, MAX_TOKENS, got)
            assert got == want, prompt


@pytest.mark.parametrize("batch", [2, 5, 8])
async def test_batches_with_joins_and_early_retirement(loaded, references, batch):
    """Rows join while others decode (staggered on token 3 of the previous row) and
    retire early (every third row stops after 6 tokens); prompts differ in length."""
    outcomes = {"same": 0, "near_tie": 0}
    picks = [(i * 3 + batch) % len(PROMPTS) for i in range(batch)]
    async with open_engine(Config(max_batch=batch, prefill_chunk=16), loaded=loaded) as engine:
        outs = [[] for _ in picks]
        limits = [6 if k % 3 == 2 else MAX_TOKENS for k in range(batch)]
        events = [trio.Event() for _ in picks]
        async with trio.open_nursery() as nursery:
            for k, idx in enumerate(picks):
                nursery.start_soon(run_one, engine, PROMPTS[idx], limits[k], outs[k], events[k],
                                   events[k - 1] if k else None)
        for k, idx in enumerate(picks):
            want, gaps, _ = references[idx]
            outcomes[classify(outs[k], want[:limits[k]], gaps)] += 1
        assert engine.statistics().rows_active == 0
    assert outcomes["same"] + outcomes["near_tie"] == batch
    assert outcomes["near_tie"] <= 1, outcomes
