"""Hub actor: fans token events out to one stream per request id, detokenizing per stream.

Owns: the open streams (request id -> bounded trio channel to its consumer, and the
stream's TextStream: detokenization and stop strings happen here, off the scheduler's path).
Receives: Queued/Done/Error from admission and the scheduler, and one StepTokens per
engine step holding every row's new tokens (HUB_MAILBOX).
Sends: Cancel to the scheduler, from `run_hub_cancels` only (a reply edge). Each token of a
StepTokens becomes one `Token` event whose text is that token's own text (held back only
for incomplete UTF-8 or a possible stop-string match); a row's prompt logprobs, when it
asked for them, go out as one `PromptLogprobs` event before its first Token. When a stop
string appears, the
token that completes it is delivered with the text before the stop string, later tokens are
dropped, and Cancel(reason="stop", num_tokens=delivered) goes out at once, so the row is
freed within a step or two (tokens already sampled in between are never delivered); the
stream's Done then says finish_reason "stop" and counts the delivered tokens, whatever
raced it. A consumer that falls `stream_buffer` events behind is cut off (its stream
ends and `overflowed` says so) and its request is cancelled the same way, before anyone
tries to tell the client (whose socket may never drain). A slow client never grows a
buffer. The ids waiting for their cancel are at most the open streams; delivery never
waits for them.

`open_stream` / `close_stream` are called by the consumer side (same trio thread):
they hand over a local channel endpoint, which no message can carry.
Posts: its HubStatistics to the board (actors.board) once the messages waiting in its
mailbox are delivered, and when a stream opens or closes.
"""

from __future__ import annotations

from typing import Callable

import attrs
import trio

from tqserve.actors.board import Board
from tqserve.actors.mailbox import Inbox, Outbox
from tqserve.actors.messages import Cancel, Done, Error, Event, PromptLogprobs, StepTokens, Token
from tqserve.engine.detokenize import TextStream
from tqserve.engine.step import TokenOut

MakeTextStream = Callable[[tuple[str, ...]], TextStream]


@attrs.frozen(kw_only=True)
class HubStatistics:
    num_streams: int
    num_events: int
    num_dropped: int
    num_overflowed: int
    num_stopped: int  # streams a stop string ended


@attrs.define
class _Stream:
    send: trio.MemorySendChannel[Event]
    text: TextStream
    label: str  # the request id its Token events carry
    num_delivered: int = 0
    stopped: bool = False  # a stop string ended it: later tokens are dropped


