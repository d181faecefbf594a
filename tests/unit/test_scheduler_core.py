"""The sans-io scheduling core, driven synchronously with hand-made step results."""

import pytest

from tqserve.engine.sampling import SamplingParams
from tqserve.engine.scheduler import IllegalTransition, RowState, SchedulerCore
from tqserve.engine.step import Finished, RowOutput, Started, StepResult, TokenOut

EOS = 0


@pytest.fixture
def core():
    return SchedulerCore(max_batch=2, prefill_chunk=4, eos_token_ids=[EOS])


def step(core, tokens=None):
    """One schedule + a result giving each decoding row `tokens[rid]` (default 42; a tuple
    gives the row several tokens)."""
    plan, started = core.schedule()
    tokens = tokens or {}
    outs = tuple(RowOutput(request_id=r, tokens=_as_tuple(tokens.get(r, 42)))
                 for r in plan.decode)
    return plan, started, core.postprocess(StepResult(outputs=outs, kv_bytes=0))


def _as_tuple(value):
    return value if isinstance(value, tuple) else (value,)


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


def test_rows_started_together_prefill_as_one_group(core):
    core.add("a", tuple(range(1, 4)), SamplingParams())   # 2 to prefill
    core.add("b", tuple(range(1, 8)), SamplingParams())   # 6 to prefill
    plan, _, _ = step(core)
    assert [(n.request_id, n.group) for n in plan.new_rows] == [("a", 1), ("b", 1)]
    # budget max(prefill_chunk, max_batch) = 4 tokens: 2 columns of the 2-row group; the
    # shorter row's prompt comes first and then runs out (its columns are padding)
    assert [(c.request_id, c.start, c.end, c.group, c.columns) for c in plan.prefill] == [
        ("a", 0, 2, 1, 2), ("b", 0, 2, 1, 2)]
    plan, _, _ = step(core)
    assert [(c.request_id, c.start, c.end) for c in plan.prefill] == [("a", 2, 2), ("b", 2, 4)]
    plan, _, _ = step(core)
    assert [(c.request_id, c.start, c.end) for c in plan.prefill] == [("a", 2, 2), ("b", 4, 6)]
    assert plan.join == ("a", "b") and plan.decode == ("a", "b")
    assert core.statistics().num_prefill_tokens == 12 and core.statistics().num_prefill_groups == 0


def test_decoding_rows_take_their_tokens_of_the_budget():
    core = SchedulerCore(max_batch=4, prefill_chunk=64, max_step_tokens=8, eos_token_ids=[EOS])
    core.add("a", (1, 2), SamplingParams(max_tokens=50))
    core.add("b", (1, 2), SamplingParams(max_tokens=50))
    step(core)  # both prefill their one token and join
    core.add("c", tuple(range(1, 40)), SamplingParams())
    plan, _, _ = step(core)
    assert plan.decode == ("a", "b") and [(c.start, c.end) for c in plan.prefill] == [(0, 6)]
    with pytest.raises(ValueError, match="max_step_tokens"):
        SchedulerCore(max_batch=4, prefill_chunk=2, max_step_tokens=3, eos_token_ids=[EOS])


