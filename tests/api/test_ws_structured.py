"""response_format over a real WebSocket: constrained requests beside an unconstrained one;
invalid schemas, regexes and grammars are `invalid_request` frames naming response_format
while the socket and its other requests go on; nothing leaks."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
from trio_websocket import open_websocket_url

from tests.api.wsclient import LONG_PROMPT, Session, assert_well_formed, wait_stats

SCHEMA = {"type": "object",
          "properties": {"kind": {"enum": ["cat", "dog"]},
                         "n": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["kind", "n"], "additionalProperties": False}
BAD = [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}},
     "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"schema": {"type": "integer", "minimum": 3,
                                                         "maximum": 1}}},
     "response_format.json_schema.schema"),
    ({"type": "regex", "pattern": "(unclosed"}, "response_format.pattern"),
    ({"type": "grammar", "lark": "start: missing_rule"}, "response_format.lark"),
    ({"type": "xml"}, "response_format.type"),
    ("json", "response_format"),
]


async def test_constrained_and_invalid_formats_on_one_socket(server, draft_model):
    tok, eos = draft_model.tokenizer, draft_model.eos_token_ids
    async with open_websocket_url(server.ws_url) as ws, httpx.AsyncClient() as client:
        session = Session(ws)
        await session.generate("long", prompt=LONG_PROMPT, max_tokens=200, temperature=0)
        await session.first_token("long")
        for i, (fmt, path) in enumerate(BAD):
            for binary in (False, True):
                rid = f"bad{i}{'m' if binary else 'j'}"
                await session.generate(rid, binary, prompt="x = ", max_tokens=8,
                                       response_format=fmt)
                frame, got_binary = await session.reply(rid)
                assert frame["type"] == "error" and frame["code"] == "invalid_request", frame
                assert frame["message"].startswith(path + " "), frame
                assert frame["id"] == rid and got_binary == binary
        assert session.results["long"].end is None, "the long request ended inside the battery"
        await session.generate("json", prompt="data = ", max_tokens=40, temperature=1.0, seed=3,
                               logprobs=True, response_format={
                                   "type": "json_schema",
                                   "json_schema": {"name": "pet", "schema": SCHEMA}})
        await session.generate("re", True, prompt="answer = ", max_tokens=16, temperature=1.0,
                               seed=4, response_format={"type": "regex",
                                                        "pattern": "(yes|no)-[0-9]{2}"})
        await session.generate("text", prompt="def f():", max_tokens=6, temperature=0,
                               response_format={"type": "text"})
        js, rx, text, long = await session.wait("json", "re", "text", "long")
        for result, binary in ((js, False), (rx, True), (text, False)):
            assert_well_formed(result, tok, binary=binary, stop_ids=eos)
        assert js.finish_reason == "stop" and rx.finish_reason == "stop"
        jsonschema.validate(json.loads(js.text), SCHEMA)
        assert all(isinstance(f["logprob"], float) and f["logprob"] <= 0 for f in js.tokens)
        assert re.fullmatch("(yes|no)-[0-9]{2}", rx.text), rx.text
        assert long.finish_reason == "length" and len(long.tokens) == 200
        assert session.unrouted == []
        final = await wait_stats(client, server.url, rows_active=0, rows_queued=0, kv_bytes=0,
                                 streams_open=0)
        refused = 2 * len(BAD)  # every invalid format is a counted refusal (issue 8)
        assert (final["requests_total"], final["requests_rejected"]) == (4 + refused, refused)
        assert final["rejections"] == {"invalid_request": refused}
