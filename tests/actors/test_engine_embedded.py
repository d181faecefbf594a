"""The embedded API inside a host's nursery: events, cancellation, admission, no leaks."""

from __future__ import annotations

import pytest
import trio

from tqserve.actors.engine import open_engine
from tqserve.actors.messages import Done, Error, Queued, Token, decode
from tqserve.engine.config import Config
from tqserve.engine.request import GenerateRequest
from tqserve.engine.sampling import SamplingParams
from tqserve.ids import MAX_ID_LENGTH, id_problem


def request(max_tokens=8, prompt="def f(x):\n", **kw):
    return GenerateRequest(prompt=prompt, params=SamplingParams(max_tokens=max_tokens,
                                                                temperature=0.0, **kw))


async def drain(engine, req, out=None, request_id=None):
    events = [] if out is None else out
    async for event in engine.generate(req, request_id):
        events.append(event)
    return events


async def wait_until(predicate, tries=500):
    for _ in range(tries):
        if predicate():
            return True
        await trio.sleep(0.01)
    return predicate()


def count_tasks() -> int:
    def walk(task):
        return 1 + sum(walk(t) for n in task.child_nurseries for t in n.child_tasks)
    return walk(trio.lowlevel.current_root_task())


async def test_events_in_order_next_to_host_tasks(draft_model):
    ticks = 0

    async def host_ticker(stop):
        nonlocal ticks
        while not stop.is_set():
            ticks += 1
            await trio.sleep(0)

    stop = trio.Event()
    async with trio.open_nursery() as host:
        host.start_soon(host_ticker, stop)
        async with open_engine(Config(), loaded=draft_model) as engine:
            events = await drain(engine, request(max_tokens=10), request_id="one")
        stop.set()
    assert isinstance(events[0], Queued) and isinstance(events[-1], Done)
    tokens = [e for e in events if isinstance(e, Token)]
    assert [t.index for t in tokens] == list(range(10))
    assert events[-1].completion_tokens == 10 and events[-1].finish_reason == "length"
    assert all(e.request_id == "one" for e in events)
    assert ticks > 10  # the host's task kept running while MLX worked on the runner thread


async def test_no_leaked_tasks_after_engine_exits(draft_model):
    before = count_tasks()
    async with open_engine(Config(), loaded=draft_model) as engine:
        assert count_tasks() > before
        await drain(engine, request(max_tokens=3))
    assert count_tasks() == before


async def test_caller_scope_cancel_frees_the_row_within_one_step(draft_model):
    async with open_engine(Config(), loaded=draft_model) as engine:
        got = []
        with trio.CancelScope() as scope:
            async for event in engine.generate(request(max_tokens=2000)):
                got.append(event)
                if isinstance(event, Token) and event.index == 3:
                    steps_at_cancel = engine.statistics().steps
                    scope.cancel()
        assert await wait_until(lambda: engine.statistics().kv_bytes == 0)
        stats = engine.statistics()
        assert stats.rows_active == 0 and stats.streams_open == 0
        # one step may be in flight when the cancel lands; the next one releases the row
        assert stats.steps - steps_at_cancel <= 2
        assert not any(isinstance(e, Done) for e in got)


async def test_engine_cancel_by_id_reports_cancelled(draft_model):
    async with open_engine(Config(), loaded=draft_model) as engine:
        events = []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(drain, engine, request(max_tokens=2000), events, "victim")
            assert await wait_until(lambda: any(isinstance(e, Token) for e in events))
            await engine.cancel("victim")
        done = events[-1]
        assert isinstance(done, Done) and done.finish_reason == "cancelled"
        assert 0 < done.completion_tokens < 2000
        assert await wait_until(lambda: engine.statistics().kv_bytes == 0)


async def test_admission_rejects_at_once_when_the_queue_is_full(draft_model):
    config = Config(max_batch=1, max_queued_requests=1, max_queued_tokens=10_000)
    async with open_engine(config, loaded=draft_model) as engine:
        first, second = [], []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(drain, engine, request(max_tokens=30), first, "a")
            assert await wait_until(lambda: any(isinstance(e, Token) for e in first))
            nursery.start_soon(drain, engine, request(max_tokens=5), second, "b")
            assert await wait_until(lambda: engine.statistics().rows_queued == 1)
            rejected = await drain(engine, request(max_tokens=5), request_id="c")
        assert [type(e) for e in rejected] == [Error]
        assert rejected[0].code == "overloaded" and "queue full" in rejected[0].message
        assert isinstance(first[-1], Done) and first[-1].completion_tokens == 30
        assert isinstance(second[-1], Done) and second[-1].completion_tokens == 5
        alone = await drain(engine, request(max_tokens=5))
        assert [e.token_id for e in second if isinstance(e, Token)] == \
            [e.token_id for e in alone if isinstance(e, Token)]
        stats = engine.statistics()
        assert (stats.requests_total, stats.requests_rejected) == (4, 1)
        assert stats.rows_queued == 0


