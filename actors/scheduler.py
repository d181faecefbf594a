"""Scheduler actor: drives the sans-io SchedulerCore and the runner, step by step.

Owns: the SchedulerCore (queue, rows) and the Runner (via the runner thread).
Receives: Submit, Cancel (from admission, SCHEDULER_MAILBOX).
Sends: Token/Done/Error to the hub; Lease/Release/KvUsage to the cache owner;
       Dequeued to admission on the reply edge (send_nowait: that mailbox holds
       one message per queued request, so it cannot fill).
Between steps it drains its mailbox without waiting, so a cancel frees its row
at the start of the next step. When idle it waits for a message.
With a prefix cache (actors.prefix_cache), a Submit first looks up a donor (an SSD hit
reads the file on a worker thread meanwhile), each plan carries the cache's snapshot,
spill and drop orders, and each result is absorbed by it (a sync flush writes here).
A runner failure is our bug: it is logged, every request in flight gets an
`internal_error` event, the runner is reset, and serving goes on.
"""

from __future__ import annotations

import logging

import trio

from actors.mailbox import Inbox, Outbox
from actors.prefix_cache import PrefixCache
from actors.messages import (Cancel, Dequeued, Done, Error, KvUsage, Lease, Release,
                             Submit, Token)
from actors.runner_thread import RunnerThread
from engine.runner import Runner
from engine.scheduler import Event, Finished, SchedulerCore, Started, TokenOut

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
                else:
                    await hub.send(Done(
                        request_id=event.request_id, finish_reason=event.finish_reason,
                        prompt_tokens=event.prompt_tokens,
                        completion_tokens=event.completion_tokens,
                        cached_tokens=event.cached_tokens, cached_tier=event.cached_tier))

    async def handle(msg: Submit | Cancel) -> None:
        match msg:
            case Submit():
                reuse = None
                if prefix is not None:
                    reuse = await prefix.lookup(msg.request_id, msg.prompt_tokens)
                try:
                    if reuse is None:
                        core.add(msg.request_id, msg.prompt_tokens, msg.params)
                    else:
                        core.add(msg.request_id, msg.prompt_tokens, msg.params,
                                 reuse=reuse.key, cached=reuse.cached, cached_tier=reuse.tier)
                except ValueError as exc:
                    if prefix is not None:
                        prefix.release_reuse(msg.request_id)
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

    task_status.started()
    async with admission_replies, cache_owner, hub:
        closed = False
        while True:
            while not closed:
                try:
                    await handle(inbox.receive_nowait())
                except trio.WouldBlock:
                    break
                except trio.EndOfChannel:
                    closed = True
            if not core.has_work() and not (prefix is not None and prefix.has_orders()):
                if closed:
                    return
                try:
                    await handle(await inbox.receive())
                except trio.EndOfChannel:
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
