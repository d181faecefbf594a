"""Speculation actor: the per-row speculation books, one decision per engine step.

Owns: a SpeculationPolicy (engine.speculative.policy: per row the method, k, acceptance
      average and back-off; per batch-size bucket the time policy of
      engine.speculative.throughput) and the server's default choice.
Receives: SpecStep from the scheduler (SPECULATION_MAILBOX), one per engine step: rows
      opened and released, verified lengths per row, the step's measured duration.
Posts: its SpeculationStatistics to the board (actors.board) after each SpecStep.
Sends: one SpecDecision per SpecStep to the scheduler on the reply edge
      (speculation_replies): tokens each open row proposes from the next step planned.
      It answers at once (booking a step takes microseconds, on the scheduler's own trio
      thread), so the decision for step N is ready when step N+1 is planned: the
      scheduler takes it before it plans (`SpeculationLink.advise`) and the core decides
      each row's k from it (engine.orders). A decision knows every row opened up to its
      step, so no lag needs booking: only rows the plan itself opens are new to it. The
      reply mailbox holds one decision per SpecStep that can be in flight (the scheduler
      reads every waiting decision before it sends the next SpecStep), so `send_nowait`
      never fails and this actor never blocks on the scheduler.
Prompt lookup is proposed here, off the runner thread: a `LookupBook`
(engine.speculative.lookup) keeps an n-gram index of every lookup row's context (its
prompt comes with its SpecOpen, each step's tokens with the SpecStep), and a decision
carries each lookup row's proposal for the next step with the context length it answers
(`drafts`). The runner takes a draft only for a row whose context is that long; it looks
up itself only where no draft fits (a row's first decode step, before any decision names
it). The proposers' MLX state (draft caches, MTP-head caches and hidden states) stays on
the runner thread keyed by request id; the runner opens and closes it with the rows.
`SpeculationLink` is the scheduler's end of the two edges.
"""

from __future__ import annotations

from typing import Collection, Sequence

import attrs
import trio

from tqserve.actors.board import Board
from tqserve.actors.mailbox import Inbox, Outbox
from tqserve.actors.messages import RowVerified, SpecDecision, SpecOpen, SpecStep
from tqserve.engine.step import StepAdvice, StepPlan, StepResult
from tqserve.engine.speculative.lookup import Draft, LookupBook
from tqserve.engine.speculative.policy import SpecChoice, SpeculationPolicy, resolve_choice

SPECULATION_MAILBOX = 4  # a few steps' reports; booking one takes microseconds


def reply_mailbox_size(speculation_mailbox: int = SPECULATION_MAILBOX) -> int:
    """Decisions that can wait for the scheduler, which reads them all before each send:
    one per SpecStep that can be answered before its next read (those in the speculation
    mailbox, the one being answered, and the one its send waited to put in)."""
    return speculation_mailbox + 2


def decide_step(policy: SpeculationPolicy, default: SpecChoice | None,
                msg: SpecStep, book: LookupBook | None = None) -> SpecDecision:
    """Book one step (sync, no I/O) and decide every open row's next proposal size, and
    each lookup row's proposal (with `book`)."""
    for opened in msg.opened:
        policy.open_row(opened.request_id, resolve_choice(opened.choice, default))
        if book is not None and opened.context:  # the link sends a lookup row's prompt
            book.open(opened.request_id, opened.context)
    for rid in msg.released:
        policy.close_row(rid)
        if book is not None:
            book.close(rid)
    if book is not None:
        for rid, tokens in msg.emitted:
            book.extend(rid, tokens)
    policy.absorb([(v.request_id, v.num_proposed, v.num_accepted) for v in msg.verified],
                  msg.num_rows, msg.speculative, msg.num_tokens, msg.decode_seconds)
    rows = policy.row_ids()
    # rows about to decode (still prefilling) count towards the batch they will join
    batch_size = len(msg.batch) or len(rows)
    decided = tuple((rid, k) for rid, k in policy.decide(rows, batch_size).items() if k > 0)
    return SpecDecision(step=msg.step, proposals=decided, new_rows=policy.allows(batch_size),
                        drafts=book.drafts(decided) if book is not None else ())


