"""The overload gate's reading of a raw request head, and its canned 429 (api.overload).

Pure functions on bytes, importing nothing outside the standard library, so that the
acceptor process (api.acceptor) starts in milliseconds. A head the gate may refuse is a
complete request head of

    POST /v1/completions | /v1/chat/completions | /v1/messages | /v1/responses

in HTTP/1.x, with well-formed header lines, no `Origin` header (a browser's request goes
the normal way, through the origin check) and the server's key when it has one (the same
rule as the server's routes, `presented_key`: `Authorization: Bearer <key>` or
`x-api-key: <key>`).
"""

from __future__ import annotations

import hmac
import json
from typing import Any

GENERATION_PATHS = frozenset((b"/v1/completions", b"/v1/chat/completions", b"/v1/messages",
                              b"/v1/responses"))
MAX_HEAD_BYTES = 16384  # a head longer than this goes the normal way (h11 has its limits)
RETRY_AFTER_SECONDS = 1  # what a 429 tells clients to wait: admission frees within a step


def head_complete(data: bytes) -> bool:
    """Whether `data` holds a whole request head (or more than a head may be)."""
    return b"\r\n\r\n" in data or len(data) >= MAX_HEAD_BYTES


def refusable_path(head: bytes, api_key: str | None) -> bytes | None:
    """The generation path of a head the gate may refuse (the module docstring), or None:
    the request goes the normal way."""
    line_end = head.find(b"\r\n")
    head_end = head.find(b"\r\n\r\n")
    if line_end < 0 or head_end < 0:
        return None
    parts = head[:line_end].split(b" ")
    path = parts[1].split(b"?", 1)[0] if len(parts) == 3 else b""
    if parts[0] != b"POST" or not parts[-1].startswith(b"HTTP/1.") or (
            path not in GENERATION_PATHS):
        return None
    headers = parse_headers(head[line_end + 2:head_end])
    if headers is None or b"origin" in headers or not _key_ok(api_key, headers):
        return None
    return path


def presented_key(authorization: str | None, x_api_key: str | None) -> str | None:
    """The key a request carries, from these two headers' values: `Authorization: Bearer
    KEY`, else `x-api-key` (the one rule: api.auth uses it too)."""
    auth = authorization or ""
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip()
    return x_api_key


def key_matches(expected: str, given: str | None) -> bool:
    """Whether `given` is the key `expected` (compared in constant time)."""
    return given is not None and hmac.compare_digest(given.encode("utf-8"),
                                                     expected.encode("utf-8"))


def _key_ok(api_key: str | None, headers: dict[bytes, bytes]) -> bool:
    if api_key is None:
        return True
    values = [headers.get(name) for name in (b"authorization", b"x-api-key")]
    return key_matches(api_key, presented_key(
        *(v.decode("latin-1") if v is not None else None for v in values)))


def parse_headers(block: bytes) -> dict[bytes, bytes] | None:
    """Header names (lower case) to values; None for a line that is not a header."""
    headers: dict[bytes, bytes] = {}
    for line in block.split(b"\r\n") if block else ():
        name, sep, value = line.partition(b":")
        if not sep or not name or name != name.strip():
            return None
        headers[name.lower()] = value.strip()
    return headers


def body_complete(head: bytes) -> bool:
    """Whether these bytes hold the whole request: its head and Content-Length bytes."""
    end = head.find(b"\r\n\r\n")
    headers = parse_headers(head[head.find(b"\r\n") + 2:end]) or {}
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
