"""The Responses API's request side: `input` items to chat messages, tools, the store.

`input` is a string (one user message) or a list of items: messages `{"role", "content"}`
(content a string or `input_text` / `output_text` parts; `type: "message"` optional),
`function_call` `{"call_id", "name", "arguments"}` (consecutive ones become one assistant
turn) and `function_call_output` `{"call_id", "output"}`; `reasoning` items are an earlier
turn's thinking. `instructions` is a system message ahead of it all, for this response
only (as OpenAI: a previous response's instructions are not carried over). Tools are
`{"type": "function", "name", "description", "parameters"}`, tool_choice "auto", "none",
"required" or `{"type": "function", "name"}`.

`ResponseStore` keeps, per stored response id, the conversation it ended (messages with
its own output appended) and its JSON for GET; bounded (MAX_STORED, oldest dropped), in
this process only. `store: false` keeps nothing.
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from typing import Any

from tqserve.api.chattools import ToolPlan, plan_tools
from tqserve.api.httpcommon import IMAGE_PARTS, ApiError, Body

log = logging.getLogger("tqserve.api")
MAX_STORED = 512  # responses kept for previous_response_id: a working set of agent sessions
_TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "reasoning_text")
ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(400, f"{where} must be a string or a list of parts", "input")
    parts = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in IMAGE_PARTS or kind == "input_file":
            raise ApiError(400, f"{where}[{i}] is {kind}: this server serves a text-only "
                                "model", "input")
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise ApiError(400, f"{where}[{i}] must be an input_text part", "input")
        parts.append(part["text"])
    return "".join(parts)


def input_messages(value: Any) -> list[dict[str, Any]]:
    """`input` as engine chat messages (ApiError naming the item)."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list):
        raise ApiError(400, "input must be a string or a list of items", "input")
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message" and item.get("role") in ROLES:
            messages.append({"role": ROLES[item["role"]],
                             "content": _text(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function", "function": {
                "name": item.get("name"), "arguments": _arguments(item.get("arguments"))}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls"):
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                             "content": output if isinstance(output, str)
                             else _text(output, f"{where}.output")})
        elif kind == "reasoning":
            continue  # an earlier turn's thinking: templates drop it from the history
        else:
            raise ApiError(400, f"{where} must be a message, function_call or "
                                "function_call_output item", "input")
    return messages


def _arguments(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value) if value.strip() else {}
        except ValueError:
            return value
    return value


def responses_tool_plan(body: Body, template: str | None, strict: bool) -> ToolPlan:
    """Function tools (a `namespace` tool's functions too); other tool types (web_search,
    custom, local_shell, ...) are skipped with a warning, or refused under strict."""
    tools, skipped = [], []
    for i, tool in enumerate(_flat(body.get("tools", list, []))):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            if strict or not isinstance(kind, str):
                raise ApiError(400, f"tools[{i}] is of type {kind!r}: only function tools "
                                    "are served", "tools")
            skipped.append(kind)
            continue
        tools.append({"type": "function", "function": {
            k: tool[k] for k in ("name", "description", "parameters") if k in tool}})
    if skipped:
        log.warning("skipping tools this server does not run: %s", ", ".join(skipped))
    choice = body.get("tool_choice", (str, dict))
    if isinstance(choice, dict) and choice.get("type") == "function":
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    return plan_tools(tools, choice, template)


def _flat(tools: list[Any]) -> list[Any]:
    out = []
    for tool in tools:
        if isinstance(tool, dict) and tool.get("type") == "namespace":
            out.extend(tool.get("tools") or [])
        else:
            out.append(tool)
    return out


def merge_leading_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The system messages ahead of the first other one, joined into one (instructions and
    developer items: many chat templates take a single system message, first)."""
    n = 0
    while n < len(messages) and messages[n]["role"] == "system":
        n += 1
    if n < 2:
        return messages
    joined = "\n\n".join(m["content"] for m in messages[:n])
    return [{"role": "system", "content": joined}] + messages[n:]


def text_format(body: Body) -> dict[str, Any] | None:
    """`text.format` as a response_format: json_schema, json_object, text, or our regex
    and grammar forms (engine.structured.formats), passed through."""
    fmt = (body.get("text", dict) or {}).get("format")
    if fmt is None or not isinstance(fmt, dict) or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_schema":
        spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": spec}
    return dict(fmt)


class ResponseStore:
    """Stored responses: id -> (the conversation it ended, its JSON); bounded."""

    def __init__(self, capacity: int = MAX_STORED) -> None:
        self.capacity = capacity
        self._items: OrderedDict[str, tuple[list[dict[str, Any]], dict[str, Any]]] = \
            OrderedDict()

    def put(self, rid: str, messages: list[dict[str, Any]], response: dict[str, Any]) -> None:
        self._items[rid] = (messages, response)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def conversation(self, rid: str) -> list[dict[str, Any]]:
        """The messages a previous response ended with; ApiError 400 if not stored."""
        if rid not in self._items:
            raise ApiError(400, f"Previous response with id {rid!r} not found (responses "
                                f"are kept in this process, the last {self.capacity}, and "
                                "only with store: true)", "previous_response_id",
                           "previous_response_not_found")
        self._items.move_to_end(rid)
        return [dict(m) for m in self._items[rid][0]]

    def response(self, rid: str) -> dict[str, Any] | None:
        item = self._items.get(rid)
        return item[1] if item is not None else None

    def __len__(self) -> int:
        return len(self._items)
