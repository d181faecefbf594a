"""Prefix cache end to end: cold == RAM hit == SSD hit after a restart, token for token.

Real engine, bundled draft model, CPU. A small RAM budget forces spills to the SSD tier;
a second `open_engine` on the same --cache-dir restores the index from disk.
"""

from __future__ import annotations

import pytest
import trio

from tqserve.actors.engine import open_engine
from tqserve.actors.messages import Done, Token
from tqserve.engine.config import Config
from tqserve.engine.model import DEFAULT_MODEL, load_model
from tqserve.engine.request import GenerateRequest
from tqserve.engine.sampling import SamplingParams
from tests.e2e.reference import PROMPTS

MAX_TOKENS = 8
SYSTEM = ("# You are a careful Python programmer. Write small, clear functions with\n"
          "# docstrings and type hints, and never use global state.\n")


def build_prompts(tokenizer) -> list[tuple[tuple[int, ...], SamplingParams]]:
    """System-prompt style requests plus multi-turn continuations (each turn extends the
    previous prompt), some seeded with logprobs: 32 requests."""
    system = tuple(tokenizer.encode(SYSTEM))
    out = []
    for i, prompt in enumerate(PROMPTS):
        seeded = i % 3 == 1
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8 if seeded else 0.0,
                                seed=i if seeded else None, logprobs=True, top_logprobs=2)
        out.append((system + tuple(tokenizer.encode(prompt)), params))
    history = system
    for turn in range(22):
        history = history + tuple(tokenizer.encode(f"# turn {turn}: {PROMPTS[turn % 10]}"))
        out.append((history, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                                            logprobs=True)))
    return out


async def run_all(engine, requests, concurrency):
    results: list = [None] * len(requests)
    limiter = trio.CapacityLimiter(concurrency)

    async def one(i):
        async with limiter:
            tokens, logprobs, done = [], [], None
            prompt, params = requests[i]
            async for event in engine.generate(GenerateRequest(prompt_tokens=prompt,
                                                               params=params)):
                if isinstance(event, Token):
                    tokens.append(event.token_id)
                    logprobs.append(event.logprob)
                elif isinstance(event, Done):
                    done = event
            results[i] = (tokens, logprobs, done)

    async with trio.open_nursery() as nursery:
        for i in range(len(requests)):
            nursery.start_soon(one, i)
            if concurrency == 1:
                await trio.sleep(0)
    return results


SETTLE_POLLS = 2000  # bounded polling of the index while async writes land (a hang guard)
BARRIER = (5, 6)    # a 2-token prompt no test request shares


async def settle(engine) -> None:
    """Wait until every spill ordered for the rows that finished so far is on disk.

    An event wait, not a clock: a 2-token barrier request takes two engine steps: the first
    releases and snapshots the finished rows, the second carries their spill orders, which
    are written (or queued, --ssd-flush async) before its second token is sent. Queued
    writes are then awaited by polling the index until nothing is SPILLING."""
    barrier = GenerateRequest(prompt_tokens=BARRIER,
                              params=SamplingParams(max_tokens=2, temperature=0.0))
    events = [event async for event in engine.generate(barrier)]
    assert isinstance(events[-1], Done) and events[-1].completion_tokens == 2, events[-1]
    for _ in range(SETTLE_POLLS):
        stats = engine.statistics().prefix_cache
        if not stats.spilling_entries and not stats.orders_pending:
            return
        await trio.sleep(0.005)
    raise AssertionError("spills still in flight")


def assert_same(got, want):
    for i, ((tokens, logprobs, _), (ref_tokens, ref_logprobs, _)) in enumerate(zip(got, want)):
        assert tokens == ref_tokens, i
        assert logprobs == pytest.approx(ref_logprobs, abs=1e-4), i


_COLD: dict = {}


async def cold(loaded, requests, **kv):
    key = (loaded.fingerprint, *sorted(kv.items()))
    if key not in _COLD:
        async with open_engine(Config(prefix_cache=False, max_batch=8, **kv),
                               loaded=loaded) as engine:
            _COLD[key] = await run_all(engine, requests, 1)
    return _COLD[key]


@pytest.fixture(scope="module")
def bf16_model():
    """The bundled model in bfloat16: plain bf16 KV caches (slow matmuls on the CPU backend,
    fine at this size)."""
    return load_model(DEFAULT_MODEL, "bfloat16")


@pytest.mark.parametrize("kv", [{}, {"turboquant": "k4v4"}], ids=["plain", "turboquant"])
@pytest.mark.parametrize("flush", ["sync", "async"])
@pytest.mark.parametrize("concurrency", [1, 8])
async def test_cold_ram_ssd_identical(draft_model, tmp_path, kv, flush, concurrency):
    await _cold_ram_ssd_identical(draft_model, tmp_path, kv, flush, concurrency)


async def test_cold_ram_ssd_identical_bfloat16(bf16_model, tmp_path):
    assert bf16_model.dtype == "bfloat16"
    await _cold_ram_ssd_identical(bf16_model, tmp_path, {}, "sync", 8)


async def _cold_ram_ssd_identical(draft_model, tmp_path, kv, flush, concurrency):
    requests = build_prompts(draft_model.tokenizer)
    want = await cold(draft_model, requests, **kv)
    config = Config(max_batch=8, ram_cache_bytes=200_000, cache_dir=str(tmp_path),
                    ssd_flush=flush, **kv)
    async with open_engine(config, loaded=draft_model) as engine:
        first = await run_all(engine, requests, concurrency)
        await settle(engine)
        stats = engine.statistics().prefix_cache
    assert_same(first, want)
    assert stats.hits_ram > 0 and stats.spills > 0, stats
    assert sum(r[2].cached_tokens_by_tier["ram"] for r in first) > 0
    async with open_engine(config, loaded=draft_model) as engine:
        second = await run_all(engine, requests, concurrency)
        stats = engine.statistics().prefix_cache
    assert_same(second, want)
    assert stats.hits_ssd > 0, stats
    assert sum(r[2].cached_tokens_by_tier["ssd"] for r in second) > 0
    for _, _, done in second:
        assert done.cached_tokens == sum(done.cached_tokens_by_tier.values())
