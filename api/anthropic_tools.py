"""Anthropic Messages with tools and thinking: the request's blocks in, blocks out.

In: `tools` `[{"name", "description", "input_schema"}]`, `tool_choice` `{"type": "auto" |
"any" | "tool" (with "name") | "none"}`, message content blocks `text`, `tool_use` (an
assistant's call), `tool_result` (the user's answer to one, by `tool_use_id`), `thinking`
(an earlier turn's reasoning, handed to the template as reasoning_content); `thinking`
`{"type": "enabled" | "disabled", "budget_tokens"}` is accepted (the template decides).
Out: `thinking`, `text` and `tool_use` blocks from api.chatout's deltas; `stop_reason`
"tool_use" when the answer calls tools. Calls are parsed and forced exactly as for the
OpenAI API (api.chattools).
"""

from __future__ import annotations

import json
from typing import Any

from tqserve.api.chattools import ToolPlan, plan_tools
from tqserve.api.httpcommon import ApiError, Body, text_of_content
from tqserve.api.toolcalls.schema import ToolCall

_CHOICES = {"auto": "auto", "any": "required", "none": "none"}


def tool_plan(body: Body, template: str | None) -> ToolPlan:
    """Anthropic's tools and tool_choice mapped onto the OpenAI plan."""
    tools = []
    for i, tool in enumerate(body.get("tools", list, [])):
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
            raise ApiError(400, f"tools.{i}.name: a tool needs a name", "tools")
        schema = tool.get("input_schema", {"type": "object"})
        if not isinstance(schema, dict):
            raise ApiError(400, f"tools.{i}.input_schema must be a JSON schema object", "tools")
        tools.append({"type": "function", "function": {
            "name": tool["name"], "description": tool.get("description", ""),
            "parameters": schema}})
    raw = body.get("tool_choice", dict)
    choice: Any = None
    if raw is not None:
        kind = raw.get("type")
        if kind == "tool":
            choice = {"type": "function", "function": {"name": raw.get("name")}}
        elif kind in _CHOICES:
            choice = _CHOICES[kind]
        else:
            raise ApiError(400, "tool_choice.type must be auto, any, tool or none",
                           "tool_choice")
    return plan_tools(tools, choice, template)


def _result_text(block: dict[str, Any], where: str) -> str:
    content = block.get("content", "")
    return content if isinstance(content, str) else text_of_content(content, where)


def _message(i: int, m: dict[str, Any]) -> list[dict[str, Any]]:
    """One Anthropic message as engine messages (a user turn of tool results becomes one
    tool message per result)."""
    role, content = m["role"], m.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise ApiError(400, f"messages.{i}.content must be a string or a list of blocks",
                       "messages")
    text, reasoning, calls, results = [], [], [], []
    for j, block in enumerate(content):
        where = f"messages.{i}.content.{j}"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "tool_use" and role == "assistant":
            calls.append({"id": block.get("id"), "type": "function", "function": {
                "name": block.get("name"), "arguments": block.get("input", {})}})
        elif kind == "tool_result" and role == "user":
            results.append({"role": "tool", "tool_call_id": block.get("tool_use_id"),
                            "content": _result_text(block, where)})
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            reasoning.append(block.get("thinking", ""))
        else:
            text.append(text_of_content([block], where))
    out: list[dict[str, Any]] = results
    if role == "assistant":
        msg: dict[str, Any] = {"role": role, "content": "".join(text) or (None if calls else "")}
        if calls:
            msg["tool_calls"] = calls
        if reasoning:
            msg["reasoning_content"] = "".join(reasoning)
        out = out + [msg]
    elif text or not results:
        out = out + [{"role": role, "content": "".join(text)}]
    return out


def prompt_messages(body: Body) -> list[dict[str, Any]]:
    """`system` and `messages` as engine messages. A `system` message inside `messages`
    (Claude Code sends them) joins the system prompt: chat templates take one, first."""
    messages = []
    systems = []
    system = body.get("system", (str, list))
    if system is not None:
        systems.append(text_of_content(system, "system"))
    raw = body.get("messages", list, required=True)
    if not raw:
        raise ApiError(400, "messages must not be empty", "messages")
    for i, m in enumerate(raw):
        role = m.get("role") if isinstance(m, dict) else None
        if role == "system":
            systems.append(text_of_content(m.get("content"), f"messages.{i}.content"))
            continue
        if role not in ("user", "assistant"):
            raise ApiError(400, f"messages[{i}].role must be 'user', 'assistant' or "
                                "'system'", "messages")
        messages.extend(_message(i, m))
    if systems:
        messages.insert(0, {"role": "system", "content": "\n\n".join(systems)})
    thinking = body.get("thinking", dict)
    if thinking is not None and thinking.get("type") not in ("enabled", "disabled", "adaptive"):
        raise ApiError(400, "thinking.type must be enabled or disabled", "thinking")
    return messages


def tool_use_block(call: ToolCall) -> dict[str, Any]:
    return {"type": "tool_use", "id": "toolu_" + call.id.removeprefix("call_"),
            "name": call.name, "input": json.loads(call.arguments)}
