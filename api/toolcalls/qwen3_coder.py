"""Qwen3-Coder (XML): `<tool_call>\n<function=name>\n<parameter=x>\nvalue\n</parameter>\n
</function>\n</tool_call>`. A value is raw text; it is read as JSON unless its schema
says string."""

from __future__ import annotations

import json
import re
from typing import Any

from tqserve.api.toolcalls.schema import compact

NAME = "qwen3_coder"
START = "<tool_call>"
END: str | None = "</tool_call>"
_FUNCTION = re.compile(r"<function=([^>\s]+)>(.*?)(?:</function>|\Z)", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\s]+)>(.*?)(?:</parameter>|(?=<parameter=)|\Z)",
                        re.DOTALL)


def _value(raw: str, schema: dict[str, Any]) -> Any:
    text = raw[1:] if raw.startswith("\n") else raw
    text = text[:-1] if text.endswith("\n") else text
    if schema.get("type") == "string":
        return text
    try:
        return json.loads(text)
    except ValueError:
        return text


def parse(body: str, schemas: dict[str, dict[str, Any]]) -> list[tuple[str, Any]]:
    """Every <function=...> block of the body."""
    calls = []
    for name, inner in _FUNCTION.findall(body):
        props = schemas.get(name, {}).get("properties", {})
        args = {key: _value(raw, props.get(key, {})) for key, raw in _PARAMETER.findall(inner)}
        calls.append((name, args))
    if not calls or _FUNCTION.sub("", body).strip():
        raise ValueError("a call is <function=name> with <parameter=...> blocks")
    return calls


def _lark_string(text: str) -> str:
    return json.dumps(text)


def grammar(schemas: dict[str, dict[str, Any]]) -> str:
    """Lark forcing one call; a string parameter is text without '<', others JSON."""
    lines = ['start: "<tool_call>\\n" fn "</tool_call>"',
             "fn: " + " | ".join(f"f{i}" for i in range(len(schemas))),
             "TEXT: /[^<]+/"]
    for i, (name, params) in enumerate(schemas.items()):
        parts = []
        required = set(params.get("required", ()))
        for j, (key, schema) in enumerate((params.get("properties") or {}).items()):
            value = "TEXT" if schema.get("type") == "string" else f"f{i}v{j}"
            if value != "TEXT":
                lines.append(f"f{i}v{j}: %json {json.dumps(compact(schema))}")
            lines.append(f'f{i}p{j}: {_lark_string(f"<parameter={key}>")} "\\n" {value} '
                         '"\\n</parameter>\\n"')
            parts.append(f"f{i}p{j}" + ("" if key in required else "?"))
        lines.append(f'f{i}: {_lark_string(f"<function={name}>")} "\\n" {" ".join(parts)} '
                     '"</function>\\n"')
    return "\n".join(lines) + "\n"
