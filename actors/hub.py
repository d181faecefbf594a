"""Hub actor: fans token events out to one stream per request id.

Owns: the open streams (request id -> bounded trio channel to its consumer).
Receives: Queued/Token/Done/Error from admission and the scheduler (HUB_MAILBOX).
Sends: nothing to other actors. A consumer that falls STREAM_BUFFER events behind
is cut off (its stream ends and `overflowed` says so); the consumer then cancels
its request. A slow client never grows a buffer.

`open_stream` / `close_stream` are called by the consumer side (same trio thread):
they hand over a local channel endpoint, which no message can carry.
"""

from __future__ import annotations

import attrs
import trio

from actors.mailbox import Inbox
from actors.messages import Done, Error, Event


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
            self.close_stream(rid)
            return
        except trio.BrokenResourceError:
            self.close_stream(rid)
            return
        if isinstance(event, (Done, Error)):
            self.close_stream(rid)

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
