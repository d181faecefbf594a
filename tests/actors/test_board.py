"""The board (actors/board.py): the one statistics snapshot every actor posts to, and what
the facade builds from it alone: statistics, the overload gate, shutdown, wait_idle."""

from __future__ import annotations

import attrs
import trio
import trio.testing

from tqserve.actors.board import Board
from tqserve.actors.cache_owner import KvLedger
from tqserve.actors.engine import open_engine
from tqserve.actors.messages import Done, Error, Lease, Queued, Release, Token
from tqserve.engine.config import Config
from tqserve.engine.request import GenerateRequest
from tqserve.engine.sampling import SamplingParams


def request(max_tokens: int = 6, prompt: str = "def f(x):\n") -> GenerateRequest:
    return GenerateRequest(prompt=prompt, params=SamplingParams(max_tokens=max_tokens,
                                                                temperature=0.0))


async def test_wait_until_wakes_on_the_post_that_makes_its_condition_true():
    board = Board()
    ledger = KvLedger()
    woke: list[int] = []

    async def waiter() -> None:
        await board.wait_until(lambda s: s.cache_owner is not None
                               and s.cache_owner.rows_active == 2)
        woke.append(board.snapshot.cache_owner.num_leases)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(waiter)
        for rid, row in (("a", 0), ("b", 1)):
            await trio.testing.wait_all_tasks_blocked()
            assert woke == []
            ledger.apply(Lease(request_id=rid, row_id=row))
            board.post(cache_owner=ledger.statistics())
    assert woke == [2]
    before = board.snapshot
    ledger.apply(Release(request_id="a", row_id=0, reason="stop"))
    board.post(cache_owner=ledger.statistics())
    assert before.cache_owner.rows_active == 2  # a snapshot never changes once taken
    assert board.snapshot.cache_owner.rows_active == 1
    assert attrs.evolve(before, cache_owner=None) != before


async def test_the_facade_reads_only_the_board(draft_model):
    """Statistics after a request agree with each actor's own record; the request's Done
    carries its queue wait; a request refused at the gate is counted; after shutdown's
    StopAdmitting admission's record says so and new requests are refused."""
    config = Config(max_batch=1, max_queued_requests=1)
    async with open_engine(config, loaded=draft_model) as engine:
        events = [e async for e in engine.generate(request())]
        done = events[-1]
        assert isinstance(done, Done) and done.queue_seconds is not None
        assert 0 <= done.queue_seconds < 60
        await engine.wait_idle()
        stats = engine.statistics()
        snap = engine._board.snapshot
        assert stats.steps == snap.scheduler.num_steps > 0
        assert stats.rows_active == snap.cache_owner.rows_active == 0
        assert stats.requests_total == snap.admission.requests_total == 1
        assert snap.cache_owner.releases_by_reason == {"length": 1}
        assert stats.kv_budget_bytes == snap.cache_owner.kv_budget_bytes > 0
        # one row decoding and one queued fill the queue: the next is refused at the gate
        async with trio.open_nursery() as nursery:
            first: list = []
            second: list = []

            async def run(req: GenerateRequest, out: list) -> None:
                async for event in engine.generate(req):
                    out.append(event)

            nursery.start_soon(run, request(max_tokens=200), first)
            await engine._board.wait_until(lambda s: s.cache_owner.rows_active == 1)
            nursery.start_soon(run, request(max_tokens=4, prompt="import os\n"), second)
            await engine._board.wait_until(lambda s: s.admission.num_queued == 1)
            refused = [e async for e in engine.generate(request())]
            assert [type(e) for e in refused] == [Error] and refused[0].code == "overloaded"
            assert refused[0].message == ("queue full: 1 requests queued (max 1, "
                                          "--max-queued-requests)")
            await engine.cancel(first[0].request_id if first else "")
        assert isinstance(second[0], Queued) and isinstance(second[-1], Done)
        assert second[-1].queue_seconds is not None and any(isinstance(e, Token)
                                                            for e in second)
        assert engine.statistics().rejections == {"overloaded": 1}
        engine.stop_admitting()
        await engine._board.wait_until(lambda s: not s.admission.admitting)
        late = [e async for e in engine.generate(request())]
        assert [type(e) for e in late] == [Error] and late[0].code == "shutting_down"
        assert engine.admission_room()[0] == -1