class Hub:
    """Routes events to per-request streams; turns each step's tokens into Token events."""

    def __init__(self, stream_buffer: int, make_text_stream: MakeTextStream,
                 board: Board | None = None) -> None:
        self._board = board
        self._stream_buffer = stream_buffer
        self._make_text_stream = make_text_stream
        self._streams: dict[str, _Stream] = {}
        self._overflowed: set[str] = set()
        self._to_cancel: dict[str, Cancel] = {}
        self._cancel_wanted = trio.Event()
        self._num_events = 0
        self._num_dropped = 0
        self._num_overflowed = 0
        self._num_stopped = 0

    def open_stream(self, request_id: str, stop: tuple[str, ...] = (),
                    label: str | None = None) -> trio.MemoryReceiveChannel[Event]:
        """Register a consumer for `request_id` whose text ends at any of `stop`; its Token
        events carry `label` (default: the request id). Raises ValueError if one is open."""
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        send, receive = trio.open_memory_channel[Event](self._stream_buffer)
        self._streams[request_id] = _Stream(send, self._make_text_stream(tuple(stop)),
                                            label if label is not None else request_id)
        self._overflowed.discard(request_id)
        self.post()
        return receive

    def close_stream(self, request_id: str) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.send.close()
            self.post()

    def post(self) -> None:
        """Put this hub's statistics on the board (if it has one)."""
        if self._board is not None:
            self._board.post(hub=self.statistics())

    def overflowed(self, request_id: str) -> bool:
        return request_id in self._overflowed

    def is_open(self, request_id: str) -> bool:
        return request_id in self._streams

    def deliver(self, message: Event | StepTokens) -> None:
        """Route one message (a step's tokens go to their streams, one Token event per
        token); end a stream on Done/Error or on overflow."""
        if isinstance(message, StepTokens):
            for row in message.rows:
                self._deliver_row(row)
            return
        rid = message.request_id
        stream = self._streams.get(rid) if rid is not None else None
        if isinstance(message, Done) and stream is not None and stream.stopped:
            message = attrs.evolve(message, finish_reason="stop",
                                   completion_tokens=stream.num_delivered)
        self._send(rid, message)

    def _deliver_row(self, row: TokenOut) -> None:
        stream = self._streams.get(row.request_id)
        if stream is None or stream.stopped:
            self._num_dropped += len(row.token_ids)
            return
        if row.prompt_logprobs is not None:
            self._send(row.request_id, PromptLogprobs.of(stream.label, row.prompt_logprobs))
        last = len(row.token_ids) - 1
        for i, token in enumerate(row.token_ids):
            if i == last and row.stop_token:
                text = ""
            else:
                text = stream.text.add(token)
            if i == last and row.final:
                text += stream.text.flush()
            stream.num_delivered += 1
            stream.stopped = stream.text.stopped
            top = row.top_logprobs[i] if row.top_logprobs is not None else None
            self._send(row.request_id, Token(
                request_id=stream.label, index=row.index + i, token_id=token, text=text,
                logprob=row.logprobs[i] if row.logprobs is not None else None,
                top_logprobs=top or None))
            if stream.stopped:
                self._num_stopped += 1
                self._num_dropped += last - i
                if not (i == last and row.final) and row.request_id in self._streams:
                    self._want_cancel(Cancel(request_id=row.request_id, reason="stop",
                                             num_tokens=stream.num_delivered))
                return

    def _send(self, rid: str | None, event: Event) -> None:
        self._num_events += 1
        stream = self._streams.get(rid) if rid is not None else None
        if rid is None or stream is None:
            self._num_dropped += 1
            return
        try:
            stream.send.send_nowait(event)
        except trio.WouldBlock:
            self._num_overflowed += 1
            self._overflowed.add(rid)
            self._want_cancel(Cancel(request_id=rid))
            self.close_stream(rid)
            return
        except trio.BrokenResourceError:
            self.close_stream(rid)
            return
        if isinstance(event, (Done, Error)):
            self.close_stream(rid)

    def _want_cancel(self, cancel: Cancel) -> None:
        self._to_cancel[cancel.request_id] = cancel
        self._cancel_wanted.set()

    async def wait_cancels(self) -> list[Cancel]:
        """Wait until some streams overflowed or stopped; their Cancels, each once."""
        while not self._to_cancel:
            self._cancel_wanted = trio.Event()
            await self._cancel_wanted.wait()
        cancels = [self._to_cancel[rid] for rid in sorted(self._to_cancel)]
        self._to_cancel.clear()
        return cancels

    def statistics(self) -> HubStatistics:
        return HubStatistics(num_streams=len(self._streams), num_events=self._num_events,
                             num_dropped=self._num_dropped, num_overflowed=self._num_overflowed,
                             num_stopped=self._num_stopped)


async def run_hub(hub: Hub, inbox: Inbox,
                  task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    hub.post()
    task_status.started()
    async for message in inbox:
        hub.deliver(message)
        if inbox.empty:  # once the messages waiting are delivered, not after each
            hub.post()
    for rid in list(hub._streams):
        hub.close_stream(rid)


async def run_hub_cancels(hub: Hub, scheduler: Outbox) -> None:
    """Cancel every request whose stream overflowed or met a stop string, as soon as it
    does (the hub's reply edge into the scheduler, whose rows they are)."""
    async with scheduler:
        while True:
            for cancel in await hub.wait_cancels():
                await scheduler.send(cancel)
