"""Greedy speculative output equals non-speculative output (mlx-lm's generate_step), with
each method, alone and in batches with joins and early retirement, plain rows (speculative
false) mixed in; with and without the prefix cache; plain float32 and TurboQuant k8v3.
Divergences only as proven near-ties (reference.classify)."""

from __future__ import annotations

import pytest
import trio

from tqserve.actors.engine import open_engine
from tqserve.actors.messages import Done, Token
from tqserve.engine.config import Config
from tqserve.engine.model import DEFAULT_MODEL
from tqserve.engine.request import GenerateRequest
from tqserve.engine.sampling import SamplingParams
from tests.e2e.reference import PROMPTS, classify, reference

MAX_TOKENS = 20
_REFERENCES: dict[tuple[str, int], tuple] = {}


def _reference(loaded, idx: int) -> tuple:
    """mlx-lm's greedy tokens for PROMPTS[idx] (computed once per model and prompt)."""
    key = (loaded.fingerprint, idx)
    if key not in _REFERENCES:
        _REFERENCES[key] = reference(loaded, PROMPTS[idx], MAX_TOKENS)
    return _REFERENCES[key]


async def _run(engine, prompt, max_tokens, out, speculative=None, started=None, wait_for=None):
    if wait_for is not None:
        await wait_for.wait()
    req = GenerateRequest(prompt=prompt, speculative=speculative,
                          params=SamplingParams(max_tokens=max_tokens, temperature=0.0))
    async for event in engine.generate(req):
        if isinstance(event, Token):
            out["tokens"].append(event.token_id)
            if started is not None and event.index == 2:
                started.set()
        elif isinstance(event, Done):
            out["done"] = event
    if started is not None:
        started.set()


async def _batch(engine, picks, limits, speculative):
    outs = [{"tokens": []} for _ in picks]
    events = [trio.Event() for _ in picks]
    async with trio.open_nursery() as nursery:
        for k, idx in enumerate(picks):
            nursery.start_soon(_run, engine, PROMPTS[idx], limits[k], outs[k], speculative[k],
                               events[k], events[k - 1] if k else None)
    return outs


LOOKUP = ("lookup", "draft_model", {})
DRAFT = ("draft", "big_model", {"draft_model": str(DEFAULT_MODEL)})  # 29m verifies draft-4m
MTP = ("mtp", "big_model", {})
CASES = [(*LOOKUP, 1, True), (*LOOKUP, 4, False), (*LOOKUP, 8, True),
         (*DRAFT, 1, True), (*DRAFT, 5, False), (*MTP, 3, True)]


@pytest.mark.parametrize("method,model,extra,batch,prefix", CASES,
                         ids=[f"{c[0]}-B{c[3]}-{'prefix' if c[4] else 'noprefix'}" for c in CASES])
async def test_greedy_speculation_matches_mlx_lm(request, method, model, extra, batch, prefix):
    loaded = request.getfixturevalue(model)
    picks = [(i * 3 + batch) % len(PROMPTS) for i in range(batch)]
    limits = [6 if k % 3 == 2 else MAX_TOKENS for k in range(batch)]
    spec = [False if k % 4 == 3 else None for k in range(batch)]  # a plain row among them
    config = Config(max_batch=batch, prefill_chunk=16, speculative=method, prefix_cache=prefix,
                    num_speculative_tokens=3, speculative_time_policy=False, **extra)
    outcomes = {"same": 0, "near_tie": 0}
    async with open_engine(config, loaded=loaded) as engine:
        rounds = 2 if prefix else 1  # the second round reuses the first one's prefixes
        for _ in range(rounds):
            outs = await _batch(engine, picks, limits, spec)
            for k, idx in enumerate(picks):
                want, gaps, _ = _reference(loaded, idx)
                outcomes[classify(outs[k]["tokens"], want[:limits[k]], gaps)] += 1
                usage = outs[k]["done"].speculative
                if spec[k] is False:
                    assert usage is None
                if usage is not None:
                    assert 0 <= usage[1] <= usage[0] and usage[2] >= 1
        stats = engine.statistics()
        assert stats.rows_active == 0
        assert 0 < stats.speculative.num_accepted <= stats.speculative.num_proposed
        if method == "lookup":  # proposed by the speculation actor, off the runner thread,
            ran = engine.runner.statistics()  # but a row's first decode step (no decision)
            speculating = rounds * sum(s is not False for s in spec)
            assert ran.num_drafts_taken > 0 and ran.num_proposals_made <= speculating, ran
    assert outcomes["near_tie"] <= 1, outcomes


async def test_turboquant_k8v3_speculative_equals_plain_decoding(draft_model):
    """TurboQuant k8v3 rows: speculating (lookup) rows give the tokens their plain twins
    (speculative false, same engine, same cache kind) give; B4 with joins."""
    picks = [0, 2, 6, 1]
    limits = [MAX_TOKENS] * 4
    config = Config(max_batch=4, prefill_chunk=16, speculative="lookup", turboquant="k8v3",
                    speculative_time_policy=False,
                    num_speculative_tokens=4)
    async with open_engine(config, loaded=draft_model) as engine:
        plain = await _batch(engine, picks, limits, [False] * 4)
        spec = await _batch(engine, picks, limits, [None] * 4)
    same = sum(p["tokens"] == s["tokens"] for p, s in zip(plain, spec))
    assert same >= 3, [(p["tokens"], s["tokens"]) for p, s in zip(plain, spec)]
    assert all(s["done"].speculative[0] > 0 for s in spec)
