"""Hermes / Qwen 2.5-3 / SmolLM: `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`."""

from __future__ import annotations

import json
from typing import Any

from tqserve.api.toolcalls.schema import compact

NAME = "hermes"
START = "<tool_call>"
END: str | None = "</tool_call>"
ARGUMENTS_KEY = "arguments"


def parse(body: str, schemas: dict[str, dict[str, Any]]) -> list[tuple[str, Any]]:
    """The call in one marker pair: a JSON object with name and arguments (or parameters)."""
    obj = json.loads(body)
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        raise ValueError("a call must be an object with a name")
    return [(obj["name"], obj.get("arguments", obj.get("parameters", {})))]


def call_schema(schemas: dict[str, dict[str, Any]], key: str = ARGUMENTS_KEY) -> dict[str, Any]:
    """JSON schema of one call object {name, <key>} to any of the functions."""
    return compact({"anyOf": [
        {"type": "object", "properties": {"name": {"const": name}, key: params},
         "required": ["name", key], "additionalProperties": False}
        for name, params in schemas.items()]})


def grammar(schemas: dict[str, dict[str, Any]]) -> str:
    """Lark forcing one call, markers included."""
    return ('start: "<tool_call>\\n" call "\\n</tool_call>"\n'
            f"call: %json {json.dumps(call_schema(schemas))}\n")
