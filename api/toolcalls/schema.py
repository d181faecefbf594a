"""What every family shares: the parsed call, schemas, compact JSON for forcing grammars."""

from __future__ import annotations

import json
from typing import Any

import attrs


@attrs.frozen(kw_only=True)
class ToolCall:
    """One parsed call: its id, the function's name, the arguments as JSON text."""

    id: str
    name: str
    arguments: str


def schemas_of(tools: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Function name -> its parameters' JSON schema. A forced call holds the properties
    the schema names and no others (additionalProperties false unless it says otherwise),
    as OpenAI's strict mode, so that a small model's call ends."""
    out = {}
    for tool in tools:
        params = dict(tool["function"].get("parameters") or {"type": "object"})
        if params.get("type", "object") == "object":
            params.setdefault("additionalProperties", False)
            params.setdefault("properties", {})
        out[tool["function"]["name"]] = params
    return out


COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def compact(schema: dict[str, Any]) -> dict[str, Any]:
    """A schema for a forcing grammar's %json: compact JSON, so a call ends (no endless
    whitespace from a small model)."""
    return {**schema, "x-guidance": COMPACT}


def arguments_json(arguments: Any) -> str:
    """Arguments as the compact JSON text the APIs carry; a string is kept if it is JSON."""
    if isinstance(arguments, str):
        json.loads(arguments)  # ValueError: not JSON, the call is malformed
        return arguments
    if not isinstance(arguments, dict):
        raise ValueError("arguments must be an object")
    return json.dumps(arguments, ensure_ascii=False)
