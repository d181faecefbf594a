"""Scheduler actor: drives the sans-io SchedulerCore and the runner, step by step.

Owns: the SchedulerCore (queue, rows) and the Runner (via the runner thread).
Receives: Submit, Cancel (from admission, SCHEDULER_MAILBOX).
Sends: Token/Done/Error to the hub; Lease/Release/KvUsage to the cache owner;
       Dequeued to admission on the reply edge (send_nowait: that mailbox holds
       one message per queued request, so it cannot fill).
Between steps it drains its mailbox without waiting, so a cancel frees its row
at the start of the next step. When idle it waits for a message.
With a prefix cache (actors.prefix_cache), a request looks up its donor when it is about
to take a row; an SSD hit loads in a task of this actor's nursery (worker thread, then the
runner thread between steps) while the request waits without a row and the other rows keep
decoding; it joins when its KV is ready. Each plan carries the cache's snapshot, persist,
spill and drop orders, and each result is absorbed by it (a sync flush writes here).
A runner failure is our bug: it is logged, every request in flight gets an
`internal_error` event, the runner is reset, the snapshots nobody indexed are dropped and
the prefix index forgets what the runner lost, and serving goes on.
"""

from __future__ import annotations

import logging

import trio

from tqserve.actors.mailbox import Inbox, Outbox
from tqserve.actors.prefix_cache import LOADING, PrefixCache
from tqserve.actors.messages import (Cancel, Dequeued, Done, Error, KvUsage, Lease, Release,
                             Submit, Token)
from tqserve.actors.runner_thread import RunnerThread
from tqserve.engine.runner import Runner
from tqserve.engine.scheduler import Event, Finished, SchedulerCore, Started, TokenOut

log = logging.getLogger("tqserve.scheduler")


