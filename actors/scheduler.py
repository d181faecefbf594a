"""Scheduler actor: drives the sans-io SchedulerCore and the runner, step by step.

Owns: the SchedulerCore (queue, rows) and the Runner (via the runner thread).
Receives: Submit, Cancel (SCHEDULER_MAILBOX: from admission, and on the hub's reply edge
          a Cancel with reason "stop" and `num_tokens` when the hub met a stop string in
          the row's text, or a stream fell behind).
Sends: one StepTokens per step (every row's new tokens) and Done/Error to the hub;
       Lease/Release/KvUsage to the cache owner (the core's KV decisions: each row's
       charged positions, the running rows' charge against the budget);
       SpillWrite/SpillLoad/SpillRemove to the spill actor (with a cache dir), whose
       SpillWritten/SpillLoaded it reads on the spill_replies reply edge: all drained
       between steps, waited for when idle (actors.prefix_ssd);
       Dequeued to admission on the reply edge (send_nowait: that mailbox holds
       one message per queued request, so it cannot fill);
       one SpecStep per step to the speculation actor (with speculation), whose
       SpecDecision for that step it takes before it plans the next (the
       speculation_replies reply edge; the actor answers at once).
Between steps it drains its mailbox without waiting, so a cancel frees its row
at the start of the next step. When idle it waits for a message.
Posts: the core's and the prefix cache's statistics to the board (actors.board) once per
step (before the step's events go out) and whenever it goes idle. Stamps each request's queue wait (its Done's `queue_seconds`).
With a prefix cache (actors.prefix_cache), a request looks up its donor when it is about
to take a row; an SSD hit is loaded by the spill actor (its disk thread, then the runner
thread between steps) while the request waits without a row and the other rows keep
decoding; it joins when its KV is ready.
One decider: before each step the prefix cache and the speculation link put what they
know into one StepAdvice (engine.step: pending spill/drop orders, write-through, the
speculation actor's decision for the last step); the core decides the whole plan
from it (engine.orders) and nothing edits the plan after. Each result is absorbed by the
prefix cache (a sync flush writes here), and each step is reported to the speculation
actor in one SpecStep (opened and released rows, verified lengths, its measurement).
A runner failure is our bug: it is logged, every request in flight gets an
`internal_error` event, the runner is reset, the snapshots nobody indexed are dropped and
the prefix index forgets what the runner lost, and serving goes on; with --distributed
(engine.distributed) the requests fail and GroupFailure ends the engine.
"""

from __future__ import annotations

import logging
from contextlib import nullcontext

import trio

from tqserve.actors.board import Board
from tqserve.actors.mailbox import Inbox, Outbox
from tqserve.actors.prefix_cache import LOADING, PrefixCache, Reuse
from tqserve.actors.messages import (Cancel, Dequeued, Done, Error, KvUsage, Lease, Release,
                                     SpillLoaded, SpillWritten, StepTokens, Submit)
from tqserve.actors.runner_thread import RunnerThread
from tqserve.engine.distributed import GroupFailure
from tqserve.actors.speculation import SpeculationLink
from tqserve.engine.runner import Runner
from tqserve.engine.scheduler import SchedulerCore
from tqserve.engine.step import (NO_ADVICE, Event, Finished, Preempted, Started, StepPlan,
                                 TokenOut)

log = logging.getLogger("tqserve.scheduler")


class GroupFailed:
    """Set once by the scheduler when the tensor-parallel group failed (engine.distributed):
    the requests in flight already have their errors; whoever serves shuts down on `event`."""

    def __init__(self) -> None:
        self.event = trio.Event()
        self.error: GroupFailure | None = None

    def set(self, error: GroupFailure) -> None:
        if self.error is None:
            self.error = error
            self.event.set()


