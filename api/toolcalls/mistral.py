"""Mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (v3 tokenizers) or
`[TOOL_CALLS]name[ARGS]{...}` (v11+), repeated for parallel calls; runs to the end."""

from __future__ import annotations

import json
from typing import Any

from tqserve.api.toolcalls.hermes import call_schema

NAME = "mistral"
START = "[TOOL_CALLS]"
END: str | None = None
_ARGS = "[ARGS]"


def _one(part: str) -> list[tuple[str, Any]]:
    if part.startswith(("[", "{")):
        obj = json.loads(part)
        items = obj if isinstance(obj, list) else [obj]
        if not items or not all(isinstance(c, dict) and isinstance(c.get("name"), str)
                                for c in items):
            raise ValueError("calls must be objects with a name")
        return [(c["name"], c.get("arguments", {})) for c in items]
    name, sep, args = part.partition(_ARGS)
    if not sep or not name.strip().isidentifier():
        raise ValueError("a call is name[ARGS]{...}")
    return [(name.strip(), json.loads(args))]


def parse(body: str, schemas: dict[str, dict[str, Any]]) -> list[tuple[str, Any]]:
    """Every call after the marker (a later marker starts another one)."""
    calls = []
    for part in body.split(START):
        if part.strip():
            calls.extend(_one(part.strip()))
    if not calls:
        raise ValueError("no call")
    return calls


def grammar(schemas: dict[str, dict[str, Any]]) -> str:
    """Lark forcing `[TOOL_CALLS]` and a list of one call."""
    return ('start: "[TOOL_CALLS][" call "]"\n'
            f"call: %json {json.dumps(call_schema(schemas))}\n")
