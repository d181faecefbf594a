"""Hub actor: fans token events out to one stream per request id.

Owns: the open streams (request id -> bounded trio channel to its consumer).
Receives: Queued/Token/Done/Error from admission and the scheduler (HUB_MAILBOX).
Sends: Cancel to admission, from `run_overflow_cancels` only. A consumer that falls
`stream_buffer` events behind is cut off (its stream ends and `overflowed` says so) and
its request is cancelled at once by that task, before anyone tries to tell the client
(whose socket may never drain). A slow client never grows a buffer. The overflowed ids
waiting for their cancel are at most the open streams; delivery never waits for them.

`open_stream` / `close_stream` are called by the consumer side (same trio thread):
they hand over a local channel endpoint, which no message can carry.
"""

from __future__ import annotations

import attrs
import trio

from tqserve.actors.mailbox import Inbox, Outbox
from tqserve.actors.messages import Cancel, Done, Error, Event


@attrs.frozen(kw_only=True)
class HubStatistics:
    num_streams: int
    num_events: int
    num_dropped: int
    num_overflowed: int


class Hub:
    """Routes events to per-request streams."""

    def __init__(self, stream_buffer: int) -> None:
        self._stream_buffer = stream_buffer
        self._streams: dict[str, trio.MemorySendChannel[Event]] = {}
        self._overflowed: set[str] = set()
        self._to_cancel: set[str] = set()
        self._cancel_wanted = trio.Event()
        self._num_events = 0
        self._num_dropped = 0
        self._num_overflowed = 0

    def open_stream(self, request_id: str) -> trio.MemoryReceiveChannel[Event]:
        """Register a consumer for `request_id`; raises ValueError if one is open."""
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        send, receive = trio.open_memory_channel[Event](self._stream_buffer)
        self._streams[request_id] = send
        self._overflowed.discard(request_id)
        return receive

    def close_stream(self, request_id: str) -> None:
        send = self._streams.pop(request_id, None)
        if send is not None:
            send.close()

    def overflowed(self, request_id: str) -> bool:
        return request_id in self._overflowed

    def is_open(self, request_id: str) -> bool:
        return request_id in self._streams

    def deliver(self, event: Event) -> None:
        """Route one event; end the stream on Done/Error or on overflow."""
        self._num_events += 1
        rid = event.request_id
        send = self._streams.get(rid) if rid is not None else None
        if rid is None or send is None:
            self._num_dropped += 1
            return
        try:
            send.send_nowait(event)
        except trio.WouldBlock:
            self._num_overflowed += 1
            self._overflowed.add(rid)
            self._to_cancel.add(rid)
            self._cancel_wanted.set()
            self.close_stream(rid)
            return
        except trio.BrokenResourceError:
            self.close_stream(rid)
            return
        if isinstance(event, (Done, Error)):
            self.close_stream(rid)

    async def wait_overflowed(self) -> list[str]:
        """Wait until some streams overflowed; return their ids, each once."""
        while not self._to_cancel:
            self._cancel_wanted = trio.Event()
            await self._cancel_wanted.wait()
        ids = sorted(self._to_cancel)
        self._to_cancel.clear()
        return ids

    def statistics(self) -> HubStatistics:
        return HubStatistics(num_streams=len(self._streams), num_events=self._num_events,
                             num_dropped=self._num_dropped, num_overflowed=self._num_overflowed)


async def run_hub(hub: Hub, inbox: Inbox,
                  task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    task_status.started()
    async for event in inbox:
        hub.deliver(event)
    for rid in list(hub._streams):
        hub.close_stream(rid)


async def run_overflow_cancels(hub: Hub, admission: Outbox) -> None:
    """Cancel every request whose stream overflowed, as soon as it does."""
    async with admission:
        while True:
            for rid in await hub.wait_overflowed():
                await admission.send(Cancel(request_id=rid))
