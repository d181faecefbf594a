"""`response_format`: validate a request's structured-output form into an llguidance grammar.

Accepted shapes (OpenAI's, plus two of ours):

    {"type": "json_schema", "json_schema": {"name": str, "schema": {...},
                                            "strict": bool, "description": str}}
    {"type": "json_object"}                    any JSON object
    {"type": "regex", "pattern": str}          the whole output matches (Rust `regex` syntax)
    {"type": "grammar", "lark": str}           a Lark grammar (llguidance's dialect)
    {"type": "text"}  or  null                 no constraint

Two stages. `check_response_format` checks the shape and the size in Python, cheaply and
without recursion (at most MAX_GRAMMAR_RULES Lark rules, MAX_SCHEMA_DEFS schema
definitions, MAX_NESTING levels of nesting: past them llguidance's native compilers
overflow a thread's stack, issue 20), giving a `FormatSource`. `compile_format` runs
llguidance on it: the grammar is checked with `LLMatcher.validate_grammar_with_warnings`,
so a schema, regex or grammar it rejects is a `ResponseFormatError` (a ValueError) naming
the field path and the library's reason, before any row exists. Untrusted input is
compiled on a `worker.BigStackExecutor` thread, never on the event loop (actors.engine);
`validate_response_format` does both stages where it is called. JSON is generated compactly (`", "` and `": "` separators, no other
whitespace) so that outputs end; a schema's own `"x-guidance"` options override that.
`strict: true` refuses schema keywords the library does not implement; otherwise such
keywords are ignored, as OpenAI's non-strict mode does (and not enforced).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import re

import attrs
import llguidance

if TYPE_CHECKING:  # a TypedDict of the stub only
    from llguidance._lib import JsonCompileOptions

KINDS = ("json_schema", "json_object", "regex", "grammar", "text")
_JSON_DEFAULTS: JsonCompileOptions = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_JSON_SCHEMA_FIELDS = frozenset(("name", "schema", "strict", "description"))
_FIELDS = {"json_schema": frozenset(("type", "json_schema")), "json_object": frozenset(("type",)),
           "regex": frozenset(("type", "pattern")), "grammar": frozenset(("type", "lark")),
           "text": frozenset(("type",))}
MAX_NAME_LENGTH = 64
# Bounds on what one response_format may hold (issue 20: a 3,000-rule Lark chain and a
# 1,000-$defs chain overflowed an 8 MiB native stack; on the 64 MiB stacks of
# worker.BigStackExecutor 3,000 of either compile, in 0.05 and 0.2 s).
MAX_GRAMMAR_RULES = 1000
MAX_SCHEMA_DEFS = 1000
MAX_NESTING = 100  # JSON levels of a schema; brackets of a Lark grammar
MAX_REGEX_CHARS = 16384  # the regex crate bounds its own nesting (250) and program size
_RULE = re.compile(r"\s*[?!]?[A-Za-z_][A-Za-z_0-9]*(\.-?\d+)?\s*:")


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


@attrs.frozen(kw_only=True)
class FormatSource:
    """A response_format checked for shape and size, not yet compiled: its kind and what
    llguidance compiles (a JSON schema with its strictness, a regex or a Lark grammar)."""

    kind: str = attrs.field(validator=attrs.validators.in_(KINDS[:-1]))
    source: Any = None
    strict: bool = False


def _schema_spec(spec: Any) -> tuple[dict[str, Any], bool]:
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
    _check_schema_size(schema, f"{path}.schema")
    return schema, bool(strict)


def _check_schema_size(schema: dict[str, Any], path: str) -> None:
    """At most MAX_NESTING levels and MAX_SCHEMA_DEFS definitions ($defs, definitions),
    walked iteratively (a deep document must not recurse here either)."""
    stack: list[tuple[Any, int]] = [(schema, 1)]
    num_defs = 0
    while stack:
        node, depth = stack.pop()
        if depth > MAX_NESTING:
            raise _fail(path, f"nests deeper than {MAX_NESTING} levels (the server's limit)")
        if isinstance(node, dict):
            for key in ("$defs", "definitions"):
                if isinstance(node.get(key), dict):
                    num_defs += len(node[key])
            if num_defs > MAX_SCHEMA_DEFS:
                raise _fail(path, f"holds more than {MAX_SCHEMA_DEFS} definitions ($defs) "
                                  "(the server's limit)")
            stack.extend((v, depth + 1) for v in node.values())
        elif isinstance(node, list):
            stack.extend((v, depth + 1) for v in node)


def _check_lark_size(lark: str, path: str) -> None:
    """At most MAX_GRAMMAR_RULES rule definitions and MAX_NESTING open brackets outside
    string and regex literals."""
    rules = sum(1 for line in lark.splitlines() if _RULE.match(line))
    if rules > MAX_GRAMMAR_RULES:
        raise _fail(path, f"defines {rules} rules, more than {MAX_GRAMMAR_RULES} (the server's "
                          "limit)")
    depth = deepest = 0
    quote = None
    escaped = False
    for ch in lark:
        if quote is not None:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == quote or ch == "\n":
                quote = None
        elif ch in "\"/":
            quote = ch
        elif ch in "([{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in ")]}":
            depth -= 1
    if deepest > MAX_NESTING:
        raise _fail(path, f"nests brackets deeper than {MAX_NESTING} levels (the server's "
                          "limit)")


def check_response_format(obj: Any) -> FormatSource | None:
    """Check a `response_format` value's shape and size; None means unconstrained (null
    or type text). Raises ResponseFormatError naming the field path. No llguidance here."""
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
        schema, strict = _schema_spec(obj.get("json_schema"))
        return FormatSource(kind=kind, source=schema, strict=strict)
    if kind == "json_object":
        return FormatSource(kind=kind)
    if kind == "regex":
        pattern = _string(obj, "pattern", "response_format")
        if len(pattern) > MAX_REGEX_CHARS:
            raise _fail("response_format.pattern",
                        f"is longer than {MAX_REGEX_CHARS} characters (the server's limit)")
        return FormatSource(kind=kind, source=pattern)
    lark = _string(obj, "lark", "response_format")
    _check_lark_size(lark, "response_format.lark")
    return FormatSource(kind=kind, source=lark)


def compile_format(src: FormatSource) -> ResponseFormat:
    """The llguidance grammar of a checked response_format; ResponseFormatError naming the
    field if the library rejects it. Call it on a BigStackExecutor thread for untrusted
    input (the module doc)."""
    if src.kind == "json_schema":
        path = "response_format.json_schema.schema"
        defaults: JsonCompileOptions = {**_JSON_DEFAULTS, "lenient": not src.strict}
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(src.source, defaults=defaults)
        except (ValueError, TypeError) as exc:
            raise _fail(path, f"is not valid JSON: {exc}") from None
        grammar = _checked(grammar, path)
    elif src.kind == "json_object":
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            {"type": "object"}, defaults=_JSON_DEFAULTS)
    elif src.kind == "regex":
        grammar = _checked(llguidance.LLMatcher.grammar_from_regex(src.source),
                           "response_format.pattern")
    else:
        grammar = _checked(llguidance.LLMatcher.grammar_from_lark(src.source),
                           "response_format.lark")
    return ResponseFormat(kind=src.kind, grammar=grammar)


def validate_response_format(obj: Any) -> ResponseFormat | None:
    """Check and compile a `response_format` on the calling thread (trusted input, tests,
    tools); None means unconstrained. Raises ResponseFormatError naming the field path."""
    src = check_response_format(obj)
    return compile_format(src) if src is not None else None
