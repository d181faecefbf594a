"""The embedded engine under hostile load: a huge prompt never stalls other streams, and
every refusal is counted in the statistics."""

from __future__ import annotations

from collections import Counter

import trio

from tqserve.actors.engine import ADMISSION_MAILBOX, open_engine
from tqserve.actors.messages import Done, Error, Token
from tqserve.engine.config import Config
from tqserve.engine.request import GenerateRequest
from tqserve.engine.sampling import SamplingParams

LONG_PROMPT = "import os\n"
HUGE_CHARS = 250_000  # under --max-prompt-chars; tokenizing it takes a noticeable while


async def test_a_huge_prompt_is_tokenized_while_other_streams_go_on(draft_model):
    async with open_engine(Config(), loaded=draft_model) as engine:
        victim_tokens = 0
        victim_started = trio.Event()

        async def victim() -> None:
            nonlocal victim_tokens
            req = GenerateRequest(prompt=LONG_PROMPT,
                                  params=SamplingParams(max_tokens=3000, temperature=0.0))
            async for event in engine.generate(req):
                if isinstance(event, Token):
                    victim_tokens += 1
                    victim_started.set()

        huge = GenerateRequest(prompt=("x = 1\n" * (HUGE_CHARS // 6))[:HUGE_CHARS],
                               params=SamplingParams(max_tokens=1, temperature=0.0))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(victim)
            await victim_started.wait()
            before = victim_tokens
            events = [event async for event in engine.generate(huge)]
            during = victim_tokens - before
            nursery.cancel_scope.cancel()
        # the prompt tokenized on a worker thread: the victim kept decoding meanwhile
        assert during > 0
        assert isinstance(events[-1], (Done, Error)), events[-1]
        await engine.wait_idle()


async def test_every_refusal_is_counted(draft_model):
    n = ADMISSION_MAILBOX + 40
    config = Config(max_queued_requests=n, max_batch=1)
    async with open_engine(config, loaded=draft_model) as engine:
        ends: list[Error | Done] = []

        async def one(i: int) -> None:
            req = GenerateRequest(prompt=f"def f{i}():",
                                  params=SamplingParams(max_tokens=1, temperature=0.0))
            async for event in engine.generate(req, f"r{i}"):
                if isinstance(event, (Done, Error)):
                    ends.append(event)

        async with trio.open_nursery() as nursery:
            for i in range(n):  # all submit before admission runs once: its mailbox fills
                nursery.start_soon(one, i)
        bad = GenerateRequest(prompt="x", params=SamplingParams(stop_token_ids=(10**6,)))
        ends.extend([e async for e in engine.generate(bad)])
        codes = Counter(e.code if isinstance(e, Error) else "done" for e in ends)
        assert codes["overloaded"] > 0 and codes["invalid_request"] == 1, codes
        stats = engine.statistics()
        assert stats.requests_total == n + 1
        assert stats.requests_rejected == codes["overloaded"] + 1
        assert stats.rejections == {"invalid_request": 1, "overloaded": codes["overloaded"]}
        await engine.wait_idle()


async def test_a_full_queue_refuses_before_tokenizing(draft_model, monkeypatch):
    """Overload is answered from admission's books, O(1), before the prompt is tokenized
    (issue 20 #8: a burst was refused in 1.4 s at the median, each refusal paying for its
    tokenizing first). Requests beyond the bound never reach the tokenizer."""
    import trio

    from tqserve.actors.engine import open_engine
    from tqserve.actors.messages import Error, Token
    from tqserve.engine.config import Config
    from tqserve.engine.request import GenerateRequest
    from tqserve.engine.sampling import SamplingParams

    config = Config(max_batch=1, max_queued_requests=2, prefix_cache=False)
    async with open_engine(config, loaded=draft_model) as engine:
        started = trio.Event()
        codes: list[str] = []

        async def run(prompt: str, k: int) -> None:
            req = GenerateRequest(prompt=prompt, params=SamplingParams(max_tokens=2000,
                                                                       temperature=0))
            async for event in engine.generate(req, f"r{k}"):
                if isinstance(event, Token):
                    started.set()
                if isinstance(event, Error):
                    codes.append(event.code)
                    return

        async with trio.open_nursery() as nursery:
            nursery.start_soon(run, "import os\n", 0)
            await started.wait()
            for k in (1, 2):
                nursery.start_soon(run, "import sys\n", k)
            await wait_queued(engine, 2)
            calls = []
            monkeypatch.setattr(GenerateRequest, "token_ids",
                                lambda self, tok: calls.append(1) or (1, 2, 3))
            for k in range(3, 23):
                await run("x = 1\n", k)
            assert codes == ["overloaded"] * 20 and calls == []
            stats = engine.statistics()
            assert stats.rejections["overloaded"] == 20 and stats.rows_queued == 2
            nursery.cancel_scope.cancel()


async def wait_queued(engine, n: int) -> None:
    import trio

    while engine.statistics().rows_queued < n:
        await trio.sleep(0.01)