async def test_queued_prompt_tokens_bound(draft_model):
    config = Config(max_batch=1, max_queued_requests=8, max_queued_tokens=12)
    async with open_engine(config, loaded=draft_model) as engine:
        events = []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(drain, engine, request(max_tokens=20), events, "a")
            assert await wait_until(lambda: any(isinstance(e, Token) for e in events))
            long = request(prompt="x = 1\n" * 10, max_tokens=2)
            rejected = await drain(engine, long)
        assert rejected[0].code == "overloaded" and "prompt tokens" in rejected[0].message


@pytest.mark.parametrize("kw,field", [
    ({"prompt_tokens": (9000,)}, "vocabulary"),
    ({"prompt": "x", "params": SamplingParams(max_tokens=5000)}, "max_tokens"),
])
async def test_invalid_requests_become_error_events(draft_model, kw, field):
    async with open_engine(Config(), loaded=draft_model) as engine:
        events = await drain(engine, GenerateRequest(**kw))
        assert [type(e) for e in events] == [Error]
        assert events[0].code == "invalid_request" and field in events[0].message


async def test_duplicate_request_id_is_refused_while_active(draft_model):
    async with open_engine(Config(), loaded=draft_model) as engine:
        first = []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(drain, engine, request(max_tokens=50), first, "same")
            assert await wait_until(lambda: bool(first))
            dup = await drain(engine, request(), request_id="same")
        assert dup[0].code == "invalid_request" and "already in use" in dup[0].message
        assert isinstance(first[-1], Done)


async def test_recorder_sees_every_mailbox_message_as_msgpack(draft_model):
    seen = []
    async with open_engine(Config(), loaded=draft_model,
                           recorder=lambda name, data: seen.append((name, data))) as engine:
        await drain(engine, request(max_tokens=3))
    names = {name for name, _ in seen}
    assert {"admission", "scheduler", "hub", "cache_owner", "admission_replies"} <= names
    kinds = {type(decode(data)).__name__ for _, data in seen}
    assert {"Submit", "Queued", "StepTokens", "Done", "Lease", "Release", "Dequeued"} <= kinds
    steps = [m for m in map(decode, (d for n, d in seen if n == "hub"))
             if type(m).__name__ == "StepTokens"]
    assert [len(s.rows) for s in steps] == [1, 1, 1]  # one message per step, not per token


async def test_untokenizable_prompt_and_bad_ids_are_errors_not_exceptions(draft_model):
    async with open_engine(Config(), loaded=draft_model) as engine:
        bad_prompt = await drain(engine, GenerateRequest(prompt="x\ud800y"))
        assert bad_prompt[0].code == "invalid_request" and "tokenized" in bad_prompt[0].message
        bad_id = await drain(engine, request(), request_id="a\ud800")
        assert bad_id[0].code == "invalid_request" and "request id" in bad_id[0].message
        assert bad_id[0].request_id is None
        for rid in ("x" * (MAX_ID_LENGTH + 1), "tab\there", ""):  # the protocol's one rule
            got = await drain(engine, request(), request_id=rid)
            assert got[0].code == "invalid_request" and got[0].message == f"request {id_problem(rid)}"
        longest = await drain(engine, request(max_tokens=2), request_id="x" * MAX_ID_LENGTH)
        assert isinstance(longest[-1], Done) and longest[-1].request_id == "x" * MAX_ID_LENGTH
        assert [type(e) for e in await drain(engine, request(max_tokens=2))][-1] is Done


LOOPING_PROMPT = "import os\n"  # greedy output loops on imports: no EOS for hundreds of tokens


async def test_break_cancels_at_once_while_the_generation_is_still_referenced(draft_model):
    async with open_engine(Config(), loaded=draft_model) as engine:
        generation = engine.generate(request(max_tokens=2000, prompt=LOOPING_PROMPT), "kept")
        async for event in generation:
            if isinstance(event, Token) and event.index == 2:
                steps_at_break = engine.statistics().steps
                break
        # `generation` is still referenced: nothing was garbage-collected or finalized
        with trio.fail_after(60):  # a hang guard: without the cancel this waits ~2000 steps
            await engine.wait_idle()
        assert engine.statistics().steps - steps_at_break <= 2
        assert engine.statistics().streams_open == 0
        assert generation.request_id == "kept"


