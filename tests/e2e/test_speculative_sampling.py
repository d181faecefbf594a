"""Speculative sampling (temperature 1, pycoder-29m) follows the target's distribution, per
proposer: a chi-square test of the second token (the first one a verify step can accept
from a proposal) against the target's own probabilities; and every seeded speculating row
gives exactly the tokens its plain twin (same seed, speculative false, same batch) gives."""

from __future__ import annotations

import math

import mlx.core as mx
import pytest
import trio

from tqserve.actors.engine import open_engine
from tqserve.actors.messages import Done, Token
from tqserve.engine.config import Config
from tqserve.engine.model import DEFAULT_MODEL
from tqserve.engine.request import GenerateRequest
from tqserve.engine.sampling import SamplingParams

# The first token after this prompt is 8 spaces with p = 0.998 (pycoder-29m), so the second
# token's distribution is, up to 0.2%, p(x2 | prompt + that token): computable exactly.
PROMPT = "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, x):\n"
NUM_SEEDS = 120
TWINS = 6


def _chi2_critical(df: int, z: float = 3.09) -> float:
    """Upper 0.1% quantile of chi-square(df) (Wilson-Hilferty approximation)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


async def _sample(engine, seed: int, speculative, out: dict) -> None:
    req = GenerateRequest(prompt=PROMPT, speculative=speculative,
                          params=SamplingParams(max_tokens=2, temperature=1.0, seed=seed))
    tokens = []
    async for event in engine.generate(req):
        if isinstance(event, Token):
            tokens.append(event.token_id)
        elif isinstance(event, Done):
            out[(seed, speculative is False)] = (tuple(tokens), event.speculative)


@pytest.mark.parametrize("method", ["lookup", "draft", "mtp"])
async def test_speculative_sampling_follows_the_target(big_model, method):
    extra = {"draft_model": str(DEFAULT_MODEL)} if method == "draft" else {}
    # every row reuses the first one's prompt snapshot (an MTP row's is paired with its
    # head's state, so it proposes from its first step)
    config = Config(max_batch=8, speculative=method, num_speculative_tokens=1,
                    speculative_time_policy=False, **extra)
    num_seeds = NUM_SEEDS
    out: dict = {}
    async with open_engine(config, loaded=big_model) as engine:
        await _sample(engine, NUM_SEEDS, None, {})  # publishes the prompt: the rest reuse it
        async with trio.open_nursery() as nursery:
            limiter = trio.CapacityLimiter(8)

            async def one(seed, spec):
                async with limiter:
                    await _sample(engine, seed, spec, out)
            for seed in range(num_seeds):
                nursery.start_soon(one, seed, None)
                if seed < TWINS:  # plain twins for the seeded-identity check
                    nursery.start_soon(one, seed, False)
    for seed in range(TWINS):
        assert out[(seed, False)][0] == out[(seed, True)][0], seed
    proposed = sum(u[0] for (_, plain), (_, u) in out.items() if not plain and u is not None)
    accepted = sum(u[1] for (_, plain), (_, u) in out.items() if not plain and u is not None)
    assert proposed >= num_seeds // 2 and 0 < accepted <= proposed
    tok = big_model.tokenizer
    first = 263  # "        "
    ids = tok.encode(PROMPT) + [first]
    probs = mx.softmax(big_model.model(mx.array(ids)[None])[0, -1]).tolist()
    seconds = [toks[1] for (seed, plain), (toks, _) in out.items()
               if not plain and toks[0] == first]
    assert len(seconds) >= num_seeds - 3
    n = len(seconds)
    bins = [t for t in range(len(probs)) if probs[t] * n >= 5]
    observed = [seconds.count(t) for t in bins]
    expected = [probs[t] * n for t in bins]
    rest_obs, rest_exp = n - sum(observed), n - sum(expected)
    if rest_exp >= 5:
        observed.append(rest_obs)
        expected.append(rest_exp)
    elif rest_obs:  # tokens the target almost never gives must stay rare
        assert rest_obs <= 3
    stat = sum((o - e) ** 2 / e for o, e in zip(observed, expected))
    df = len(expected) - 1
    assert df >= 1 and stat < _chi2_critical(df), (stat, df, observed, expected)
