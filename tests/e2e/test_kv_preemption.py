"""--kv-admission preempt (engine.kv_budget) through the whole engine: four long rows (two
greedy, two seeded) under a KV budget that holds two of them at their full length. Rows are charged what they
hold, so more start; when the slots must grow past the budget the longest row is
preempted, its KV snapshotted into the prefix cache's RAM tier, and it resumes from that
snapshot. Its greedy and its seeded tokens are those of the same requests without a
budget; the runner's real allocation never passes the budget; usage counts the request's
own prompt and all its output."""

from __future__ import annotations

import attrs
import trio

from tqserve.actors.engine import open_engine
from tqserve.actors.messages import Done, Token
from tqserve.engine.config import Config
from tqserve.engine.memory import kv_bytes_per_position
from tqserve.engine.request import GenerateRequest
from tqserve.engine.sampling import SamplingParams
from tests.e2e.reference import PROMPTS

ROWS, NEW_TOKENS = 4, 800
SEEDS = (None, 7, None, 8)  # None: greedy


async def _run(loaded, config: Config, formats: tuple = (None,) * ROWS):
    outs: dict[int, tuple[list[int], Done]] = {}
    peak = [0]
    async with open_engine(config, loaded=loaded) as engine:
        execute = engine.runner.execute

        def measured(plan):  # the runner's real allocation after every step
            result = execute(plan)
            peak[0] = max(peak[0], result.kv_bytes)
            return result

        engine.runner.execute = measured

        async def one(k: int) -> None:
            tokens: list[int] = []
            params = SamplingParams(max_tokens=NEW_TOKENS, seed=SEEDS[k],
                                    temperature=0.0 if SEEDS[k] is None else 0.9,
                                    logit_bias={eos: -100 for eos in loaded.eos_token_ids})
            async for event in engine.generate(GenerateRequest(
                    prompt=PROMPTS[k], params=params, response_format=formats[k])):
                if isinstance(event, Token):
                    tokens.append(event.token_id)
                elif isinstance(event, Done):
                    outs[k] = (tokens, event)

        async def watch() -> None:  # rows_queued once a row was preempted, until a row ends
            while not outs:
                got = engine.statistics()
                if got.kv_preemptions:
                    waiting.append(got.rows_queued)
                await trio.sleep(0.001)

        waiting: list[int] = []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch)
            for k in range(ROWS):
                nursery.start_soon(one, k)
        stats = engine.statistics()
    return outs, stats, peak[0], max(waiting, default=0)


async def test_preempted_rows_resume_with_the_tokens_of_a_run_without_budget(draft_model):
    loaded = attrs.evolve(draft_model, eos_token_ids=frozenset())  # every row runs its length
    per_position = kv_bytes_per_position(loaded.model, None)
    # four rows start in 512-position slots; their 768-position slots do not fit, two
    # rows' whole lives (1,024 positions) do, and so does one resuming by prefill alone
    budget = 9 * 256 * per_position
    base = Config(max_batch=ROWS, prefill_chunk=64)
    free, _, _, _ = await _run(loaded, base)
    held, stats, peak, waiting = await _run(loaded, attrs.evolve(
        base, kv_budget_bytes=budget, kv_admission="preempt"))
    assert stats.kv_preemptions >= 1
    assert waiting >= 1  # a preempted row counts in /v1/stats rows_queued meanwhile
    assert stats.prefix_cache is not None and stats.prefix_cache.hits_ram >= stats.kv_preemptions
    assert 0 < peak <= budget
    for k in range(ROWS):
        tokens, done = held[k]
        assert tokens == free[k][0], k
        assert (done.finish_reason, done.completion_tokens, done.cached_tokens) == (
            "length", NEW_TOKENS, 0)
        assert done.prompt_tokens == free[k][1].prompt_tokens
    assert stats.rows_active == 0 and stats.kv_charged_bytes == 0


async def test_without_a_prefix_cache_preempted_rows_prefill_again(draft_model):
    """No snapshot to resume from: a preempted row prefills its prompt and output again.
    Every row with EOS biased away, two under a regex of lines of two kinds in turn (their
    grammar goes on where it stopped): the same tokens as without a budget, the
    allocation within it."""
    per_position = kv_bytes_per_position(draft_model.model, None)
    budget = 9 * 256 * per_position  # as above
    base = Config(max_batch=ROWS, prefill_chunk=64, prefix_cache=False)
    # lines of two kinds in turn: where a row resumes depends on where its grammar was
    regex = {"type": "regex", "pattern": r"(?:[a-z ]{1,40}\n[=() ]{1,40}\n)+"}
    formats = (regex, None, None, regex)
    free, _, _, _ = await _run(draft_model, base, formats)
    held, stats, peak, waiting = await _run(draft_model, attrs.evolve(
        base, kv_budget_bytes=budget, kv_admission="preempt"), formats)
    assert stats.prefix_cache is None and stats.kv_preemptions >= 1 and waiting >= 1
    assert 0 < peak <= budget
    for k in range(ROWS):
        tokens, done = held[k]
        assert tokens == free[k][0], k
        assert (done.finish_reason, done.completion_tokens) == ("length", NEW_TOKENS), k
    for k in (0, 3):  # the grammar's rows stayed within the pattern
        lines = draft_model.tokenizer.decode(held[k][0]).split("\n")
        assert len(lines) > 20, k
        assert all(set(line) <= set("abcdefghijklmnopqrstuvwxyz ") for line in lines[0::2]), k
        assert all(set(line) <= set("=() ") for line in lines[1::2]), k