@pytest.mark.parametrize("leave", ["break", "scope"])
async def test_a_reused_id_gets_its_own_output_only(draft_model, leave):
    async with open_engine(Config(), loaded=draft_model) as engine:
        reference = await drain(engine, request(max_tokens=6), request_id="ref")
        generation = engine.generate(request(max_tokens=2000, prompt=LOOPING_PROMPT), "x")
        with trio.CancelScope() as scope:
            async for event in generation:
                if isinstance(event, Token) and event.index == 2:
                    if leave == "break":
                        break
                    scope.cancel()
        again = await drain(engine, request(max_tokens=6), request_id="x")
        assert [type(e) for e in again] == [Queued] + [Token] * 6 + [Done], again
        assert all(e.request_id == "x" for e in again)
        assert [e.index for e in again if isinstance(e, Token)] == list(range(6))
        assert [e.token_id for e in again if isinstance(e, Token)] == \
            [e.token_id for e in reference if isinstance(e, Token)]
        assert again[-1].finish_reason == "length" and again[-1].completion_tokens == 6
        await engine.wait_idle()
        assert engine.statistics().streams_open == 0


async def test_shutdown_refuses_new_requests_and_ends_the_running_ones(draft_model):
    async with open_engine(Config(), loaded=draft_model) as engine:
        long, short = [], []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(drain, engine, request(max_tokens=2000, prompt=LOOPING_PROMPT),
                               long, "long")
            assert await wait_until(lambda: any(isinstance(e, Token) for e in long))
            report = await engine.shutdown(timeout=0)
            refused = await drain(engine, request(), request_id="late")
            nursery.start_soon(drain, engine, request(), short, "later")
        assert (report.num_in_flight, report.num_ended) == (1, 1)
        assert isinstance(long[-1], Done) and long[-1].finish_reason == "shutdown"
        assert long[-1].completion_tokens == len([e for e in long if isinstance(e, Token)])
        for events in (refused, short):
            assert [type(e) for e in events] == [Error] and events[0].code == "shutting_down"
        await engine.wait_idle()
        assert engine.statistics().streams_open == 0


def test_admission_control_refuses_everything_after_stop_admitting():
    from tqserve.actors.admission import SHUTTING_DOWN, AdmissionControl

    control = AdmissionControl(max_queued_requests=4, max_queued_tokens=100)
    assert control.try_admit("a", 5) is None
    control.stop_admitting()
    assert control.try_admit("b", 5) == SHUTTING_DOWN
    assert control.statistics().num_queued == 1 and control.requests_rejected == 1


async def test_a_generation_is_iterated_once(draft_model):
    async with open_engine(Config(), loaded=draft_model) as engine:
        generation = engine.generate(request(max_tokens=2))
        assert isinstance([e async for e in generation][-1], Done)
        with pytest.raises(RuntimeError, match="iterated once"):
            [e async for e in generation]


async def test_stop_string_found_by_the_hub_ends_the_request_and_frees_the_row(draft_model):
    tok = draft_model.tokenizer
    async with open_engine(Config(), loaded=draft_model) as engine:
        plain = await drain(engine, request(max_tokens=40))
        text = "".join(e.text for e in plain if isinstance(e, Token))
        stop = text[len(text) // 2: len(text) // 2 + 3]  # greedy: the rerun meets it again
        events = await drain(engine, request(max_tokens=40, stop=[stop]))
        await engine.wait_idle()
        snapshot = engine._board.snapshot  # the actors' own records, as they posted them
        books, hub = snapshot.cache_owner, snapshot.hub
    tokens = [e for e in events if isinstance(e, Token)]
    done = events[-1]
    assert isinstance(done, Done) and done.finish_reason == "stop"
    assert "".join(t.text for t in tokens) == text[:text.index(stop)]
    assert done.completion_tokens == len(tokens) < 40  # what was delivered, no more
    assert [t.token_id for t in tokens] == [e.token_id for e in plain[1:1 + len(tokens)]]
    assert stop in tok.decode([t.token_id for t in tokens])
    # tokens sampled after the stop and before its cancel reached the scheduler: the row
    # ended within a step or two (reply edge hub -> scheduler; straight there, the cancel
    # can land before the next step is planned, and then none is dropped)
    assert hub.num_stopped == 1 and hub.num_dropped <= 3
    assert books.rows_active == 0 and books.releases_by_reason.get("stop") == 1