async def run_speculation(policy: SpeculationPolicy, default: SpecChoice | None,
                          inbox: Inbox, replies: Outbox, board: Board,
                          book: LookupBook | None = None,
                          task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                          ) -> None:
    """Answer each SpecStep with a SpecDecision until the scheduler closes the edge; post
    the books' statistics to the board after each. `book`: the lookup rows' indexes
    (None: this server does not serve lookup)."""
    board.post(speculation=policy.statistics())
    task_status.started()
    async with replies:
        async for msg in inbox:
            match msg:
                case SpecStep():
                    replies.send_nowait(decide_step(policy, default, msg, book))
                    board.post(speculation=policy.statistics())
                case _:
                    raise TypeError(f"speculation got unexpected {type(msg).__name__}")


@attrs.define
class SpeculationLink:
    """The scheduler's end: hands the decision answering the last step to the core as
    advice before each plan (the core decides every row's k: engine.orders), reports
    each step."""

    outbox: Outbox
    replies: Inbox
    lookup: bool = False               # lookup is served: its rows' contexts go along
    default: SpecChoice | None = None  # the server's choice (tells which rows look up)
    proposals: tuple[tuple[str, int], ...] = ()
    drafts: tuple[Draft, ...] = ()
    new_rows: bool = True              # the latest decision's `new_rows`
    open_rows: set[str] = attrs.Factory(set)
    lookup_rows: set[str] = attrs.Factory(set)
    num_steps: int = 0
    num_decisions: int = 0

    async def advise(self, advice: StepAdvice) -> StepAdvice:
        """`advice` with the decision that answers the last step reported (waited for if
        it is not in yet): its proposal sizes and whether new rows may propose."""
        self._read_decisions()
        while self.num_decisions < self.num_steps:
            self._take(await self.replies.receive())
        return attrs.evolve(advice, speculation=True, proposals=self.proposals,
                            drafts=self.drafts, new_rows_propose=self.new_rows)

    def _read_decisions(self) -> None:
        while True:
            try:
                self._take(self.replies.receive_nowait())
            except (trio.WouldBlock, trio.EndOfChannel):
                return

    def _take(self, decision: object) -> None:
        if not isinstance(decision, SpecDecision):
            raise TypeError(f"scheduler got unexpected {type(decision).__name__}")
        self.proposals, self.new_rows = tuple(decision.proposals), decision.new_rows
        self.drafts = tuple(decision.drafts)
        self.num_decisions += 1

    async def report(self, plan: StepPlan, result: StepResult, batch: Sequence[str],
                     active: Collection[str]) -> None:
        """One SpecStep for the step just run; `batch`: the rows decoding next, `active`:
        every request not finished (the books of the others go now, as they end)."""
        opened = tuple(SpecOpen(request_id=n.request_id, choice=n.speculative,  # type: ignore
                                context=n.prompt if self._looks_up(n.speculative) else ())
                       for n in plan.new_rows)
        self.open_rows.update(o.request_id for o in opened)
        self.lookup_rows.update(o.request_id for o in opened if o.context)
        released = tuple(sorted(self.open_rows.difference(active)))
        self.open_rows.difference_update(released)
        self.lookup_rows.difference_update(released)
        verified = tuple(RowVerified(request_id=o.request_id, num_proposed=o.num_proposed,
                                     num_accepted=o.num_accepted)
                         for o in result.outputs if o.num_proposed)
        await self._send(SpecStep(
            step=self.num_steps, opened=opened, released=released, verified=verified,
            batch=tuple(batch), decode_seconds=result.decode_seconds,
            speculative=result.speculative, num_rows=len(result.outputs),
            num_tokens=sum(len(o.tokens) for o in result.outputs),
            emitted=tuple((o.request_id, o.tokens) for o in result.outputs
                          if o.request_id in self.lookup_rows and o.tokens)))

    def _looks_up(self, choice: object) -> bool:
        """Whether a row of this request choice proposes by lookup (and lookup is served)."""
        if not self.lookup:
            return False
        resolved = resolve_choice(choice, self.default)
        return resolved is not None and resolved.method == "lookup"

    async def reset(self) -> None:
        """The runner was reset: every row's books go."""
        released, self.open_rows = tuple(sorted(self.open_rows)), set()
        self.proposals, self.drafts, self.lookup_rows = (), (), set()
        await self._send(SpecStep(step=self.num_steps, released=released))

    async def _send(self, msg: SpecStep) -> None:
        self._read_decisions()  # first: keeps the reply mailbox within its size
        self.num_steps += 1
        await self.outbox.send(msg)
