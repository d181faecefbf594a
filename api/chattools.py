"""Chat requests with tools (OpenAI's shape): `tools`, `tool_choice`, the history.

`tools` is a list of `{"type": "function", "function": {"name", "description",
"parameters"}}`; `tool_choice` is "auto" (the default with tools: the model decides, its
calls are parsed), "none" (the tools are not shown and nothing is parsed), "required" or
`{"type": "function", "function": {"name": ...}}` (one call is forced with the template
family's grammar, api.toolcalls, so even a small model writes a call matching the
schema). History messages may be assistant messages with `tool_calls` (content null) and
`tool` messages with `tool_call_id`; arguments are handed to the template as objects, as
chat templates expect.
"""

from __future__ import annotations

import json
from types import ModuleType
from typing import Any

import attrs

from tqserve.api.httpcommon import ApiError, Body, text_of_content
from tqserve.api.toolcalls import family_of, schemas_of

CHAT_ROLES = {"system": "system", "developer": "system", "user": "user",
              "assistant": "assistant", "tool": "tool"}
CHOICES = ("none", "auto", "required")


@attrs.frozen(kw_only=True)
class ToolPlan:
    """What a request's tools mean for its prompt and its output."""

    tools: tuple[dict[str, Any], ...] | None  # rendered by the template (None: none)
    family: ModuleType | None                 # parse calls with it (None: no parsing)
    schemas: dict[str, dict[str, Any]]        # function name -> parameters schema
    forced: str | None                        # Lark grammar forcing one call, or None

    @property
    def parses(self) -> bool:
        return self.family is not None


def _tool(i: int, tool: Any) -> dict[str, Any]:
    where = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type", "function") != "function":
        raise ApiError(400, f'{where} must be {{"type": "function", "function": {{...}}}}',
                       "tools")
    fn = tool.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise ApiError(400, f"{where}.function.name must be a non-empty string", "tools")
    params = fn.get("parameters")
    if params is not None and not isinstance(params, dict):
        raise ApiError(400, f"{where}.function.parameters must be a JSON schema object",
                       "tools")
    return {"type": "function", "function": {k: fn[k] for k in
                                             ("name", "description", "parameters") if k in fn}}


def _choice(value: Any, names: list[str]) -> str:
    """"none", "auto", "required" or the forced function's name."""
    if value is None:
        return "auto" if names else "none"
    if isinstance(value, str):
        if value not in CHOICES:
            raise ApiError(400, f"tool_choice must be one of {', '.join(CHOICES)} or a "
                                f"named function, got {value!r}", "tool_choice")
        if value == "required" and not names:
            raise ApiError(400, "tool_choice required needs tools", "tool_choice")
        return value
    fn = value.get("function") if isinstance(value, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise ApiError(400, 'tool_choice must be {"type": "function", "function": '
                            '{"name": ...}}', "tool_choice")
    if name not in names:
        raise ApiError(400, f"tool_choice names {name!r}, which is not in tools", "tool_choice")
    return "=" + name


def plan_tools(raw_tools: list[Any] | None, raw_choice: Any, template: str | None,
               ) -> ToolPlan:
    """A request's tools and tool_choice, checked (ApiError naming the field)."""
    tools = [_tool(i, t) for i, t in enumerate(raw_tools or ())]
    names = [t["function"]["name"] for t in tools]
    choice = _choice(raw_choice, names)
    if choice == "none" or not tools:
        return ToolPlan(tools=None, family=None, schemas={}, forced=None)
    family = family_of(template)
    schemas = schemas_of(tools)
    forced = None
    if choice == "required":
        forced = family.grammar(schemas)
    elif choice.startswith("="):
        forced = family.grammar({choice[1:]: schemas[choice[1:]]})
    return ToolPlan(tools=tuple(tools), family=family, schemas=schemas, forced=forced)


def tools_error(exc: ApiError, plan: ToolPlan | None) -> ApiError:
    """A refusal of a forced call's grammar names `tools` (their schemas are at fault),
    not the response_format the client never sent."""
    if plan is None or plan.forced is None or exc.param != "response_format":
        return exc
    reason = exc.message.split(" is rejected by the grammar library: ", 1)[-1]
    return ApiError(exc.status, f"tools: a function's parameters schema is rejected by the "
                                f"grammar library: {reason}", "tools", exc.code)


def tool_plan(body: Body, template: str | None) -> ToolPlan:
    return plan_tools(body.get("tools", list), body.get("tool_choice", (str, dict)), template)


def _call_for_template(i: int, call: Any) -> dict[str, Any]:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ApiError(400, f"tool_calls[{i}] must be {{\"id\", \"type\": \"function\", "
                            f"\"function\": {{\"name\", \"arguments\"}}}}", "messages")
    args = fn.get("arguments", "{}")
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            pass  # the template gets the text as it came
    return {"id": call.get("id"), "type": "function",
            "function": {"name": fn["name"], "arguments": args}}


def chat_messages(raw: list[Any]) -> list[dict[str, Any]]:
    """OpenAI chat messages as the engine takes them (ApiError naming the message)."""
    messages = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict) or m.get("role") not in CHAT_ROLES:
            raise ApiError(400, f"messages[{i}].role must be one of "
                                f"{', '.join(CHAT_ROLES)}", "messages")
        out: dict[str, Any] = {"role": CHAT_ROLES[m["role"]]}
        calls = m.get("tool_calls")
        if calls is not None and m["role"] == "assistant":
            if not isinstance(calls, list):
                raise ApiError(400, f"messages[{i}].tool_calls must be an array", "messages")
            out["tool_calls"] = [_call_for_template(j, c) for j, c in enumerate(calls)]
        content = m.get("content")
        if content is None and out.get("tool_calls"):
            out["content"] = None
        else:
            out["content"] = text_of_content(content, f"messages[{i}].content")
        if m["role"] == "tool" and isinstance(m.get("tool_call_id"), str):
            out["tool_call_id"] = m["tool_call_id"]
        if isinstance(m.get("name"), str):
            out["name"] = m["name"]
        messages.append(out)
    return messages