async def run_scheduler(
    core: SchedulerCore,
    runner: Runner,
    thread: RunnerThread,
    inbox: Inbox,
    admission_replies: Outbox,
    cache_owner: Outbox,
    hub: Outbox,
    board: Board,
    prefix: PrefixCache | None = None,
    group_failed: GroupFailed | None = None,
    speculation: SpeculationLink | None = None,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """The step loop: drain the mailbox and the spill actor's answers, look up donors,
    then step or wait for work."""
    actor = _Scheduler(core, runner, thread, inbox, admission_replies, cache_owner, hub, prefix,
                       speculation)
    actor.group_failed, actor.board = group_failed, board
    actor.post()
    task_status.started()
    spill = prefix.ssd.outbox if prefix is not None else None
    async with (admission_replies, cache_owner, hub,
                speculation.outbox if speculation is not None else nullcontext(),
                spill if spill is not None else nullcontext()):
        while True:
            await actor.drain_inbox()
            if prefix is not None:
                await prefix.apply_replies()
            await actor.look_up()
            if actor.has_work():
                await actor.step()  # posts before it sends the step's events
                continue
            actor.post()  # idle, or done: the board shows the books as they rest
            if actor.finished():
                return
            await actor.wait_for_work()


class _Scheduler:
    """The scheduler actor's state and the named pieces of its loop."""

    def __init__(self, core: SchedulerCore, runner: Runner, thread: RunnerThread, inbox: Inbox,
                 admission_replies: Outbox, cache_owner: Outbox, hub: Outbox,
                 prefix: PrefixCache | None, speculation: SpeculationLink | None) -> None:
        self.core, self.runner, self.thread, self.inbox = core, runner, thread, inbox
        self.speculation = speculation
        self.admission_replies, self.cache_owner, self.hub = admission_replies, cache_owner, hub
        self.prefix = prefix
        self.closed = False  # the mailbox ended: finish what runs, then return
        self.last_usage = KvUsage(kv_bytes=0, num_rows=0)
        self.group_failed: GroupFailed | None = None
        self.board = Board()
        self.arrived: dict[str, float] = {}  # request id -> when it reached the queue
        self.waited: dict[str, float] = {}   # request id -> seconds it was queued

    def post(self) -> None:
        """Put the core's and the prefix cache's statistics on the board."""
        if self.prefix is not None:
            self.board.post(scheduler=self.core.statistics(),
                            prefix_cache=self.prefix.statistics())
        else:
            self.board.post(scheduler=self.core.statistics())

    async def drain_inbox(self) -> None:
        """Handle every waiting Submit/Cancel without waiting (cancels free rows now)."""
        while not self.closed:
            try:
                await self.handle(self.inbox.receive_nowait())
            except trio.WouldBlock:
                return
            except trio.EndOfChannel:
                self.closed = True

    async def handle(self, msg: Submit | Cancel) -> None:
        match msg:
            case Submit():
                try:
                    self.core.add(msg.request_id, msg.prompt_tokens, msg.params,
                                  response_format=msg.response_format,
                                  speculative=msg.speculative)
                    self.arrived[msg.request_id] = trio.current_time()
                except ValueError as exc:
                    self.admission_replies.send_nowait(Dequeued(
                        request_id=msg.request_id, num_prompt_tokens=len(msg.prompt_tokens)))
                    await self.hub.send(Error(request_id=msg.request_id, code="invalid_request",
                                              message=str(exc)))
            case Cancel():
                await self.emit(self.core.cancel(msg.request_id, msg.reason, msg.num_tokens))
            case _:
                raise TypeError(f"scheduler got unexpected {type(msg).__name__}")

    async def emit(self, events: list[Event], error: str | None = None) -> None:
        """Send what the core decided: every row's tokens in ONE StepTokens, then the
        starts and finishes in order (a row's tokens always precede its Done)."""
        rows = [e for e in events if isinstance(e, TokenOut)]
        if rows:
            await self.hub.send(StepTokens(rows=rows))
        for event in events:
            match event:
                case Started():
                    await self.started(event)
                case Finished():
                    await self.finish(event, error)
                case Preempted():  # its KV leaves with the step's release (engine.kv_budget)
                    await self.cache_owner.send(Release(request_id=event.request_id,
                                                        row_id=event.row_id, reason="preempted"))

    async def started(self, event: Started) -> None:
        if not event.resumed:  # a resumed row left admission's queue when it first started
            arrived = self.arrived.pop(event.request_id, None)
            if arrived is not None:
                self.waited[event.request_id] = trio.current_time() - arrived
            self.admission_replies.send_nowait(Dequeued(
                request_id=event.request_id, num_prompt_tokens=event.num_prompt_tokens))
        await self.cache_owner.send(Lease(request_id=event.request_id, row_id=event.row_id,
                                          kv_positions=event.kv_positions))

    async def finish(self, event: Finished, error: str | None) -> None:
        self.arrived.pop(event.request_id, None)
        waited = self.waited.pop(event.request_id, None)
        if self.prefix is not None:
            self.prefix.finished(event)
        if event.was_queued and not event.preemptions:
            self.admission_replies.send_nowait(Dequeued(
                request_id=event.request_id, num_prompt_tokens=event.prompt_tokens))
        if event.row_id is not None:
            await self.cache_owner.send(Release(request_id=event.request_id,
                                                row_id=event.row_id, reason=event.finish_reason))
        if error is not None:
            await self.hub.send(Error(request_id=event.request_id, code="internal_error",
                                      message=error))
        elif event.error is not None:  # the request's grammar failed mid-way
            await self.hub.send(Error(request_id=event.request_id, code="invalid_request",
                                      message=event.error))
        else:
            await self.hub.send(Done(
                request_id=event.request_id, finish_reason=event.finish_reason,
                prompt_tokens=event.prompt_tokens, completion_tokens=event.completion_tokens,
                cached_tokens=event.cached_tokens, cached_tier=event.cached_tier,
                speculative=None if event.speculative is None else (
                    event.speculative.proposed, event.speculative.accepted,
                    event.speculative.verify_steps), queue_seconds=waited))

    async def report_usage(self, usage: KvUsage) -> None:
        """Tell the cache owner, only when it changed (the cache grows every 256 steps)."""
        if usage != self.last_usage:
            self.last_usage = usage
            await self.cache_owner.send(usage)

    async def look_up(self) -> None:
        """Donors for the requests about to take a row; SSD hits start loading."""
        prefix, core = self.prefix, self.core
        if prefix is None:
            return
        for rid, reuse in prefix.take_ready():
            if not core.is_held(rid):
                prefix.release_reuse(rid)  # cancelled while its KV loaded
            elif reuse is None:
                core.unhold(rid)  # the load failed: look it up again
            else:
                core.set_reuse(rid, reuse=reuse.key, cached=reuse.cached,
                               cached_tier=reuse.tier, snapshot_prompt=not prefix.has_prompt(
                                   core.prompt(rid), core.speculative(rid)))
        while batch := core.next_to_start():
            for rid, prompt in batch:
                speculative = core.speculative(rid)
                found = prefix.lookup(rid, prompt, speculative)
                if found == LOADING:
                    core.hold(rid)
                    continue
                snapshot = not prefix.has_prompt(prompt, speculative)
                if isinstance(found, Reuse):
                    core.set_reuse(rid, reuse=found.key, cached=found.cached,
                                   cached_tier=found.tier, snapshot_prompt=snapshot)
                else:  # None: nothing cached
                    core.set_reuse(rid, snapshot_prompt=snapshot)
        await prefix.start_loads()

    def has_work(self) -> bool:
        """A step would do something: rows to run, or prefix-cache orders to carry."""
        return self.core.has_work() or (self.prefix is not None and self.prefix.has_orders())

    def finished(self) -> bool:
        """The mailbox ended, nothing runs and no KV is loading: the actor may return."""
        return self.closed and (self.prefix is None or not self.prefix.loads_pending)

    async def step(self) -> None:
        """One engine step: plan, run it on the runner thread, send what came of it."""
        advice = NO_ADVICE  # what the actors know that the core needs, before it decides
        if self.prefix is not None:
            advice = self.prefix.advise(advice)
        if self.speculation is not None:
            advice = await self.speculation.advise(advice)
        plan, started = self.core.schedule(advice)  # the whole step; nobody edits it after
        await self.emit(started)
        try:
            result = await self.thread.call(self.runner.execute, plan)
        except Exception as exc:
            await self.fail(plan, exc)
            return
        if self.prefix is not None:
            await self.prefix.absorb(plan, result, self.core.prompt)
        events = self.core.postprocess(result)
        await self.report_usage(KvUsage(kv_bytes=result.kv_bytes, num_rows=len(plan.decode),
                                        charged_bytes=self.core.kv_charge()))
        self.post()  # before the events: whoever reads a Done reads the books after it
        await self.emit(events)
        if self.speculation is not None:
            await self.speculation.report(plan, result, self.core.decoding_ids(),
                                          set(self.core.active_ids()))
        await trio.lowlevel.checkpoint()

    async def fail(self, plan: StepPlan, exc: Exception) -> None:
        """A runner failure (our bug): log it, fail every request, reset, serve on.
        A tensor-parallel group's failure ends the engine instead (engine.distributed)."""
        if isinstance(exc, GroupFailure):
            log.error("tensor-parallel group failed: %s", exc)
            await self.emit(self.core.fail_all(), error=f"tensor-parallel group failed: {exc}")
            if self.group_failed is None:
                raise exc
            self.group_failed.set(exc)  # the server shuts down (api.server), then exits 1
            return
        log.exception("runner step failed; failing %d requests", len(self.core.active_ids()))
        await self.thread.call(self.runner.reset)
        if self.speculation is not None:
            await self.speculation.reset()
        if self.prefix is not None:
            for new in plan.new_rows:
                self.prefix.release_reuse(new.request_id)
            held = await self.thread.call(self.runner.snapshots.keys)
            await self.thread.call(self.runner.retain, self.prefix.reconcile(held))
        await self.emit(self.core.fail_all(),
                        error=f"engine step failed: {type(exc).__name__}: {exc}")
        await self.report_usage(KvUsage(kv_bytes=0, num_rows=0, charged_bytes=0))

    async def wait_for_work(self) -> None:
        """Idle: wait for a message or the spill actor's next answer, then handle what came
        (each receive is cancel-safe: what one took is never lost to the other's win)."""
        prefix = self.prefix
        if self.closed and prefix is not None:  # not finished(): a load is pending
            await prefix.wait_reply()
            return
        received: list[Submit | Cancel] = []
        answers: list[SpillWritten | SpillLoaded] = []
        async with trio.open_nursery() as race:
            async def receive() -> None:
                try:
                    received.append(await self.inbox.receive())
                except trio.EndOfChannel:
                    self.closed = True
                race.cancel_scope.cancel()

            race.start_soon(receive)
            if prefix is not None and prefix.ssd.replies is not None:
                replies = prefix.ssd.replies

                async def answered() -> None:
                    answers.append(await replies.receive())
                    race.cancel_scope.cancel()

                race.start_soon(answered)
        if prefix is not None and answers:
            await prefix.apply_replies(answers)
        for msg in received:
            await self.handle(msg)