async def run_scheduler(
    core: SchedulerCore,
    runner: Runner,
    thread: RunnerThread,
    inbox: Inbox,
    admission_replies: Outbox,
    cache_owner: Outbox,
    hub: Outbox,
    prefix: PrefixCache | None = None,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """The step loop."""

    async def emit(event: Event, error: str | None = None) -> None:
        match event:
            case Started():
                admission_replies.send_nowait(Dequeued(
                    request_id=event.request_id, num_prompt_tokens=event.num_prompt_tokens))
                await cache_owner.send(Lease(request_id=event.request_id, row_id=event.row_id))
            case TokenOut():
                await hub.send(Token(
                    request_id=event.request_id, index=event.index, token_id=event.token_id,
                    text=event.text, logprob=event.logprob, top_logprobs=event.top_logprobs))
            case Finished():
                if prefix is not None:
                    prefix.finished(event)
                if event.was_queued:
                    admission_replies.send_nowait(Dequeued(
                        request_id=event.request_id, num_prompt_tokens=event.prompt_tokens))
                if event.row_id is not None:
                    await cache_owner.send(Release(request_id=event.request_id,
                                                   row_id=event.row_id, reason=event.finish_reason))
                if error is not None:
                    await hub.send(Error(request_id=event.request_id, code="internal_error",
                                         message=error))
                elif event.error is not None:  # the request's grammar failed mid-way
                    await hub.send(Error(request_id=event.request_id, code="invalid_request",
                                         message=event.error))
                else:
                    await hub.send(Done(
                        request_id=event.request_id, finish_reason=event.finish_reason,
                        prompt_tokens=event.prompt_tokens,
                        completion_tokens=event.completion_tokens,
                        cached_tokens=event.cached_tokens, cached_tier=event.cached_tier,
                        speculative=None if event.speculative is None else (
                            event.speculative.proposed, event.speculative.accepted,
                            event.speculative.verify_steps)))

    async def handle(msg: Submit | Cancel) -> None:
        match msg:
            case Submit():
                try:
                    core.add(msg.request_id, msg.prompt_tokens, msg.params,
                             response_format=msg.response_format, speculative=msg.speculative)
                except ValueError as exc:
                    admission_replies.send_nowait(Dequeued(
                        request_id=msg.request_id, num_prompt_tokens=len(msg.prompt_tokens)))
                    await hub.send(Error(request_id=msg.request_id, code="invalid_request",
                                         message=str(exc)))
            case Cancel():
                for event in core.cancel(msg.request_id, msg.reason):
                    await emit(event)
            case _:
                raise TypeError(f"scheduler got unexpected {type(msg).__name__}")

    last_usage = KvUsage(kv_bytes=0, num_rows=0)

    async def report_usage(usage: KvUsage) -> None:
        """Tell the cache owner, only when it changed (the cache grows every 256 steps)."""
        nonlocal last_usage
        if usage != last_usage:
            last_usage = usage
            await cache_owner.send(usage)

    def look_up(loads: trio.Nursery) -> None:
        """Donors for the requests about to take a row; SSD hits start loading."""
        if prefix is None:
            return
        for rid, reuse in prefix.take_ready():
            if not core.is_held(rid):
                prefix.release_reuse(rid)  # cancelled while its KV loaded
            elif reuse is None:
                core.unhold(rid)  # the load failed: look it up again
            else:
                core.set_reuse(rid, reuse=reuse.key, cached=reuse.cached,
                               cached_tier=reuse.tier)
        while batch := core.next_to_start():
            for rid, prompt in batch:
                found = prefix.lookup(rid, prompt)
                if found == LOADING:
                    core.hold(rid)
                elif found is None:
                    core.set_reuse(rid)
                else:
                    core.set_reuse(rid, reuse=found.key, cached=found.cached,
                                   cached_tier=found.tier)
        for key in prefix.loads_to_start():
            loads.start_soon(prefix.load, key)

    async def wait_for_work() -> bool:
        """Idle: wait for a message (handled here) or a finished load. False at the end."""
        received: list[Submit | Cancel] = []
        ended = False
        async with trio.open_nursery() as race:
            async def receive() -> None:
                nonlocal ended
                try:
                    received.append(await inbox.receive())
                except trio.EndOfChannel:
                    ended = True
                race.cancel_scope.cancel()

            async def loaded() -> None:
                await prefix.changed.wait()
                race.cancel_scope.cancel()

            race.start_soon(receive)
            if prefix is not None:
                race.start_soon(loaded)
        for msg in received:
            await handle(msg)
        return not ended

    task_status.started()
    async with admission_replies, cache_owner, hub, trio.open_nursery() as loads:
        closed = False
        while True:
            while not closed:
                try:
                    await handle(inbox.receive_nowait())
                except trio.WouldBlock:
                    break
                except trio.EndOfChannel:
                    closed = True
            look_up(loads)
            if not core.has_work() and not (prefix is not None and prefix.has_orders()):
                if closed and (prefix is None or not prefix.statistics().loads_pending):
                    loads.cancel_scope.cancel()
                    return
                if closed:
                    await prefix.changed.wait()
                elif not await wait_for_work():
                    closed = True
                continue
            plan, started = core.schedule()
            if prefix is not None:
                plan = prefix.decorate(plan)
            for event in started:
                await emit(event)
            try:
                result = await thread.call(runner.execute, plan)
            except Exception as exc:
                log.exception("runner step failed; failing %d requests", len(core.active_ids()))
                await thread.call(runner.reset)
                if prefix is not None:
                    for new in plan.new_rows:
                        prefix.release_reuse(new.request_id)
                    held = await thread.call(runner.snapshot_keys)
                    await thread.call(runner.retain, prefix.reconcile(held))
                for event in core.fail_all():
                    await emit(event, error=f"engine step failed: {type(exc).__name__}: {exc}")
                await report_usage(KvUsage(kv_bytes=0, num_rows=0))
                continue
            await report_usage(KvUsage(kv_bytes=result.kv_bytes, num_rows=len(plan.decode)))
            if prefix is not None:
                await prefix.absorb(plan, result)
            for event in core.postprocess(result):
                await emit(event)
            await trio.lowlevel.checkpoint()
