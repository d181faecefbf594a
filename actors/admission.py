"""Admission actor: bounds the queue by requests AND prompt tokens; never waits.

Owns: the count of queued requests and queued prompt tokens.
Receives: Submit, Cancel, StopAdmitting (from the api, mailbox ADMISSION_MAILBOX);
          Dequeued (reply edge from the scheduler, mailbox sized so it never fills).
Sends: Submit/Cancel to the scheduler; Queued or Error("overloaded") to the hub.
Posts: its AdmissionStatistics to the board (actors.board) after every message; the
facade's O(1) overload gate reads that record, before it tokenizes a request.
A request over either bound is rejected at once with the reason (code `overloaded`);
nothing already admitted is affected. After StopAdmitting (the server is shutting down)
every later request is refused with code `shutting_down`.
"""

from __future__ import annotations

import attrs
import trio

from tqserve.actors.board import Board
from tqserve.actors.mailbox import Inbox, Item, Outbox
from tqserve.actors.messages import Cancel, Dequeued, Error, Queued, StopAdmitting, Submit

SHUTTING_DOWN = "the server is shutting down; no new requests"


def queue_full(num_queued: int, max_queued_requests: int) -> str:
    """The overload refusal's message when the queue holds `num_queued` requests."""
    return (f"queue full: {num_queued} requests queued (max {max_queued_requests}, "
            f"--max-queued-requests)")


@attrs.frozen(kw_only=True)
class AdmissionStatistics:
    num_queued: int
    num_queued_tokens: int
    requests_total: int
    requests_rejected: int
    admitting: bool = True


@attrs.define
class AdmissionControl:
    """Sans-io books of the admission bound."""

    max_queued_requests: int
    max_queued_tokens: int
    queued: dict[str, int] = attrs.Factory(dict)
    num_queued_tokens: int = 0  # sum of `queued`, kept as it changes: each check is O(1)
    requests_total: int = 0
    requests_rejected: int = 0
    admitting: bool = True

    def stop_admitting(self) -> None:
        """Refuse every request from now on (shutdown); queued ones stay queued."""
        self.admitting = False

    def try_admit(self, request_id: str, num_tokens: int) -> str | None:
        """Admit and return None, or return the reason for rejecting."""
        self.requests_total += 1
        reason = None
        tokens = self.num_queued_tokens
        if not self.admitting:
            reason = SHUTTING_DOWN
        elif len(self.queued) >= self.max_queued_requests:
            reason = queue_full(len(self.queued), self.max_queued_requests)
        elif tokens + num_tokens > self.max_queued_tokens:
            reason = (f"queue full: {tokens} prompt tokens queued, {num_tokens} more would exceed "
                      f"max {self.max_queued_tokens} (--max-queued-tokens)")
        if reason is not None:
            self.requests_rejected += 1
            return reason
        self.queued[request_id] = num_tokens
        self.num_queued_tokens += num_tokens
        return None

    def dequeued(self, request_id: str) -> None:
        num_tokens = self.queued.pop(request_id, None)
        if num_tokens is not None:
            self.num_queued_tokens -= num_tokens

    def statistics(self) -> AdmissionStatistics:
        return AdmissionStatistics(
            num_queued=len(self.queued), num_queued_tokens=self.num_queued_tokens,
            requests_total=self.requests_total, requests_rejected=self.requests_rejected,
            admitting=self.admitting)


async def run_admission(
    control: AdmissionControl,
    inbox: Inbox,
    replies: Inbox,
    scheduler: Outbox,
    hub: Outbox,
    board: Board,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Forward admitted requests and cancels; account dequeues from the reply edge."""

    async def account() -> None:
        async for msg in replies:
            if isinstance(msg, Dequeued):
                control.dequeued(msg.request_id)
                board.post(admission=control.statistics())

    board.post(admission=control.statistics())
    async with trio.open_nursery() as nursery:
        nursery.start_soon(account)
        task_status.started()
        async with scheduler, hub:
            async for msg, item in inbox.items():
                await _handle(control, msg, item, scheduler, hub, board)
        nursery.cancel_scope.cancel()


async def _handle(control: AdmissionControl, msg: Submit | Cancel | StopAdmitting,
                  item: Item, scheduler: Outbox, hub: Outbox, board: Board) -> None:
    """One message; an admitted Submit and a Cancel go on as they came (`item`: their
    bytes are not encoded again)."""
    match msg:
        case Submit():
            reason = control.try_admit(msg.request_id, len(msg.prompt_tokens))
            board.post(admission=control.statistics())  # before any wait: the gate reads it
            if reason is None:
                await hub.send(Queued(request_id=msg.request_id))
                await scheduler.forward(item)
            else:
                code = "shutting_down" if reason == SHUTTING_DOWN else "overloaded"
                await hub.send(Error(request_id=msg.request_id, code=code, message=reason))
        case Cancel():
            await scheduler.forward(item)
        case StopAdmitting():
            control.stop_admitting()
            board.post(admission=control.statistics())
        case _:
            raise TypeError(f"admission got unexpected {type(msg).__name__}")
