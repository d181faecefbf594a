"""Anthropic content blocks from api.chatout deltas: whole (`content_blocks`) or as the
stream's block events (`BlockStream`): content_block_start, then `thinking_delta`,
`text_delta` or one `input_json_delta` (a tool_use block's whole input), then
content_block_stop, one block at a time with increasing `index`. A `ping` follows the
first block's start, as Anthropic sends it; an output with no text still has one
(empty) text block.
"""

from __future__ import annotations

import json
from typing import Any

from tqserve.api.anthropic_tools import tool_use_block
from tqserve.api.chatout import ChatOutput, Delta
from tqserve.api.httpcommon import sse


def content_blocks(out: ChatOutput) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if out.reasoning:
        blocks.append({"type": "thinking", "thinking": out.reasoning, "signature": ""})
    if out.content or not out.calls:
        blocks.append({"type": "text", "text": out.content})
    return blocks + [tool_use_block(c) for c in out.calls]


class BlockStream:
    """The block events of one streamed message."""

    def __init__(self) -> None:
        self.index = -1
        self.open: str | None = None  # the kind of the block open now

    def _start(self, block: dict[str, Any]) -> list[bytes]:
        self.index += 1
        self.open = block["type"]
        out = [sse({"type": "content_block_start", "index": self.index,
                    "content_block": block}, "content_block_start")]
        if self.index == 0:
            out.append(sse({"type": "ping"}, "ping"))
        return out

    def _stop(self) -> list[bytes]:
        if self.open is None:
            return []
        self.open = None
        return [sse({"type": "content_block_stop", "index": self.index},
                    "content_block_stop")]

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return sse({"type": "content_block_delta", "index": self.index, "delta": delta},
                   "content_block_delta")

    def deltas(self, deltas: list[Delta]) -> list[bytes]:
        out: list[bytes] = []
        for d in deltas:
            if d.kind == "call":
                block = tool_use_block(d.call)
                out += self._stop() + self._start({**block, "input": {}})
                out.append(self._delta({"type": "input_json_delta",
                                        "partial_json": json.dumps(block["input"])}))
                out += self._stop()
                continue
            kind = "thinking" if d.kind == "reasoning" else "text"
            if self.open != kind:
                start = {"type": kind, kind: ""} if kind == "text" else \
                    {"type": "thinking", "thinking": "", "signature": ""}
                out += self._stop() + self._start(start)
            out.append(self._delta({"type": f"{kind}_delta", kind: d.text}))
        return out

    def close(self, deltas: list[Delta]) -> list[bytes]:
        """The last deltas, an empty text block if there was none, the last stop."""
        out = self.deltas(deltas)
        if self.index < 0:
            out += self._start({"type": "text", "text": ""})
        return out + self._stop()
