"""The sans-io scheduling core, driven synchronously with hand-made step results."""

import pytest

from tqserve.engine.detokenize import TextStream
from tqserve.engine.sampling import SamplingParams
from tqserve.engine.scheduler import (Finished, IllegalTransition, RowOutput, RowState, SchedulerCore,
                              Started, StepResult, TokenOut)

EOS = 0


@pytest.fixture
def core(draft_model):
    tok = draft_model.tokenizer
    return SchedulerCore(max_batch=2, prefill_chunk=4, eos_token_ids=[EOS],
                         make_text_stream=lambda stop: TextStream(tok, stop))


def step(core, tokens=None):
    """One schedule + a result giving each decoding row `tokens[rid]` (default 42)."""
    plan, started = core.schedule()
    tokens = tokens or {}
    outs = tuple(RowOutput(request_id=r, tokens=(tokens.get(r, 42),)) for r in plan.decode)
    return plan, started, core.postprocess(StepResult(outputs=outs, kv_bytes=0))


def test_chunked_prefill_then_join_then_decode(core):
    core.add("a", tuple(range(1, 11)), SamplingParams(max_tokens=3))  # 10 tokens: 9 to prefill
    plan, started, _ = step(core)
    assert [s.request_id for s in started] == ["a"] and started[0].num_prompt_tokens == 10
    assert [(c.start, c.end) for c in plan.prefill] == [(0, 4)] and plan.join == ()
    plan, _, _ = step(core)
    assert [(c.start, c.end) for c in plan.prefill] == [(4, 8)]
    plan, _, events = step(core)
    assert [(c.start, c.end) for c in plan.prefill] == [(8, 9)]
    assert plan.join == ("a",) and plan.decode == ("a",)
    assert [type(e) for e in events] == [TokenOut]
    plan, _, _ = step(core)
    assert plan.decode == ("a",) and plan.prefill == () and plan.join == ()


def test_one_token_prompt_joins_at_once(core):
    core.add("a", (5,), SamplingParams(max_tokens=2))
    plan, _, events = step(core)
    assert plan.prefill == () and plan.join == ("a",)
    assert events[0].index == 0


def test_prefill_budget_is_shared_oldest_first(core):
    core.add("a", tuple(range(1, 4)), SamplingParams())   # 2 to prefill
    core.add("b", tuple(range(1, 8)), SamplingParams())   # 6 to prefill
    plan, _, _ = step(core)
    assert [(c.request_id, c.start, c.end) for c in plan.prefill] == [("a", 0, 2), ("b", 0, 2)]
    assert plan.join == ("a",)


def test_max_batch_bounds_rows_and_queue_waits(core):
    for rid in "abc":
        core.add(rid, (1, 2), SamplingParams(max_tokens=1))
    plan, started, events = step(core)
    assert [s.request_id for s in started] == ["a", "b"]
    assert core.statistics().num_queued == 1
    assert {e.request_id for e in events if isinstance(e, Finished)} == {"a", "b"}
    plan, started, _ = step(core)
    assert set(plan.release) == {"a", "b"}
    assert [s.request_id for s in started] == ["c"]
    assert started[0].row_id in (0, 1)


def test_length_stop_token_and_stop_token_ids(core):
    core.add("len", (1, 2), SamplingParams(max_tokens=2))
    core.add("eos", (1, 2), SamplingParams(max_tokens=9))
    _, _, ev = step(core, {"len": 42, "eos": 42})
    _, _, ev = step(core, {"len": 42, "eos": EOS})
    fin = {e.request_id: e for e in ev if isinstance(e, Finished)}
    assert fin["len"].finish_reason == "length" and fin["len"].completion_tokens == 2
    assert fin["eos"].finish_reason == "stop" and fin["eos"].completion_tokens == 2
    eos_token = [e for e in ev if isinstance(e, TokenOut) and e.request_id == "eos"][0]
    assert eos_token.token_id == EOS and eos_token.text == ""
    core.add("ids", (1, 2), SamplingParams(stop_token_ids=(42,)))
    _, _, ev = step(core, {"ids": 7})
    assert not [e for e in ev if isinstance(e, Finished)]
    _, _, ev = step(core, {"ids": 42})
    assert [e.finish_reason for e in ev if isinstance(e, Finished)] == ["stop"]


def test_stop_string_cuts_text(core, draft_model):
    tok = draft_model.tokenizer
    ids = tok.encode("x = 1\nreturn y")
    core.add("s", (1, 2), SamplingParams(stop=("return",), max_tokens=50))
    texts, reason = [], None
    for t in ids:
        _, _, ev = step(core, {"s": t})
        texts += [e.text for e in ev if isinstance(e, TokenOut)]
        done = [e for e in ev if isinstance(e, Finished)]
        if done:
            reason = done[0].finish_reason
            break
    assert reason == "stop"
    assert "".join(texts) == "x = 1\n"


def test_cancel_in_every_state(core):
    core.add("q1", (1, 2, 3), SamplingParams())
    core.add("q2", (1, 2, 3), SamplingParams())
    core.add("q3", (1, 2, 3), SamplingParams())
    step(core)  # q1, q2 start; q3 queued
    [fin] = core.cancel("q3")
    assert fin.was_queued and fin.row_id is None and fin.finish_reason == "cancelled"
    [fin] = core.cancel("q1")
    assert not fin.was_queued and fin.row_id is not None
    assert core.cancel("q1") == [] and core.cancel("nope") == []
    plan, _, _ = step(core)
    assert plan.release == ("q1",) and "q1" not in plan.decode
    assert core.statistics().num_decoding == 1


def test_duplicate_and_empty_prompt_are_refused(core):
    core.add("a", (1,), SamplingParams())
    with pytest.raises(ValueError, match="duplicate"):
        core.add("a", (1,), SamplingParams())
    with pytest.raises(ValueError, match="at least one token"):
        core.add("b", (), SamplingParams())


def test_fail_all_finishes_everything_and_clears_releases(core):
    core.add("a", (1, 2), SamplingParams())
    core.add("b", (1, 2), SamplingParams())
    core.add("c", (1, 2), SamplingParams())
    step(core)
    events = core.fail_all()
    assert sorted(e.request_id for e in events) == ["a", "b", "c"]
    assert all(e.finish_reason == "error" for e in events)
    assert not core.has_work()


def test_illegal_transition_raises_and_changes_nothing(core):
    from tqserve.engine.scheduler import _Row

    row = _Row("x", (1,), SamplingParams(), TextStream(None))
    with pytest.raises(IllegalTransition):
        row.move(RowState.DECODING)
    assert row.state is RowState.QUEUED


def test_started_events_carry_distinct_rows(core):
    core.add("a", (1,), SamplingParams())
    core.add("b", (1,), SamplingParams())
    _, started, _ = step(core)
    assert all(isinstance(s, Started) for s in started)
    assert sorted(s.row_id for s in started) == [0, 1]
