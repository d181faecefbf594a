"""The speculation actor over real mailboxes (msgpack bytes): it books each SpecStep and
answers with the next proposal sizes; the scheduler's end (SpeculationLink) hands the
decision for the last step reported to the core as advice (engine.orders decides each
row's k from it), and releases a row's books when the row ends."""

from __future__ import annotations

import attrs
import pytest
import trio
import trio.testing

from tqserve.actors.board import Board
from tqserve.actors.mailbox import open_mailbox
from tqserve.actors.messages import RowVerified, SpecDecision, SpecOpen, SpecStep
from tqserve.actors.speculation import (SPECULATION_MAILBOX, SpeculationLink,
                                        reply_mailbox_size, run_speculation)
from tqserve.engine.sampling import SamplingParams
from tqserve.engine.orders import proposal_drafts, propose_sizes
from tqserve.engine.step import NO_ADVICE, NewRow, RowOutput, StepPlan, StepResult
from tqserve.engine.speculative.lookup import LookupBook, LookupSettings
from tqserve.engine.speculative.policy import SpecChoice, SpecPolicy, SpeculationPolicy
from tqserve.engine.speculative.throughput import ThroughputSettings

DEFAULT = SpecChoice(method="draft", num_tokens=3)


async def _start(nursery, policy):
    spec_out, spec_in = open_mailbox(SPECULATION_MAILBOX, "speculation")
    replies_out, replies_in = open_mailbox(reply_mailbox_size(), "speculation_replies")
    await nursery.start(run_speculation, policy, DEFAULT, spec_in, replies_out, Board())
    return SpeculationLink(outbox=spec_out, replies=replies_in)


async def test_books_rows_and_answers_each_step(nursery):
    policy = SpeculationPolicy(SpecPolicy(backoff_threshold=0.5, backoff_steps=2,
                                          ema_weight=1.0, time_policy=False))
    link = await _start(nursery, policy)
    await link.outbox.send(SpecStep(step=0, opened=(
        SpecOpen(request_id="a"), SpecOpen(request_id="b", choice=False),
        SpecOpen(request_id="c", choice=SpecChoice(method="lookup", num_tokens=5)))))
    assert await link.replies.receive() == SpecDecision(step=0, proposals=(("a", 3), ("c", 5)))
    assert policy.statistics().num_rows == 3
    # c proposed 5, the target kept 1: below the threshold, it backs off for two steps
    await link.outbox.send(SpecStep(step=1, verified=(
        RowVerified(request_id="a", num_proposed=3, num_accepted=3),
        RowVerified(request_id="c", num_proposed=5, num_accepted=1)), batch=("a", "b", "c")))
    assert (await link.replies.receive()).proposals == (("a", 3),)
    await link.outbox.send(SpecStep(step=2, released=("a",), batch=("b", "c")))
    assert (await link.replies.receive()).proposals == ()
    await link.outbox.send(SpecStep(step=3, batch=("b", "c")))
    assert (await link.replies.receive()).proposals == (("c", 5),)
    stats = policy.statistics()
    assert (stats.num_rows, stats.num_proposed, stats.num_accepted, stats.num_backoffs) == (
        2, 8, 4, 1)


async def test_an_unexpected_message_is_a_loud_bug():
    spec_out, spec_in = open_mailbox(SPECULATION_MAILBOX, "speculation")
    replies_out, _ = open_mailbox(reply_mailbox_size(), "speculation_replies")
    await spec_out.send(SpecDecision(step=9))  # a reply, sent the wrong way
    with pytest.raises(TypeError, match="speculation got unexpected SpecDecision"):
        await run_speculation(SpeculationPolicy(), DEFAULT, spec_in, replies_out, Board())


def _plan(decode, new=(), release=()):
    return StepPlan(decode=tuple(decode), release=tuple(release), new_rows=tuple(
        NewRow(request_id=r, row_id=i, prompt=(1, 2), params=SamplingParams())
        for i, r in enumerate(new)))


async def _apply(link, plan):
    """What the scheduler actor does around the core: advice in, proposals decided by
    engine.orders (every row's own k is DEFAULT's)."""
    advice = await link.advise(NO_ADVICE)
    joined = frozenset(new.request_id for new in plan.new_rows)
    plan = attrs.evolve(plan, propose=propose_sizes(advice, plan.decode, joined,
                                                    lambda rid: DEFAULT.num_tokens))
    return plan


async def test_link_applies_the_latest_decision_and_releases_ended_rows(nursery):
    # the time policy decides per bucket: B1 speculation 2x faster, B2 3x slower
    policy = SpeculationPolicy(SpecPolicy(throughput=ThroughputSettings(min_samples=1)))
    link = await _start(nursery, policy)
    plan = await _apply(link, _plan(["a"], new=["a"]))
    assert plan.propose == (("a", 3),)  # no decision yet: its own k, nothing waits
    await link.report(plan, StepResult(outputs=(), kv_bytes=0), ["a"], {"a"})
    await trio.testing.wait_all_tasks_blocked()
    assert (await _apply(link, _plan(["a"]))).propose == (("a", 3),)  # learning: speculative first

    def result(n, seconds, spec):
        out = RowOutput(request_id="a", tokens=(1,) * n, num_proposed=3 if spec else 0,
                        num_accepted=n - 1 if spec else 0)
        return StepResult(outputs=(out,), kv_bytes=0, decode_seconds=seconds,
                          speculative=spec)

    await link.report(_plan(["a"]), result(4, 0.02, True), ["a"], {"a"})   # 200 tok/s
    await link.report(_plan(["a"]), result(1, 0.01, False), ["a"], {"a"})  # 100 tok/s
    await trio.testing.wait_all_tasks_blocked()
    assert (await _apply(link, _plan(["a"]))).propose == (("a", 3),)
    assert [(b.bucket, b.mode) for b in policy.statistics().buckets] == [(0, "speculative")]
    # many steps reported without the scheduler reading in between: the reply mailbox
    # never fills (the link reads every waiting decision before each send)
    for _ in range(5 * reply_mailbox_size()):
        await link.report(_plan(["a"]), result(4, 0.02, True), ["a"], {"a"})
    # the row ends: its books go with the next report
    await link.report(_plan([]), StepResult(outputs=(), kv_bytes=0), [], set())
    await trio.testing.wait_all_tasks_blocked()
    assert (await _apply(link, _plan([]))).propose == () and policy.statistics().num_rows == 0
    assert link.num_decisions == link.num_steps == 4 + 5 * reply_mailbox_size()


