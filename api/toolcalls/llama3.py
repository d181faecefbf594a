"""Llama 3.1-3.3: `{"name": ..., "parameters": {...}}` as the whole output, or after
`<|python_tag|>`; several calls are separated by `;`. A call runs to the output's end."""

from __future__ import annotations

import json
from typing import Any

from tqserve.api.toolcalls.hermes import call_schema

NAME = "llama3"
START = "<|python_tag|>"
END: str | None = None
BARE_JSON = True  # an output that opens with `{` is read as calls (as vLLM's llama3_json)


def parse(body: str, schemas: dict[str, dict[str, Any]]) -> list[tuple[str, Any]]:
    """One or more JSON call objects, `;`-separated."""
    decoder = json.JSONDecoder()
    calls = []
    rest = body.strip()
    while rest:
        obj, end = decoder.raw_decode(rest)
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            raise ValueError("a call must be an object with a name")
        calls.append((obj["name"], obj.get("parameters", obj.get("arguments", {}))))
        rest = rest[end:].strip()
        if rest.startswith(";"):
            rest = rest[1:].strip()
        elif rest:
            raise ValueError("text after a call")
    if not calls:
        raise ValueError("no call")
    return calls


def grammar(schemas: dict[str, dict[str, Any]]) -> str:
    """Lark forcing one bare JSON call (the form Llama 3's templates ask for)."""
    return f"start: call\ncall: %json {json.dumps(call_schema(schemas, 'parameters'))}\n"
