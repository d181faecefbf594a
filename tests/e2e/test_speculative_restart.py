"""Restart with speculation: a server writes its prefix snapshots (write-through, sync) while
speculating; a new engine on the same --cache-dir serves the same requests from the SSD
tier, still speculating, token-identically. Lookup rows' snapshots hold the target's KV
only; draft rows' are paired with the draft's KV (tests/e2e/test_speculative_paired.py
checks the proposals too)."""

from __future__ import annotations

import pytest

from tqserve.actors.engine import open_engine
from tqserve.actors.messages import Done, Token
from tqserve.engine.config import Config
from tqserve.engine.model import DEFAULT_MODEL
from tqserve.engine.request import GenerateRequest
from tqserve.engine.sampling import SamplingParams

PROMPTS = ["def add(a, b):\n    return a + b\n\n\ndef add_three(a, b, c):\n",
           "import os\nimport sys\n\n\ndef main(argv):\n    for arg in argv:\n"]


async def serve_prompts(config, loaded, seeds, *, repeats=1, max_tokens=16):
    """PROMPTS[i] with seeds[i] (None: greedy, else temperature 1 with that seed), one
    after the other, `repeats` times, in one engine: [(token ids, Done)] in that order."""
    out = []
    async with open_engine(config, loaded=loaded) as engine:
        for _ in range(repeats):
            for prompt, seed in zip(PROMPTS, seeds):
                tokens, done = [], None
                req = GenerateRequest(prompt=prompt, params=SamplingParams(
                    max_tokens=max_tokens, temperature=0.0 if seed is None else 1.0,
                    seed=seed))
                async for event in engine.generate(req):
                    if isinstance(event, Token):
                        tokens.append(event.token_id)
                    elif isinstance(event, Done):
                        done = event
                out.append((tokens, done))
    return out


@pytest.mark.parametrize("method", ["lookup", "draft"])
async def test_restart_from_ssd_continues_token_identically(draft_model, tmp_path, method):
    extra = {"draft_model": str(DEFAULT_MODEL)} if method == "draft" else {}
    config = Config(cache_dir=str(tmp_path), ssd_flush="sync", speculative=method,
                    num_speculative_tokens=3, speculative_time_policy=False, **extra)
    seeds = [None, 7]
    first = await serve_prompts(config, draft_model, seeds)
    second = await serve_prompts(config, draft_model, seeds)
    for (want, _), (got, done) in zip(first, second):
        assert got == want
        assert done.cached_tier == "ssd" and done.cached_tokens > 0
        assert done.speculative is not None and done.speculative[0] > 0
