"""Overload refused before hypercorn, Quart or the engine see the request.

While the admission queue is full, every generation request will get the same 429; the
normal path spends about 1.5 ms of event-loop time on each (hypercorn's protocol objects and
h11 parse, the ASGI app, the route, the JSON body) before saying so, and under a burst of a
thousand connects those milliseconds queue up behind each other (issue 20: refusal p50
1,240 ms at a burst of 1,000). Here a connection accepted while the queue is full has its
first bytes read straight from the socket; when they are a complete request head of

    POST /v1/completions | /v1/chat/completions | /v1/messages | /v1/responses

with the right key (when `--api-key` is set) and no `Origin` header (a browser's request
goes the normal way, through the origin check), the answer is a canned 429 in the route's
API shape (OpenAI's error object, or Anthropic's), with `Retry-After` and
`connection: close`, counted as an `overloaded` refusal like any other and logged with one
access line whose id is `-` (no request id was ever given). Anything else
(`/health`, `/metrics`, a WebSocket upgrade, a partial head, another method) is handed to
hypercorn with the bytes already read, unchanged. While the queue has room no byte is read
here: the gate only looks at the admission books (an O(1) read) when a connection opens.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import trio
from hypercorn.events import RawData
from hypercorn.trio.tcp_server import MAX_RECV, TCPServer

from tqserve.api.gate_head import (MAX_HEAD_BYTES, body_complete, refusable_path,
                                   refusal_body, refusal_bytes)

__all__ = ["GatedTCPServer", "OverloadGate", "refusal_body", "refusal_bytes"]
access_log = logging.getLogger("tqserve.access")
DRAIN_SECONDS = 1.0  # how long an unread body is drained after the answer, before closing
DRAIN_BYTES = 1 << 20


class OverloadGate:
    """What a server tells its connections about overload. `reason()`: the refusal's
    message while the admission queue is full, else None; `on_refused()`: count one
    refusal; `api_key`: the key a refused request must carry (None: no key); `room()`:
    see __init__."""

    def __init__(self, reason: Callable[[], str | None], on_refused: Callable[[], None],
                 api_key: str | None,
                 room: Callable[[], tuple[int, str]] | None = None) -> None:
        self.reason = reason
        self.on_refused = on_refused
        self.api_key = api_key
        # requests admission takes now and the message once taken (-1: no gate); the
        # acceptor counts its hand-overs against it (api.handover); None: from `reason`
        self.room = room if room is not None else lambda: (0, r) if (r := reason()) else (1, "")

    def answer(self, head: bytes, opened: float) -> bytes | None:
        """The canned 429 for this request head, or None: hypercorn answers it."""
        path = refusable_path(head, self.api_key)
        reason = self.reason() if path is not None else None
        if path is None or reason is None:
            return None
        self.refused(path, (time.perf_counter() - opened) * 1000)
        return refusal_bytes(path, reason)

    def refused(self, path: bytes, total_ms: float) -> None:
        """Count and log one refusal (here, or in the acceptor process)."""
        self.on_refused()
        access_log.info("id=- route=POST %s status=429 outcome=overloaded prompt_tokens=- "
                        "completion_tokens=0 cached_tokens=- ttft_ms=- total_ms=%.1f",
                        path.decode("ascii", "replace"), total_ms)


class GatedTCPServer(TCPServer):
    """hypercorn's connection, with the gate of the module docstring in front."""

    _preread = b""

    async def run(self) -> None:
        gate: OverloadGate | None = getattr(self.config, "overload_gate", None)
        if gate is None or gate.reason() is None:
            await super().run()
            return
        opened = time.perf_counter()
        head, self._preread = self._preread, b""  # (what the acceptor process read)
        with trio.move_on_after(getattr(self.config, "header_timeout", 10.0)) as waited:
            try:
                while b"\r\n\r\n" not in head and len(head) < MAX_HEAD_BYTES:
                    chunk = await self.stream.receive_some(MAX_RECV)
                    if not chunk:
                        break
                    head += chunk
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                head = b""
        if waited.cancelled_caught:  # no complete head in --http-header-timeout: close
            await self.stream.aclose()
            return
        answer = gate.answer(head, opened)
        if answer is None:
            self._preread = head
            await super().run()
            return
        await self._refuse(answer, body_complete(head))

    async def _refuse(self, answer: bytes, body_read: bool) -> None:
        try:
            await self.stream.send_all(answer)
            if body_read:
                return
            await self.stream.send_eof()
            # closing with unread bytes would reset the connection under the answer: read
            # what the client still sends (its body) until it closes, for a bounded time
            with trio.move_on_after(DRAIN_SECONDS):
                drained = 0
                while drained < DRAIN_BYTES:
                    chunk = await self.stream.receive_some(MAX_RECV)
                    if not chunk:
                        break
                    drained += len(chunk)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass
        finally:
            await self.stream.aclose()

    async def _read_data(self) -> None:
        if self._preread:
            data, self._preread = self._preread, b""
            await self.protocol.handle(RawData(data))
        await super()._read_data()
