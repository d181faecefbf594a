"""Bad bodies on the HTTP APIs: a 400 in the API's shape naming the field, never a 500."""

from __future__ import annotations

import httpx
import pytest

from tests.api.wsclient import wait_stats

USER = [{"role": "user", "content": "x = 1"}]
JSON = {"Content-Type": "application/json"}
CASES = [
    ("/v1/completions", {}, "prompt"),
    ("/v1/completions", {"prompt": {"a": 1}}, "prompt"),
    ("/v1/completions", {"prompt": []}, "prompt"),
    ("/v1/completions", {"prompt": [1, "a"]}, "prompt"),
    ("/v1/completions", {"prompt": [10 ** 9]}, "prompt"),
    ("/v1/completions", {"prompt": "a", "logprobs": True}, "logprobs"),
    ("/v1/completions", {"prompt": "a", "logprobs": 50}, "logprobs must be in [0, 20]"),
    ("/v1/completions", {"prompt": "a", "stream": "yes"}, "stream"),
    ("/v1/completions", {"prompt": "a", "stream_options": {"include_usage": True}},
     None),  # accepted without streaming, as vLLM
    ("/v1/completions", {"prompt": "a", "stop": [1]}, "stop"),
    ("/v1/completions", {"prompt": "a", "seed": -1}, "seed"),
    ("/v1/completions", {"prompt": "a", "temperature": "hot"}, "temperature"),
    ("/v1/completions", {"prompt": "a", "max_tokens": 2.5}, "max_tokens"),
    ("/v1/completions", {"prompt": "a", "echo": "yes", "logprobs": 1}, "echo"),
    ("/v1/completions", {"prompt": "a", "n": 17}, "n"),
    ("/v1/completions", {"prompt": ["a"] * 9, "n": 2}, "n"),
    ("/v1/completions", {"prompt": "a", "presence_penalty": 2.5}, "presence_penalty"),
    ("/v1/completions", {"prompt": "a", "frequency_penalty": "x"}, "frequency_penalty"),
    ("/v1/completions", {"prompt": "a", "logit_bias": {"x": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "a", "logit_bias": {"5": 101}}, "logit_bias"),
    ("/v1/completions", {"prompt": "a", "logit_bias": {"99999": 1}}, "logit_bias"),
    ("/v1/chat/completions", {"messages": "hi"}, "messages"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [1]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages[0].content"),
    ("/v1/chat/completions", {"messages": USER, "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": USER, "logprobs": True, "top_logprobs": 21},
     "top_logprobs"),
    ("/v1/chat/completions", {"messages": USER, "tools": [{"type": "function"}]}, "tools"),
    ("/v1/chat/completions", {"messages": USER, "tools": [{"type": "function", "function": {
        "name": "f"}}], "tool_choice": {"type": "function"}}, "tool_choice"),
    ("/v1/responses", {"input": [{"type": "image"}]}, "input"),
    ("/v1/responses", {"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ("/v1/chat/completions", {"messages": USER, "response_format": {"type": "xml"}},
     "response_format"),
    ("/v1/chat/completions", {"messages": USER, "response_format": {
        "type": "json_schema", "json_schema": {"schema": {"type": "strin"}}}},
     "response_format"),
    ("/v1/messages", {"max_tokens": 4}, "messages"),
    ("/v1/messages", {"max_tokens": 4, "messages": []}, "messages"),
    ("/v1/messages", {"max_tokens": "4", "messages": USER}, "max_tokens"),
    ("/v1/messages", {"max_tokens": 4, "messages": USER, "system": 5}, "system"),
    ("/v1/messages", {"max_tokens": 4, "messages": USER, "stop_sequences": "x\n"},
     None),  # a single string is accepted as one sequence
    ("/v1/messages", {"max_tokens": 10 ** 6, "messages": USER}, "max_tokens"),
]


def error_message(path: str, body: dict) -> str:
    if path == "/v1/messages":
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
        return body["error"]["message"]
    assert body["error"]["type"] == "invalid_request_error"
    return body["error"]["message"] + f" (param {body['error']['param']})"


async def test_bad_bodies_are_400s_naming_the_field(server):
    async with httpx.AsyncClient(timeout=60) as raw:
        for path, body, field in CASES:
            response = await raw.post(server.url + path, json=body)
            if field is None:
                assert response.status_code == 200, (body, response.text)
                continue
            assert response.status_code == 400, (path, body, response.text)
            message = error_message(path, response.json())
            assert field in message and "{{" not in message, (body, message)
        for data in (b"", b"[1, 2]", b"\xff\xfe{", b'{"prompt": "\\ud800"}', b"nul\x00"):
            response = await raw.post(server.url + "/v1/completions", content=data,
                                      headers=JSON)
            assert response.status_code == 400, (data, response.text)
            assert response.json()["error"]["message"]
        big = await raw.post(server.url + "/v1/messages", headers=JSON,
                             content=b'{"x": "' + b"a" * (2 << 20) + b'"}')
        for path in ("/v1/completions", "/v1/messages"):  # a form or text/plain: no JSON
            for headers in ({}, {"Content-Type": "text/plain"},
                            {"Content-Type": "application/x-www-form-urlencoded"}):
                response = await raw.post(server.url + path, headers=headers,
                                          content=b'{"prompt": "a", "max_tokens": 4}')
                assert response.status_code == 415, (path, headers)
                assert "application/json" in response.text
        assert big.status_code == 413 and big.json()["type"] == "error"
        await wait_stats(raw, server.url, rows_active=0, rows_queued=0, streams_open=0)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/messages"])
async def test_stream_refused_before_it_starts_is_a_plain_error(server, path):
    body = {"stream": True, "max_tokens": 10 ** 6, "prompt": "a", "messages": USER}
    body.pop("prompt" if path != "/v1/completions" else "messages")
    async with httpx.AsyncClient(timeout=60) as raw:
        response = await raw.post(server.url + path, json=body)
    assert response.status_code == 400
    assert response.headers["content-type"].startswith("application/json")
