"""api.httpcommon's sans-io parts, synchronously: body fields, error params, SSE framing."""

from __future__ import annotations

import json

import pytest

from tqserve.actors.messages import Error
from tqserve.api.httpcommon import ApiError, Body, param_of, sse, text_of_content


def body(obj) -> Body:
    return Body(json.dumps(obj).encode(), 1 << 20)


def test_body_fields_name_themselves():
    b = body({"a": 1, "f": 2, "s": "x", "flag": True, "stop": ["x", "y"], "n": 1})
    assert b.get("a", int) == 1 and b.get("f", float) == 2.0 and b.get("missing", int, 7) == 7
    assert b.stop("stop") == ("x", "y") and body({"stop": "z"}).stop("stop") == ("z",)
    b.n_is_one()
    for name, kind in (("s", int), ("flag", int), ("flag", float), ("a", str)):
        with pytest.raises(ApiError) as info:
            b.get(name, kind)
        assert (info.value.status, info.value.param) == (400, name)
        assert info.value.message.startswith(f"{name} must be")
    with pytest.raises(ApiError, match="x is required"):
        b.get("x", int, required=True)
    with pytest.raises(ApiError, match="'zz'") as info:
        body({"zz": 1, "a": 2}).refuse_unknown(frozenset({"a"}))
    assert info.value.param == "zz"
    with pytest.raises(ApiError, match="n must be 1"):
        body({"n": 3}).n_is_one()
    with pytest.raises(ApiError) as info:
        Body(b"x" * 11, 10)
    assert info.value.status == 413
    for raw in (b"[]", b"{", b"", b"1"):
        with pytest.raises(ApiError) as info:
            Body(raw, 100)
        assert info.value.status == 400


def test_engine_errors_map_to_status_and_param():
    cases = [("invalid_request", "max_tokens must be <= 4096, got 5000", 400, "max_tokens"),
             ("invalid_request", "bad schema in response_format: x", 400, "response_format"),
             ("overloaded", "queue full", 429, None), ("engine_closed", "bye", 503, None),
             ("internal_error", "bug", 500, None)]
    for code, message, status, param in cases:
        err = ApiError.from_event(Error(request_id="r", code=code, message=message))
        assert (err.status, err.param, err.code) == (status, param, code)
        assert err.headers() == ({"Retry-After": "1"} if status == 429 else {})
    assert param_of("prompt (3 tokens) plus max_tokens (9)") == "prompt"


def test_content_parts_and_sse_framing():
    assert text_of_content("hi", "c") == "hi"
    assert text_of_content([{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                           "c") == "ab"
    with pytest.raises(ApiError, match=r"c\[0\] must be a text part"):
        text_of_content([{"type": "video"}], "c")
    with pytest.raises(ApiError, match=r"c\[1\] is an image \(image_url\): this server "
                                       "serves a text-only model"):
        text_of_content([{"type": "text", "text": "a"}, {"type": "image_url"}], "c")
    with pytest.raises(ApiError, match="c must be"):
        text_of_content(5, "c")
    assert sse({"a": "é"}) == 'data: {"a": "é"}\n\n'.encode()
    assert sse("[DONE]") == b"data: [DONE]\n\n"
    assert sse({"type": "ping"}, "ping") == b'event: ping\ndata: {"type": "ping"}\n\n'
