"""Bounded mailboxes that carry msgpack-encoded messages between actors.

`open_mailbox(size)` returns (Outbox, Inbox): the sender encodes, the receiver
decodes, and the trio memory channel between them holds only bytes: each message's
msgpack data and its out-of-band buffers (the snapshot planes' bytes: actors.codec).
Every size is a named constant with its reason, at the place the graph is wired
(`actors.engine`). An optional recorder sees every message that crosses (its data).
"""

from __future__ import annotations

from typing import Any, AsyncIterator, Callable

import trio

from tqserve.actors.messages import decode, encode

Recorder = Callable[[str, bytes], None]
Item = tuple[bytes, tuple[bytes, ...]]  # a message's msgpack data and out-of-band buffers


class Outbox:
    """Send end of a mailbox. `clone()` for fan-in from several actors."""

    def __init__(self, channel: trio.MemorySendChannel[Item], name: str,
                 recorder: Recorder | None) -> None:
        self._channel = channel
        self.name = name
        self._recorder = recorder

    async def send(self, message: Any) -> None:
        item = self._encode(message)
        if self._recorder is not None:
            self._recorder(self.name, item[0])
        await self._channel.send(item)

    def send_nowait(self, message: Any) -> None:
        """Send without waiting; raises trio.WouldBlock when the mailbox is full."""
        item = self._encode(message)
        self._channel.send_nowait(item)
        if self._recorder is not None:
            self._recorder(self.name, item[0])

    async def forward(self, item: Item) -> None:
        """Send a message received from another mailbox as it came (`Inbox.items`): its
        bytes are not encoded again."""
        if self._recorder is not None:
            self._recorder(self.name, item[0])
        await self._channel.send(item)

    @staticmethod
    def _encode(message: Any) -> Item:
        buffers: list[bytes] = []
        data = encode(message, buffers)
        return data, tuple(buffers)

    async def __aenter__(self) -> "Outbox":
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    def clone(self) -> "Outbox":
        return Outbox(self._channel.clone(), self.name, self._recorder)

    async def aclose(self) -> None:
        await self._channel.aclose()

    def close(self) -> None:
        self._channel.close()


class Inbox:
    """Receive end of a mailbox; iterate with `async for`."""

    def __init__(self, channel: trio.MemoryReceiveChannel[Item]) -> None:
        self._channel = channel

    async def receive(self) -> Any:
        return decode(*await self._channel.receive())

    def receive_nowait(self) -> Any:
        """Receive without waiting; raises trio.WouldBlock when empty."""
        return decode(*self._channel.receive_nowait())

    async def items(self) -> AsyncIterator[tuple[Any, Item]]:
        """Each message with the item it came as (to `Outbox.forward` it unchanged)."""
        while True:
            try:
                item = await self._channel.receive()
            except trio.EndOfChannel:
                return
            yield decode(*item), item

    @property
    def empty(self) -> bool:
        """Whether no message waits (the next receive would wait)."""
        return self._channel.statistics().current_buffer_used == 0

    def __aiter__(self) -> "Inbox":
        return self

    async def __anext__(self) -> Any:
        try:
            return await self.receive()
        except trio.EndOfChannel:
            raise StopAsyncIteration from None

    def close(self) -> None:
        self._channel.close()


def open_mailbox(size: int, name: str, recorder: Recorder | None = None) -> tuple[Outbox, Inbox]:
    """A bounded mailbox of `size` messages."""
    send, receive = trio.open_memory_channel[Item](size)
    return Outbox(send, name, recorder), Inbox(receive)