@pytest.mark.parametrize("budget", [512, 2048])
def test_burst_of_unequal_prompts_has_first_tokens_within_the_budgets_steps(budget):
    """16 prompts of 20..245 tokens arrive at once: one group, 244 padded columns of 16
    rows; every row has its first token after ceil(16 * 244 / budget) prefill steps."""
    core = SchedulerCore(max_batch=16, prefill_chunk=512, max_step_tokens=budget,
                         eos_token_ids=[EOS])
    lengths = [20 + (i * 97) % 226 for i in range(16)]
    for i, n in enumerate(lengths):
        core.add(f"r{i}", tuple(range(1, n + 1)), SamplingParams(max_tokens=4))
    firsts, steps = set(), 0
    while len(firsts) < 16:
        plan, _, events = step(core)
        steps += 1
        assert sum(c.columns for c in plan.prefill) <= budget
        firsts |= {e.request_id for e in events if isinstance(e, TokenOut)}
    width = max(lengths) - 1
    assert steps == -(-16 * width // budget) == core.statistics().num_steps
    assert core.statistics().num_prefill_tokens == 16 * width


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
    assert eos_token.token_ids == (EOS,) and eos_token.stop_token and eos_token.final
    core.add("ids", (1, 2), SamplingParams(stop_token_ids=(42,)))
    _, _, ev = step(core, {"ids": 7})
    assert not [e for e in ev if isinstance(e, Finished)]
    _, _, ev = step(core, {"ids": 42})
    assert [e.finish_reason for e in ev if isinstance(e, Finished)] == ["stop"]


def test_several_tokens_per_row_are_cut_at_stop_token_and_max_tokens(core):
    core.add("eos", (1, 2), SamplingParams(max_tokens=9, logprobs=True))
    core.add("len", (1, 2), SamplingParams(max_tokens=4))
    step(core, {"eos": 5, "len": 5})  # both join with their first token
    core.schedule()
    outs = (RowOutput(request_id="eos", tokens=(6, EOS, 8), logprobs=(-1.0, -2.0, -3.0),
                      top_logprobs=(((6, -1.0),), ((EOS, -2.0),), ((8, -3.0),))),
            RowOutput(request_id="len", tokens=(6, 7, 8, 9)))
    ev = core.postprocess(StepResult(outputs=outs, kv_bytes=0))
    out = {e.request_id: e for e in ev if isinstance(e, TokenOut)}
    fin = {e.request_id: e for e in ev if isinstance(e, Finished)}
    assert out["eos"].index == 1 and out["eos"].token_ids == (6, EOS)
    assert out["eos"].logprobs == (-1.0, -2.0) and len(out["eos"].top_logprobs) == 2
    assert out["eos"].final and out["eos"].stop_token
    assert out["len"].token_ids == (6, 7, 8) and out["len"].final and not out["len"].stop_token
    assert fin["eos"].finish_reason == "stop" and fin["eos"].completion_tokens == 3
    assert fin["eos"].tokens == (1, 2, 5, 6, EOS)
    assert fin["len"].finish_reason == "length" and fin["len"].completion_tokens == 4


def test_grammar_done_on_the_last_token_wins_over_length(core):
    core.add("g", (1, 2), SamplingParams(max_tokens=1))
    core.schedule()
    [out, fin] = core.postprocess(StepResult(
        outputs=(RowOutput(request_id="g", tokens=(5,), grammar_done=True),), kv_bytes=0))
    assert out.final and fin.finish_reason == "stop"


def test_stop_cancel_counts_the_delivered_tokens(core):
    core.add("s", (1, 2), SamplingParams(max_tokens=50))
    for t in (5, 6, 7, 8):
        step(core, {"s": t})
    [fin] = core.cancel("s", "stop", num_tokens=2)
    assert fin.finish_reason == "stop" and fin.completion_tokens == 2
    assert fin.tokens == (1, 2, 5, 6)


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
    from tqserve.engine.scheduler import Row

    row = Row("x", (1,), SamplingParams())
    with pytest.raises(IllegalTransition):
        row.move(RowState.DECODING)
    assert row.state is RowState.QUEUED


def test_started_events_carry_distinct_rows(core):
    core.add("a", (1,), SamplingParams())
    core.add("b", (1,), SamplingParams())
    _, started, _ = step(core)
    assert all(isinstance(s, Started) for s in started)
    assert sorted(s.row_id for s in started) == [0, 1]


def test_release_carries_the_tokens_of_rows_that_finished_normally(core):
    core.add("len", (1, 2), SamplingParams(max_tokens=2))
    core.add("gone", (1, 2), SamplingParams(max_tokens=9))
    step(core, {"len": 5, "gone": 5})
    step(core, {"len": 6, "gone": 6})
    core.cancel("gone")
    plan, _ = core.schedule()
    released = dict(zip(plan.release, plan.release_tokens))
    assert released == {"len": (1, 2, 5, 6), "gone": ()}  # a cancelled row's KV is not kept
    core.add("c", (3, 4), SamplingParams())
    assert core.prompt("c") == (3, 4)


def test_preemption_gives_back_the_longest_row_and_resumes_it_where_it_stopped():
    """--kv-admission preempt (engine.kv_budget): rows are charged what they hold plus one
    slot step; when the next step would not fit, the longest decoding row is released
    with its tokens and waits at the queue's head as prompt + output; it starts again as
    a resumed row (NewRow.resumed, here from its snapshot as the prefix cache would give
    it), and its finish counts its own prompt and all its output. The last running row
    is never preempted."""
    from tqserve.engine.kv_budget import KvBudget
    from tqserve.engine.step import Preempted

    # 1 byte per position: two rows start (2 x 512-position slots + their prefill group);
    # two rows of 1024-position slots do not fit
    budget = KvBudget(budget_bytes=1536, bytes_per_position=1, preempt=True)
    core = SchedulerCore(max_batch=2, prefill_chunk=64, eos_token_ids=[EOS], kv_budget=budget)
    core.add("long", (5,) * 100, SamplingParams(max_tokens=900))
    core.add("short", (6,) * 3, SamplingParams(max_tokens=900))

    def run(capacity, tokens=None):
        plan, events = core.schedule()
        outs = tuple(RowOutput(request_id=r, tokens=(tokens or {}).get(r, (42,)))
                     for r in plan.decode)
        return plan, events, core.postprocess(StepResult(outputs=outs, kv_bytes=0,
                                                         kv_capacity=capacity))

    plan, events, _ = run((0, 0))
    assert {e.request_id for e in events if isinstance(e, Started)} == {"long", "short"}
    preempted: list = []
    for _ in range(20):
        plan, events, _ = run((2, 768), {"long": (7,) * 100})
        preempted = [e for e in events if isinstance(e, Preempted)]
        if preempted:
            break
    assert [e.request_id for e in preempted] == ["long"] and plan.decode == ("short",)
    kept = plan.release_tokens[plan.release.index("long")]  # its KV: prompt + output so far
    assert kept[:100] == (5,) * 100 and set(kept[100:]) <= {7, 42} and len(kept) > 766
    stats = core.statistics()
    assert (stats.num_preemptions, stats.num_queued, stats.num_decoding) == (1, 1, 1)
    assert stats.num_preempted_queued == 1  # /v1/stats counts it as waiting
    assert core.next_to_start() == [("long", kept)]  # looked up at once, as prompt + output
    core.set_reuse("long", reuse="snap", cached=len(kept) - 1)  # the prefix cache's answer
    plan, events, _ = run((2, 768))
    assert plan.new_rows == () and plan.decode == ("short",)  # it waits for room
    core.cancel("short")
    # the step of its release: beside the store as reported (2 x 768 positions), "long"
    # fits (it has nothing to prefill, so no prefill group of its own)
    plan, events, _ = run((0, 0))
    started = [e for e in events if isinstance(e, Started)]
    assert [(e.request_id, e.resumed, e.num_prompt_tokens) for e in started] == [
        ("long", True, 100)]
    assert core.statistics().num_preempted_queued == 0
    new = plan.new_rows[0]
    assert (new.prompt, new.resumed, new.reuse, new.cached) == (
        kept, len(kept) - 100, "snap", len(kept) - 1)
    done: list = []
    while core.has_work():  # alone: never preempted
        plan, events, out = run((1, 1024))
        assert not any(isinstance(e, Preempted) for e in events)
        done += out
    finished = [e for e in done if isinstance(e, Finished)][0]
    assert (finished.prompt_tokens, finished.completion_tokens, finished.preemptions,
            finished.cached_tokens) == (100, 900, 1, 0)
    assert finished.tokens[:len(kept)] == kept and len(finished.tokens) == 1000


def test_preemption_counts_the_empty_slots_a_growth_leaves_behind():
    """A row cancelled while it prefills leaves the decode batch's slot store 8 row slots
    for 2 rows. When those outgrow its positions, the growth keeps 2 slots
    (kv_budget.grown): 2 x 768 positions fit the budget, so no row is preempted (8 x 768
    would not fit: before the growth rule, b was preempted here)."""
    from tqserve.engine.kv_budget import KvBudget
    from tqserve.engine.step import Preempted

    budget = KvBudget(budget_bytes=4096, bytes_per_position=1, preempt=True)
    core = SchedulerCore(max_batch=3, prefill_chunk=64, eos_token_ids=[EOS], kv_budget=budget)
    held = {"a": 3, "b": 3}
    for rid in held:
        core.add(rid, (5,) * 3, SamplingParams(max_tokens=2000))

    def run(capacity, give):
        plan, events = core.schedule()
        outs = tuple(RowOutput(request_id=r, tokens=(42,) * give) for r in plan.decode)
        for event in core.postprocess(StepResult(outputs=outs, kv_bytes=0,
                                                 kv_capacity=capacity)):
            if isinstance(event, TokenOut):
                held[event.request_id] += len(event.token_ids)
        return plan, events

    while min(held.values()) < 400:
        run((2, 512), 100)
    assert held["a"] == held["b"]
    core.add("c", (6,) * 200, SamplingParams(max_tokens=10))
    plan, events = run((8, 512), 513 - held["a"])  # "c" starts; a and b reach 513
    assert [e.request_id for e in events if isinstance(e, Started)] == ["c"]
    assert held == {"a": 513, "b": 513}
    core.cancel("c")  # released while prefilling: the store keeps its 8 row slots
    plan, events = run((8, 512), 1)
    assert not [e for e in events if isinstance(e, Preempted)]
    assert "c" in plan.release and plan.decode == ("a", "b")
    assert core.kv_charge(growth=2) == 8 * 512  # the store now; 2 x 768 after the growth