async def test_new_rows_propose_their_own_k_only_where_the_batch_allows(nursery):
    policy = SpeculationPolicy(SpecPolicy(max_batch=2, time_policy=False))
    link = await _start(nursery, policy)
    plan = await _apply(link, _plan(["a", "b"], new=["a", "b"]))
    assert plan.propose == (("a", 3), ("b", 3))
    await link.report(plan, StepResult(outputs=(), kv_bytes=0), ["a", "b"], {"a", "b"})
    await trio.testing.wait_all_tasks_blocked()
    # a third row joins: the last decision (batch 2) let new rows propose, so it does
    plan = await _apply(link, _plan(["a", "b", "c"], new=["c"]))
    assert plan.propose == (("a", 3), ("b", 3), ("c", 3))
    await link.report(plan, StepResult(outputs=(), kv_bytes=0), ["a", "b", "c"],
                      {"a", "b", "c"})
    await trio.testing.wait_all_tasks_blocked()
    # batch 3 is over the cap: nobody proposes, and a row opened now waits for a decision
    plan = await _apply(link, _plan(["a", "b", "c", "d"], new=["d"]))
    assert plan.propose == () and link.new_rows is False
    await link.report(plan, StepResult(outputs=(), kv_bytes=0), ["b"], {"b", "d"})
    await trio.testing.wait_all_tasks_blocked()
    assert (await _apply(link, _plan(["b", "d"]))).propose == (("b", 3), ("d", 3))
    assert policy.statistics().num_rows == 2 and link.open_rows == {"b", "d"}


async def test_lookup_rows_are_proposed_here_from_their_prompt_and_tokens(nursery):
    """Lookup proposals are made by the actor (engine.speculative.lookup), off the runner
    thread: the link sends a lookup row's prompt when it opens and its tokens each step;
    the decision carries each lookup row's proposal with the context length it answers,
    and the core passes the proposing rows' ones on in the plan."""
    policy = SpeculationPolicy(SpecPolicy(time_policy=False))
    spec_out, spec_in = open_mailbox(SPECULATION_MAILBOX, "speculation")
    replies_out, replies_in = open_mailbox(reply_mailbox_size(), "speculation_replies")
    lookup = SpecChoice(method="lookup", num_tokens=2)
    await nursery.start(run_speculation, policy, lookup, spec_in, replies_out, Board(),
                        LookupBook(LookupSettings(max_ngram=2)))
    link = SpeculationLink(outbox=spec_out, replies=replies_in, lookup=True, default=lookup)
    prompts = {"a": (5, 6, 7, 5, 6, 9, 5), "b": (1, 2, 3), "d": (4, 4, 4)}
    plan = StepPlan(decode=("a", "b", "d"), new_rows=(
        NewRow(request_id="a", row_id=0, prompt=prompts["a"], params=SamplingParams()),
        NewRow(request_id="b", row_id=1, prompt=prompts["b"], params=SamplingParams(),
               speculative=DEFAULT),  # a draft-model row: not indexed here
        NewRow(request_id="d", row_id=2, prompt=prompts["d"], params=SamplingParams(),
               speculative=False)))
    sent = []
    real_send = link.outbox.send

    async def spy(msg):
        sent.append(msg)
        await real_send(msg)

    link.outbox.send = spy
    outputs = tuple(RowOutput(request_id=r, tokens=(6,)) for r in ("a", "b", "d"))
    await link.report(plan, StepResult(outputs=outputs, kv_bytes=0), ["a", "b", "d"],
                      {"a", "b", "d"})
    assert [(o.request_id, o.context) for o in sent[0].opened] == [
        ("a", prompts["a"]), ("b", ()), ("d", ())]
    assert sent[0].emitted == (("a", (6,)),) and link.lookup_rows == {"a"}
    advice = await link.advise(NO_ADVICE)
    # a's context 5 6 7 5 6 9 5 6: its tail "5 6" last followed at 3 -> 9 5
    assert advice.drafts == (("a", 8, (9, 5)),)
    assert dict(advice.proposals) == {"a": 2, "b": 3}
    propose = propose_sizes(advice, ("a", "b"), frozenset(), lambda rid: 0)
    assert proposal_drafts(advice, propose) == (("a", 8, (9, 5)),)
    assert proposal_drafts(advice, (("b", 3),)) == ()
    # the row ends: its index goes with its books
    await link.report(_plan([]), StepResult(outputs=(), kv_bytes=0), [], set())
    assert (await link.advise(NO_ADVICE)).drafts == () and link.lookup_rows == set()
