"""`response_format`: validate a request's structured-output form into an llguidance grammar.

Accepted shapes (OpenAI's, plus two of ours):

    {"type": "json_schema", "json_schema": {"name": str, "schema": {...},
                                            "strict": bool, "description": str}}
    {"type": "json_object"}                    any JSON object
    {"type": "regex", "pattern": str}          the whole output matches (Rust `regex` syntax)
    {"type": "grammar", "lark": str}           a Lark grammar (llguidance's dialect)
    {"type": "text"}  or  null                 no constraint

The library is llguidance: the grammar it compiles here is checked with
`LLMatcher.validate_grammar_with_warnings`, so a schema, regex or grammar it rejects is
a `ResponseFormatError` (a ValueError) naming the field path and the library's reason,
before any row exists. JSON is generated compactly (`", "` and `": "` separators, no other
whitespace) so that outputs end; a schema's own `"x-guidance"` options override that.
`strict: true` refuses schema keywords the library does not implement; otherwise such
keywords are ignored, as OpenAI's non-strict mode does (and not enforced).
"""

from __future__ import annotations

from typing import Any

import attrs
import llguidance

KINDS = ("json_schema", "json_object", "regex", "grammar", "text")
_JSON_DEFAULTS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_JSON_SCHEMA_FIELDS = frozenset(("name", "schema", "strict", "description"))
_FIELDS = {"json_schema": frozenset(("type", "json_schema")), "json_object": frozenset(("type",)),
           "regex": frozenset(("type", "pattern")), "grammar": frozenset(("type", "lark")),
           "text": frozenset(("type",))}
MAX_NAME_LENGTH = 64


class ResponseFormatError(ValueError):
    """A `response_format` the client got wrong; the message names the field path."""


@attrs.frozen(kw_only=True)
class ResponseFormat:
    """A validated constraint: its kind and the llguidance grammar (JSON text) to match."""

    kind: str = attrs.field(validator=attrs.validators.in_(KINDS[:-1]))
    grammar: str = attrs.field(validator=attrs.validators.instance_of(str))


def _fail(path: str, problem: str) -> ResponseFormatError:
    return ResponseFormatError(f"{path} {problem}")


def _string(obj: dict[str, Any], key: str, path: str) -> str:
    value = obj.get(key)
    if not isinstance(value, str) or not value:
        raise _fail(f"{path}.{key}", "must be a non-empty string")
    return value


def _checked(grammar: str, path: str) -> str:
    """The grammar, if llguidance accepts it; else the library's first error, at `path`."""
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        reason = messages[0].strip().splitlines()[0] if messages else "rejected"
        raise _fail(path, f"is rejected by the grammar library: {reason}")
    return grammar


def _json_schema(spec: Any) -> str:
    path = "response_format.json_schema"
    if not isinstance(spec, dict):
        raise _fail(path, "must be an object with a 'schema'")
    extra = set(spec) - _JSON_SCHEMA_FIELDS
    if extra:
        raise _fail(f"{path}.{sorted(extra, key=str)[0]}", "is not a known field")
    name = spec.get("name")
    if name is not None and (not isinstance(name, str) or len(name) > MAX_NAME_LENGTH):
        raise _fail(f"{path}.name", f"must be a string of at most {MAX_NAME_LENGTH} characters")
    if "description" in spec and not isinstance(spec["description"], str):
        raise _fail(f"{path}.description", "must be a string")
    strict = spec.get("strict", False)
    if strict is not None and not isinstance(strict, bool):
        raise _fail(f"{path}.strict", "must be true or false")
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise _fail(f"{path}.schema", "must be a JSON schema object")
    defaults = {**_JSON_DEFAULTS, "lenient": not strict}
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=defaults)
    except (ValueError, TypeError) as exc:
        raise _fail(f"{path}.schema", f"is not valid JSON: {exc}") from None
    return _checked(grammar, f"{path}.schema")


def validate_response_format(obj: Any) -> ResponseFormat | None:
    """Validate a `response_format` value; None means unconstrained (null or type text).

    Raises ResponseFormatError naming the field path for anything invalid, including a
    schema, regex or grammar that llguidance rejects."""
    if obj is None:
        return None
    if not isinstance(obj, dict):
        raise _fail("response_format", "must be an object with a 'type'")
    kind = obj.get("type")
    if kind not in KINDS:
        raise _fail("response_format.type", f"must be one of {', '.join(KINDS)}, got {kind!r}")
    extra = set(obj) - _FIELDS[kind]
    if extra:
        raise _fail(f"response_format.{sorted(extra, key=str)[0]}",
                    f"is not a field of type {kind!r}")
    if kind == "text":
        return None
    if kind == "json_schema":
        grammar = _json_schema(obj.get("json_schema"))
    elif kind == "json_object":
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            {"type": "object"}, defaults=_JSON_DEFAULTS)
    elif kind == "regex":
        pattern = _string(obj, "pattern", "response_format")
        grammar = _checked(llguidance.LLMatcher.grammar_from_regex(pattern),
                           "response_format.pattern")
    else:
        lark = _string(obj, "lark", "response_format")
        grammar = _checked(llguidance.LLMatcher.grammar_from_lark(lark), "response_format.lark")
    return ResponseFormat(kind=kind, grammar=grammar)
