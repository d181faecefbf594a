"""response_format validation: every shape, every refusal names its field path."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from tqserve.api.protocol import ProtocolError, parse_command
from tqserve.engine.request import GenerateRequest
from tqserve.engine.sampling import RowSampler, SamplingParams, apply_token_masks, sample_rows
from tqserve.engine.structured import (ResponseFormat, ResponseFormatError, compile_format,
                                       validate_response_format)

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize("obj, kind", [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}},
     "json_schema"),
    ({"type": "json_schema", "json_schema": {"schema": SCHEMA, "description": "d"}},
     "json_schema"),
    ({"type": "json_object"}, "json_object"),
    ({"type": "regex", "pattern": "(yes|no)"}, "regex"),
    ({"type": "grammar", "lark": 'start: "a" NUM\nNUM: /[0-9]+/'}, "grammar"),
])
def test_valid_forms_compile(obj, kind):
    fmt = validate_response_format(obj)
    assert isinstance(fmt, ResponseFormat) and fmt.kind == kind
    assert isinstance(fmt.grammar, str) and fmt.grammar  # ready for an llguidance matcher


@pytest.mark.parametrize("obj", [None, {"type": "text"}])
def test_text_and_null_mean_unconstrained(obj):
    assert validate_response_format(obj) is None


@pytest.mark.parametrize("obj, path, words", [
    ("json", "response_format", ("object",)),
    ({}, "response_format.type", ("json_schema",)),
    ({"type": "yaml"}, "response_format.type", ("yaml",)),
    ({"type": "json_object", "schema": {}}, "response_format.schema", ("json_object",)),
    ({"type": "text", "pattern": "a"}, "response_format.pattern", ()),
    ({"type": "json_schema"}, "response_format.json_schema", ("schema",)),
    ({"type": "json_schema", "json_schema": {"name": "x"}},
     "response_format.json_schema.schema", ()),
    ({"type": "json_schema", "json_schema": {"schema": SCHEMA, "strict": "yes"}},
     "response_format.json_schema.strict", ()),
    ({"type": "json_schema", "json_schema": {"schema": SCHEMA, "name": "n" * 65}},
     "response_format.json_schema.name", ("64",)),
    ({"type": "json_schema", "json_schema": {"schema": SCHEMA, "nme": "x"}},
     "response_format.json_schema.nme", ()),
    ({"type": "json_schema", "json_schema": {"schema": {"type": "strin"}}},
     "response_format.json_schema.schema", ("rejected", "strin")),
    ({"type": "json_schema", "json_schema": {"schema": {"type": "integer", "minimum": 5,
                                                         "maximum": 2}}},
     "response_format.json_schema.schema", ("minimum",)),
    ({"type": "json_schema", "json_schema": {"schema": {"$ref": "#/nope"}}},
     "response_format.json_schema.schema", ("nope",)),
    ({"type": "json_schema", "json_schema": {"schema": {"type": "string", "format": "x-y"},
                                             "strict": True}},
     "response_format.json_schema.schema", ("format",)),
    ({"type": "regex"}, "response_format.pattern", ("string",)),
    ({"type": "regex", "pattern": 5}, "response_format.pattern", ("string",)),
    ({"type": "regex", "pattern": "[a-"}, "response_format.pattern", ("rejected", "regex")),
    ({"type": "grammar", "lark": ""}, "response_format.lark", ("string",)),
    ({"type": "grammar", "lark": 'start: foo\nfoo: "a" | bar'}, "response_format.lark",
     ("bar",)),
])
def test_invalid_forms_name_the_field(obj, path, words):
    with pytest.raises(ResponseFormatError) as info:
        validate_response_format(obj)
    message = str(info.value)
    assert message.startswith(path + " "), message
    for word in words:
        assert word in message, message
    assert isinstance(info.value, ValueError)


def test_non_strict_schema_ignores_unknown_formats():
    obj = {"type": "json_schema", "json_schema": {"schema": {"type": "string", "format": "x-y"}}}
    assert validate_response_format(obj).kind == "json_schema"


def test_generate_request_checks_at_construction_and_compiles_later():
    """Shape and size are checked when the request is built; llguidance's compile (which
    the engine runs on a large-stack worker thread at submit) names the field too."""
    req = GenerateRequest(prompt="x", response_format={"type": "regex", "pattern": "a+"})
    assert req.constraint is not None and req.constraint.kind == "regex"
    assert compile_format(req.constraint).kind == "regex"
    assert GenerateRequest(prompt="x").constraint is None
    with pytest.raises(ResponseFormatError, match="response_format.pattern"):
        GenerateRequest(prompt="x", response_format={"type": "regex", "pattern": 5})
    late = GenerateRequest(prompt="x", response_format={"type": "regex", "pattern": "("})
    with pytest.raises(ResponseFormatError, match="response_format.pattern"):
        compile_format(late.constraint)


def test_websocket_command_carries_or_refuses_response_format():
    frame = {"type": "generate", "id": "r", "prompt": "x",
             "response_format": {"type": "json_object"}}
    cmd = parse_command(frame, 16)
    assert cmd.request.constraint.kind == "json_object"
    frame["response_format"] = {"type": "regex", "pattern": ["(a"]}
    with pytest.raises(ProtocolError) as info:
        parse_command(frame, 16)
    assert info.value.code == "invalid_request" and info.value.request_id == "r"
    assert info.value.message.startswith("response_format.pattern ")


def test_all_ones_masks_leave_logits_bit_equal_and_masks_force_tokens():
    logits = mx.random.normal((3, 70), key=mx.random.key(0))
    ones = np.full((3, 3), -1, dtype=np.int32)
    assert mx.array_equal(apply_token_masks(logits, ones), logits).item()
    masks = ones.copy()
    masks[1] = 0
    masks[1, 2] = 1 << 5  # only token 69 in row 1
    out = apply_token_masks(logits, masks)
    assert mx.array_equal(out[0], logits[0]).item() and mx.array_equal(out[2], logits[2]).item()
    assert np.isinf(np.array(out[1, :69])).all() and out[1, 69].item() == logits[1, 69].item()
    rows = [RowSampler.create(SamplingParams(temperature=t, seed=3, logprobs=True,
                                             top_logprobs=2), [1]) for t in (0.0, 1.0, 0.0)]
    sampled = sample_rows(logits, rows, masks)
    raw = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    assert sampled.tokens[1] == 69
    assert sampled.tokens[0] == sampled.tokens[0] == int(mx.argmax(logits[0]).item())
    # logprobs come from the raw distribution, not the masked one
    assert sampled.logprobs[1] == pytest.approx(raw[1, 69].item(), abs=1e-6)
    assert sampled.top_logprobs[1][0][0] == int(mx.argmax(logits[1]).item())


def test_size_limits_are_checked_without_llguidance():
    from tqserve.engine.structured import check_response_format
    from tqserve.engine.structured.formats import (MAX_GRAMMAR_RULES, MAX_NESTING,
                                                   MAX_REGEX_CHARS, MAX_SCHEMA_DEFS)

    rules = "\n".join(["start: r0"] + [f'r{i}: "a" r{i + 1}?' for i in range(MAX_GRAMMAR_RULES)])
    with pytest.raises(ResponseFormatError, match=r"response_format.lark defines 1002 rules"):
        check_response_format({"type": "grammar", "lark": rules + '\nr1000: "b"'})
    deep: dict = {"type": "string"}
    for _ in range(MAX_NESTING):
        deep = {"anyOf": [deep]}
    with pytest.raises(ResponseFormatError, match="json_schema.schema nests deeper than 100"):
        check_response_format({"type": "json_schema", "json_schema": {"schema": deep}})
    defs = {f"d{i}": {"type": "string"} for i in range(MAX_SCHEMA_DEFS + 1)}
    with pytest.raises(ResponseFormatError, match=r"more than 1000 definitions \(\$defs\)"):
        check_response_format({"type": "json_schema", "json_schema": {
            "schema": {"type": "object", "definitions": defs}}})
    with pytest.raises(ResponseFormatError, match="pattern is longer than"):
        check_response_format({"type": "regex", "pattern": "a" * (MAX_REGEX_CHARS + 1)})
    # brackets inside string and regex literals are not nesting
    text = 'start: "(((" /[(]+/ ' + "(" * 50 + '"x"' + ")" * 50
    assert check_response_format({"type": "grammar", "lark": text}).kind == "grammar"


def test_a_large_stack_worker_compiles_what_an_8_mib_stack_cannot():
    """3,000 chained rules crash llguidance's compiler on a default thread (SIGSEGV); the
    limits refuse them from requests, and the workers' stacks hold them anyway."""
    from tqserve.engine.structured import BigStackExecutor, FormatSource

    lark = "\n".join(["start: r0"] + [f'r{i}: "t{i}" r{i + 1}?' for i in range(3000)]
                     + ['r3000: "e"'])
    pool = BigStackExecutor(1, "test-grammar")
    try:
        fmt = pool.submit(compile_format, FormatSource(kind="grammar", source=lark)).result()
    finally:
        pool.shutdown()
    assert fmt.kind == "grammar" and "r2999" in fmt.grammar  # validated, not refused
