"""A chat output as the APIs report it: reasoning, content and tool calls.

`ChatOutput.feed(text)` takes the generated text in chunks of any size and returns
`Delta`s in order: `reasoning` (the text inside `<think>...</think>`, when the chat
template writes such spans), `content` (the rest) and `call` (a parsed tool call, from
api.toolcalls, when the request has tools). `finish()` returns what was held back (a
partial marker at the end, an unterminated call as text). Both APIs and the Responses
API build their fields and stream events from these deltas.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import attrs

from tqserve.api.toolcalls.schema import ToolCall
from tqserve.api.toolcalls.stream import ToolCallStream, held_back

THINK_START, THINK_END = "<think>", "</think>"


@attrs.frozen
class Delta:
    kind: str  # "content", "reasoning" or "call"
    text: str = ""
    call: ToolCall | None = None


class _ThinkSplit:
    """Splits `<think>` spans out of text: (is_reasoning, text) pairs."""

    def __init__(self) -> None:
        self.buffer = ""
        self.inside = False

    def feed(self, chunk: str) -> list[tuple[bool, str]]:
        self.buffer += chunk
        out = []
        while True:
            marker = THINK_END if self.inside else THINK_START
            index = self.buffer.find(marker)
            if index < 0:
                cut = len(self.buffer) - held_back(self.buffer, marker)
                if cut:
                    out.append((self.inside, self.buffer[:cut]))
                    self.buffer = self.buffer[cut:]
                return out
            if index:
                out.append((self.inside, self.buffer[:index]))
            self.buffer = self.buffer[index + len(marker):]
            self.inside = not self.inside

    def finish(self) -> list[tuple[bool, str]]:
        rest, self.buffer = self.buffer, ""
        return [(self.inside, rest)] if rest else []


class ChatOutput:
    """One chat output's splitter; `calls` and `reasoning` hold what was found."""

    def __init__(self, *, think: bool, family: ModuleType | None = None,
                 schemas: dict[str, dict[str, Any]] | None = None) -> None:
        self._think = _ThinkSplit() if think else None
        self._tools = ToolCallStream(family, schemas or {}) if family is not None else None
        self.reasoning = ""
        self.content = ""

    @property
    def calls(self) -> list[ToolCall]:
        return self._tools.calls if self._tools is not None else []

    def feed(self, text: str) -> list[Delta]:
        parts = self._think.feed(text) if self._think is not None else [(False, text)]
        return self._route(parts, final=False)

    def finish(self) -> list[Delta]:
        parts = self._think.finish() if self._think is not None else []
        return self._route(parts, final=True)

    def _route(self, parts: list[tuple[bool, str]], final: bool) -> list[Delta]:
        out: list[Delta] = []
        for reasoning, text in parts:
            if reasoning:
                self.reasoning += text
                out.append(Delta("reasoning", text))
            else:
                out.extend(self._content(self._tools.feed(text) if self._tools else [text]))
        if final and self._tools is not None:
            out.extend(self._content(self._tools.finish()))
        return [d for d in out if d.kind == "call" or d.text]

    def _content(self, pieces: list[str | ToolCall]) -> list[Delta]:
        out = []
        for piece in pieces:
            if isinstance(piece, ToolCall):
                out.append(Delta("call", call=piece))
            else:
                self.content += piece
                out.append(Delta("content", piece))
        return out
