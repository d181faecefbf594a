"""The Responses API's output: items built from api.chatout deltas, and their events.

Items, in the order the model wrote them: `reasoning` (a `<think>` span, as
`reasoning_text` content), `message` (the text, one `output_text` part) and
`function_call` (one per call, `call_id` the id a later `function_call_output` names).
`OutputItems.deltas` returns the stream's events (objects: SSE or WebSocket frames carry
them) for new deltas: output_item.added, then
content_part.added and output_text.delta / reasoning_text.delta for text, or
function_call_arguments.delta and .done for a call, then content_part.done and
output_item.done when the item ends. Every event has the next `sequence_number`.
"""

from __future__ import annotations

from typing import Any

from tqserve.api.chatout import Delta
from tqserve.api.httpcommon import new_id


class OutputItems:
    """One response's output items and their stream events."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self.sequence = -1
        self._open: dict[str, Any] | None = None  # a message or reasoning item in progress
        self._text = ""

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self.sequence += 1
        return {"type": kind, "sequence_number": self.sequence, **fields}

    def _where(self) -> dict[str, Any]:
        return {"item_id": self._open["id"], "output_index": len(self.items) - 1,
                "content_index": 0}

    def _part(self) -> dict[str, Any]:
        if self._open["type"] == "message":
            return {"type": "output_text", "text": self._text, "annotations": [],
                    "logprobs": []}
        return {"type": "reasoning_text", "text": self._text}

    def _start(self, kind: str) -> list[dict[str, Any]]:
        if kind == "message":
            item = {"id": new_id("msg_"), "type": "message", "role": "assistant",
                    "status": "in_progress", "content": []}
        else:
            item = {"id": new_id("rs_"), "type": "reasoning", "summary": [], "content": []}
        self._open, self._text = item, ""
        self.items.append(item)
        out = [self.event("response.output_item.added", output_index=len(self.items) - 1,
                          item=dict(item))]
        return out + [self.event("response.content_part.added", **self._where(),
                                 part=self._part())]

    def _stop(self) -> list[dict[str, Any]]:
        if self._open is None:
            return []
        item, where, part = self._open, self._where(), self._part()
        text_kind = "output_text" if item["type"] == "message" else "reasoning_text"
        done = {"logprobs": []} if text_kind == "output_text" else {}
        out = [self.event(f"response.{text_kind}.done", **where, text=self._text, **done),
               self.event("response.content_part.done", **where, part=part)]
        item["content"] = [part]
        if item["type"] == "message":
            item["status"] = "completed"
        self._open = None
        return out + [self.event("response.output_item.done", output_index=where[
            "output_index"], item=item)]

    def _call(self, d: Delta) -> list[dict[str, Any]]:
        call = d.call
        item = {"id": new_id("fc_"), "type": "function_call", "call_id": call.id,
                "name": call.name, "arguments": "", "status": "in_progress"}
        self.items.append(item)
        index = len(self.items) - 1
        out = [self.event("response.output_item.added", output_index=index, item=dict(item)),
               self.event("response.function_call_arguments.delta", item_id=item["id"],
                          output_index=index, delta=call.arguments),
               self.event("response.function_call_arguments.done", item_id=item["id"],
                          output_index=index, arguments=call.arguments, name=call.name)]
        item.update(arguments=call.arguments, status="completed")
        return out + [self.event("response.output_item.done", output_index=index, item=item)]

    def deltas(self, deltas: list[Delta]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for d in deltas:
            if d.kind == "call":
                out += self._stop() + self._call(d)
                continue
            kind = "message" if d.kind == "content" else "reasoning"
            if self._open is None or self._open["type"] != kind:
                out += self._stop() + self._start(kind)
            self._text += d.text
            text_kind = "output_text" if kind == "message" else "reasoning_text"
            extra = {"logprobs": []} if kind == "message" else {}
            out.append(self.event(f"response.{text_kind}.delta", **self._where(),
                                  delta=d.text, **extra))
        return out

    def close(self, deltas: list[Delta]) -> list[dict[str, Any]]:
        """The last deltas and the open item's end; an empty message if nothing came."""
        out = self.deltas(deltas)
        if not self.items:
            out += self._start("message")
        return out + self._stop()
