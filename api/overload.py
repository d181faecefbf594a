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

import json
import logging
import time
from typing import Any, Callable

import trio
from hypercorn.events import RawData
from hypercorn.trio.tcp_server import MAX_RECV, TCPServer
from werkzeug.datastructures import Headers

from tqserve.api.auth import key_ok
from tqserve.api.httpconn import RETRY_AFTER_SECONDS

GENERATION_PATHS = frozenset((b"/v1/completions", b"/v1/chat/completions", b"/v1/messages",
                              b"/v1/responses"))
access_log = logging.getLogger("tqserve.access")
MAX_HEAD_BYTES = 16384  # a head longer than this goes the normal way (h11 has its limits)
DRAIN_SECONDS = 1.0  # how long an unread body is drained after the answer, before closing
DRAIN_BYTES = 1 << 20


class OverloadGate:
    """What a server tells its connections about overload. `reason()`: the refusal's
    message while the admission queue is full, else None; `on_refused()`: count one
    refusal; `api_key`: the key a refused request must carry (None: no key)."""

    def __init__(self, reason: Callable[[], str | None], on_refused: Callable[[], None],
                 api_key: str | None) -> None:
        self.reason = reason
        self.on_refused = on_refused
        self.api_key = api_key

    def answer(self, head: bytes, opened: float) -> bytes | None:
        """The canned 429 for this request head, or None: hypercorn answers it."""
        line_end = head.find(b"\r\n")
        head_end = head.find(b"\r\n\r\n")
        if line_end < 0 or head_end < 0:
            return None
        parts = head[:line_end].split(b" ")
        path = parts[1].split(b"?", 1)[0] if len(parts) == 3 else b""
        if parts[0] != b"POST" or not parts[-1].startswith(b"HTTP/1.") or (
                path not in GENERATION_PATHS):
            return None
        headers = _headers(head[line_end + 2:head_end])
        if headers is None or b"origin" in headers or not self._key_ok(headers):
            return None
        reason = self.reason()
        if reason is None:
            return None
        self.on_refused()
        access_log.info("id=- route=POST %s status=429 outcome=overloaded prompt_tokens=- "
                        "completion_tokens=0 cached_tokens=- ttft_ms=- total_ms=%.1f",
                        path.decode("ascii", "replace"), (time.perf_counter() - opened) * 1000)
        return refusal_bytes(path, reason)

    def _key_ok(self, headers: dict[bytes, bytes]) -> bool:
        """The server's own key check (api.auth.key_ok) on the raw head's headers."""
        if self.api_key is None:
            return True
        return key_ok(self.api_key, Headers([(k.decode("latin-1"), v.decode("latin-1"))
                                             for k, v in headers.items()]))


def _headers(block: bytes) -> dict[bytes, bytes] | None:
    """Header names (lower case) to values; None for a line that is not a header."""
    headers: dict[bytes, bytes] = {}
    for line in block.split(b"\r\n") if block else ():
        name, sep, value = line.partition(b":")
        if not sep or not name or name != name.strip():
            return None
        headers[name.lower()] = value.strip()
    return headers


def _body_complete(head: bytes) -> bool:
    """Whether these bytes hold the whole request: its head and Content-Length bytes."""
    end = head.find(b"\r\n\r\n")
    headers = _headers(head[head.find(b"\r\n") + 2:end]) or {}
    if b"transfer-encoding" in headers:
        return False
    length = headers.get(b"content-length", b"0")
    return length.isdigit() and len(head) - (end + 4) >= int(length)


def refusal_body(path: bytes, reason: str) -> bytes:
    """The 429's JSON body for `path`, in its API's error shape (Anthropic's for
    /v1/messages, else OpenAI's with code `overloaded`)."""
    if path.endswith(b"/v1/messages"):
        error: dict[str, Any] = {"type": "error", "error": {"type": "rate_limit_error",
                                                            "message": reason}}
    else:
        error = {"error": {"message": reason, "type": "rate_limit_exceeded", "param": None,
                           "code": "overloaded"}}
    return json.dumps(error).encode()


def refusal_bytes(path: bytes, reason: str) -> bytes:
    """The whole 429 answer for `path`, in its API's error shape."""
    body = refusal_body(path, reason)
    head = ["HTTP/1.1 429 Too Many Requests", "content-type: application/json",
            f"content-length: {len(body)}", f"retry-after: {RETRY_AFTER_SECONDS}",
            "connection: close"]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


class GatedTCPServer(TCPServer):
    """hypercorn's connection, with the gate of the module docstring in front."""

    _preread = b""

    async def run(self) -> None:
        gate: OverloadGate | None = getattr(self.config, "overload_gate", None)
        if gate is None or gate.reason() is None:
            await super().run()
            return
        opened = time.perf_counter()
        head = b""
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
        await self._refuse(answer, _body_complete(head))

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
