"""One decider: the sans-io core makes the whole plan from the actors' StepAdvice
(engine.orders): snapshot orders and their keys, persist, spill and drop, and each row's
proposal size. Driven synchronously with hand-made step results."""

from tqserve.engine.sampling import SamplingParams
from tqserve.engine.scheduler import SchedulerCore
from tqserve.engine.speculative.policy import SpecChoice
from tqserve.engine.step import NO_ADVICE, RowOutput, StepAdvice, StepResult

EOS = 0
PREFIX = StepAdvice(prefix_cache=True, write_through=True)


def _step(core, advice, tokens=None):
    plan, _ = core.schedule(advice)
    outs = tuple(RowOutput(request_id=r, tokens=((tokens or {}).get(r, 42),))
                 for r in plan.decode)
    core.postprocess(StepResult(outputs=outs, kv_bytes=0))
    return plan


def test_prefix_orders_are_the_cores_with_keys_of_its_own():
    core = SchedulerCore(max_batch=2, prefill_chunk=8, eos_token_ids=[EOS])
    core.add("a", (1, 2, 3), SamplingParams(max_tokens=1))
    core.set_reuse("a")  # looked up, nothing cached: its prompt is snapshotted at its join
    core.add("b", (1, 2, 3), SamplingParams(max_tokens=1))
    core.set_reuse("b", snapshot_prompt=False)  # the cache has its prompt already
    plan = _step(core, PREFIX)
    assert plan.join == ("a", "b") and plan.prompt_snapshot == (("a", "p0"),)
    assert plan.persist and plan.snapshot == ()
    # both finished (max_tokens 1): released next step, each snapshotted under a new key
    plan = _step(core, PREFIX)
    assert plan.release == ("a", "b")
    assert plan.snapshot == (("a", "r1"), ("b", "r2")) and plan.persist
    assert plan.release_tokens == ((1, 2, 3, 42), (1, 2, 3, 42))
    # spill and drop orders go in as advised, without snapshots persist stays off
    plan = _step(core, StepAdvice(prefix_cache=True, write_through=True, spill=("r1",),
                                  drop=("p0",)))
    assert (plan.spill, plan.drop, plan.snapshot, plan.persist) == (("r1",), ("p0",), (), False)


def test_without_a_prefix_cache_no_snapshot_is_ordered():
    core = SchedulerCore(max_batch=2, prefill_chunk=8, eos_token_ids=[EOS])
    core.add("a", (1, 2, 3), SamplingParams(max_tokens=1))
    plan = _step(core, NO_ADVICE)
    assert plan.join == ("a",) and plan.prompt_snapshot == () and not plan.persist
    plan = _step(core, NO_ADVICE)
    assert plan.release == ("a",) and plan.snapshot == ()


def test_proposals_follow_the_decision_and_joining_rows_their_own_k():
    core = SchedulerCore(max_batch=5, prefill_chunk=8, eos_token_ids=[EOS],
                         speculative_methods=("lookup",),
                         speculative_default=SpecChoice(method="lookup", num_tokens=3))
    core.add("a", (5,), SamplingParams(max_tokens=20))
    core.add("b", (5,), SamplingParams(max_tokens=20), speculative=False)
    core.add("c", (5,), SamplingParams(max_tokens=20),
             speculative=SpecChoice(method="lookup", num_tokens=6))
    # no decision yet: the rows joining in this plan propose their own k (b: never)
    plan = _step(core, StepAdvice(speculation=True))
    assert plan.decode == ("a", "b", "c") and plan.propose == (("a", 3), ("c", 6))
    # the decision for that step knows them: its sizes (a row it does not name: none)
    advice = StepAdvice(speculation=True, proposals=(("a", 2),))
    assert _step(core, advice).propose == (("a", 2),)
    # a row joining now proposes its own k, unless the decision forbids new rows
    core.add("d", (5,), SamplingParams(max_tokens=20))
    advice = StepAdvice(speculation=True, proposals=(("a", 1), ("c", 4)),
                        new_rows_propose=False)
    assert _step(core, advice).propose == (("a", 1), ("c", 4))
    core.add("e", (5,), SamplingParams(max_tokens=20))
    advice = StepAdvice(speculation=True, proposals=(("a", 1), ("d", 2)))
    assert _step(core, advice).propose == (("a", 1), ("d", 2), ("e", 3))
    assert _step(core, NO_ADVICE).propose == ()  # without speculation nobody proposes
