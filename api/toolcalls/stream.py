"""Split an output, fed in chunks of any size, into text and tool calls.

`ToolCallStream.feed(chunk)` returns what is known so far, in order: text (a str) and
calls (`ToolCall`). Text that could be the start of a call marker is held back until the
next chunk says whether it is one; a call is returned once its end marker arrives (or at
`finish`, for families whose calls run to the output's end). A call that does not parse
(bad JSON, an unknown format, no end marker) comes back as the text it was, markers
included, so a malformed call is the model's text, never an error.
"""

from __future__ import annotations

import uuid
from types import ModuleType
from typing import Any

from tqserve.api.toolcalls.schema import ToolCall, arguments_json

Piece = str | ToolCall


def held_back(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ToolCallStream:
    """One output's splitter for one family (api.toolcalls); `calls` lists those found."""

    def __init__(self, family: ModuleType, schemas: dict[str, dict[str, Any]]) -> None:
        self.family = family
        self.schemas = schemas
        self.calls: list[ToolCall] = []
        self._buffer = ""  # text not yet returned (TEXT) or the call's body so far (CALL)
        self._in_call = False
        self._started = False  # any non-blank text seen (for BARE_JSON families)
        self._bare = False  # the call opened with `{`, no marker (BARE_JSON)

    def feed(self, chunk: str) -> list[Piece]:
        self._buffer += chunk
        out: list[Piece] = []
        while self._step(out):
            pass
        return out

    def finish(self) -> list[Piece]:
        """The rest: a call running to the end is parsed, held text is returned."""
        out: list[Piece] = []
        if self._in_call:
            self._close(self._buffer, out, closed=self.family.END is None)
        elif self._buffer:
            out.append(self._buffer)
        self._buffer = ""
        self._in_call = False
        return [p for p in out if p != ""]

    def _step(self, out: list[Piece]) -> bool:
        """Advance over the buffer once; True when another step may find more."""
        start, end = self.family.START, self.family.END
        if self._in_call:
            if end is None or end not in self._buffer:
                return False
            body, _, self._buffer = self._buffer.partition(end)
            self._close(body, out, closed=True)
            return True
        if not self._started and getattr(self.family, "BARE_JSON", False):
            blank = self._buffer.lstrip()
            if not blank:
                return False
            self._started = True
            if blank.startswith("{"):
                self._in_call, self._bare = True, True
                self._buffer = blank
                return True
        self._started = self._started or bool(self._buffer.strip())
        index = self._buffer.find(start)
        if index < 0:
            keep = held_back(self._buffer, start)
            cut = len(self._buffer) - keep
            if cut:
                out.append(self._buffer[:cut])
                self._buffer = self._buffer[cut:]
            return False
        if index:
            out.append(self._buffer[:index])
        self._buffer = self._buffer[index + len(start):]
        self._in_call, self._bare = True, False
        return True

    def _close(self, body: str, out: list[Piece], closed: bool) -> None:
        """A call's body is complete: its calls, or its text where it does not parse."""
        self._in_call = False
        try:
            if not closed:
                raise ValueError("the call has no end marker")
            parsed = self.family.parse(body, self.schemas)
            calls = [ToolCall(id=self._new_id(), name=name, arguments=arguments_json(args))
                     for name, args in parsed]
        except (ValueError, TypeError, AttributeError):
            head = "" if self._bare else self.family.START
            tail = self.family.END if closed and self.family.END else ""
            out.append(head + body + tail)
            return
        self.calls.extend(calls)
        out.extend(calls)

    def _new_id(self) -> str:
        return f"call_{uuid.uuid4().hex[:24]}"
