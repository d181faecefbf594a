"""Gemma (FunctionGemma): `<start_function_call>call:name{key:<escape>text<escape>,n:3}
<end_function_call>`; strings sit between `<escape>` marks, other values are JSON."""

from __future__ import annotations

import json
import re
from typing import Any

from tqserve.api.toolcalls.schema import compact

NAME = "gemma"
START = "<start_function_call>"
END: str | None = "<end_function_call>"
ESCAPE = "<escape>"
_CALL = re.compile(r"\s*call:([A-Za-z_][\w.\-]*)\{(.*)\}\s*\Z", re.DOTALL)


def _arguments(text: str) -> dict[str, Any]:
    args: dict[str, Any] = {}
    rest = text
    while rest.strip():
        key, sep, rest = rest.partition(":")
        if not sep or not key.strip():
            raise ValueError("an argument is key:value")
        if rest.startswith(ESCAPE):
            value, sep, rest = rest[len(ESCAPE):].partition(ESCAPE)
            if not sep:
                raise ValueError("an <escape> string is not closed")
            args[key.strip()] = value
        else:
            value, end = json.JSONDecoder().raw_decode(rest)
            args[key.strip()] = value
            rest = rest[end:]
        rest = rest.lstrip()
        if rest and not rest.startswith(","):
            raise ValueError("arguments are separated by ','")
        rest = rest[1:]
    return args


def parse(body: str, schemas: dict[str, dict[str, Any]]) -> list[tuple[str, Any]]:
    """The one call between the markers."""
    match = _CALL.match(body)
    if match is None:
        raise ValueError("a call is call:name{...}")
    return [(match.group(1), _arguments(match.group(2)))]


def grammar(schemas: dict[str, dict[str, Any]]) -> str:
    """Lark forcing one call: every property in schema order, required ones present."""
    lines = ['start: "<start_function_call>call:" fn "<end_function_call>"',
             "fn: " + " | ".join(f"f{i}" for i in range(len(schemas))),
             "TEXT: /[^<]*/"]
    for i, (name, params) in enumerate(schemas.items()):
        props = list((params.get("properties") or {}).items())
        items = []
        for j, (key, schema) in enumerate(props):
            if schema.get("type") == "string":
                value = f'"{ESCAPE}" TEXT "{ESCAPE}"'
            else:
                lines.append(f"f{i}v{j}: %json {json.dumps(compact(schema))}")
                value = f"f{i}v{j}"
            items.append(f'{json.dumps(key + ":")} {value}')
        body = ' "," '.join(items)  # every property, in order (optional ones too)
        lines.append(f'f{i}: {json.dumps(name + "{")} {body} "}}"')
    return "\n".join(lines) + "\n"
