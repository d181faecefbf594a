"""What one request may carry, integer ranges, and a client that stops reading.

Every numeric field at its boundaries gets a `done` or an `invalid_request` naming the
field (never `internal_error`, never a dead socket); every size limit is an error frame
naming the field and the limit; a client that never reads has its rows cancelled while
its socket is still open.
"""

from __future__ import annotations

import json

import httpx
import trio
from trio_websocket import open_websocket_url

from tqserve.engine.sampling import MAX_STOP_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS
from tests.api.wsclient import (LONG_PROMPT, STATS_POLL_SLEEP, Session, assert_well_formed,
                                stats)
from tests.conftest import start_server
from tqserve.tools.rawws import OP_TEXT, connect, frame

INT_EDGES = (-2**64, -2**63 - 1, -2**63, -1, 0, 1, 8191, 8192, 2**31 - 1, 2**31, 2**32,
             2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1, 2**64, 10**30)
FLOAT_EDGES = (-1e308, -0.0, 1e-300, 0.5, 1.0, 1e308)
NUMERIC_FIELDS = ("max_tokens", "top_k", "seed", "top_logprobs", "temperature", "top_p",
                  "min_p", "repetition_penalty", "stop_token_ids", "prompt_tokens")
VICTIM_TOKENS = 4000  # outlives the battery; cancelled after it
SLOW_POLLS = 3000  # /v1/stats reads while waiting for the slow client's rows to go


def boundary_frame(rid: str, field: str, value: int | float) -> dict:
    obj = {"type": "generate", "id": rid, "prompt": "def f():", "max_tokens": 2,
           "temperature": 0}
    if field == "prompt_tokens":
        del obj["prompt"]
        obj["prompt_tokens"] = [1, value]
    else:
        obj[field] = [value] if field == "stop_token_ids" else value
    return obj


async def test_integers_at_their_boundaries_in_every_numeric_field(server, draft_model):
    problems = []
    async with open_websocket_url(server.ws_url) as ws:
        session = Session(ws)
        await session.generate("victim", prompt=LONG_PROMPT, max_tokens=VICTIM_TOKENS,
                               temperature=0)
        await session.first_token("victim")
        n = 0
        for binary in (False, True):
            for field in NUMERIC_FIELDS:
                for value in INT_EDGES + FLOAT_EDGES:
                    if binary and isinstance(value, int) and not -2**63 <= value < 2**64:
                        continue  # msgpack cannot carry it
                    n += 1
                    rid = f"f{n}"
                    await session.send(boundary_frame(rid, field, value), binary)
                    (result,) = await session.wait(rid)
                    end = result.end
                    ok = end["type"] == "done" or (
                        end["code"] == "invalid_request" and field in end["message"])
                    if not ok:
                        problems.append((field, value, binary, end))
        assert problems == []
        assert session.results["victim"].end is None  # still running on the same socket
        await session.send({"type": "cancel", "id": "victim"})
        (victim,) = await session.wait("victim")
    assert_well_formed(victim, draft_model.tokenizer, binary=False, check_text=False)
    assert victim.finish_reason == "cancelled" and len(victim.tokens) > 0
    async with httpx.AsyncClient() as client:
        final = await stats(client, server.url)
    assert "internal_error" not in final["rejections"], final


async def test_request_size_limits_name_the_field(nursery, draft_model):
    server = await start_server(nursery, draft_model, max_prompt_chars=1000, max_messages=4)
    vocab = draft_model.vocab_size
    user = {"role": "user", "content": "hi"}
    cases = [
        (dict(prompt="a" * 1001), ("prompt", "1000", "--max-prompt-chars")),
        (dict(messages=[user] * 5), ("messages", "4", "--max-messages")),
        (dict(messages=[{"role": "user", "content": "b" * 1001}]),
         ("messages content", "1000")),
        (dict(prompt="x", stop=["s"] * (MAX_STOP_STRINGS + 1)), ("stop", str(MAX_STOP_STRINGS))),
        (dict(prompt="x", stop=["s" * (MAX_STOP_CHARS + 1)]), ("stop", str(MAX_STOP_CHARS))),
        (dict(prompt="x", stop_token_ids=list(range(MAX_STOP_TOKEN_IDS + 1))),
         ("stop_token_ids", str(MAX_STOP_TOKEN_IDS))),
        (dict(prompt="x", stop_token_ids=[vocab]), ("stop_token_ids", str(vocab))),
        (dict(prompt_tokens=[1] * (draft_model.context_length + 1)), ("prompt_tokens",)),
    ]
    async with open_websocket_url(server.ws_url) as ws, httpx.AsyncClient() as client:
        session = Session(ws)
        for i, (fields, needles) in enumerate(cases):
            for binary in (False, True):
                rid = f"c{i}{binary:d}"
                await session.generate(rid, binary, max_tokens=2, **fields)
                frame_, got_binary = await session.reply(rid)
                assert frame_["code"] == "invalid_request", (fields.keys(), frame_)
                assert all(n in frame_["message"] for n in needles), (needles, frame_)
                assert got_binary == binary
        await session.generate("ok", prompt="a" * 1000, max_tokens=2, temperature=0)
        (ok,) = await session.wait("ok")
        assert ok.finish_reason in ("length", "stop")
        final = await stats(client, server.url)
    assert final["rejections"] == {"invalid_request": 2 * len(cases)}, final
    assert (final["requests_total"], final["requests_rejected"]) == (2 * len(cases) + 1,
                                                                     2 * len(cases))


async def test_a_client_that_stops_reading_has_its_rows_cancelled(nursery, draft_model):
    server = await start_server(nursery, draft_model, stream_buffer=8, max_tokens_cap=8000)
    max_tokens = 6000
    port = int(server.url.rsplit(":", 1)[1])
    stream, head = await connect(port, receive_buffer=4096)  # a small window
    assert head.startswith(b"HTTP/1.1 101"), head
    for i in range(8):
        request = {"type": "generate", "id": f"s{i}", "prompt": LONG_PROMPT,
                   "max_tokens": max_tokens, "temperature": 0, "logprobs": True,
                   "top_logprobs": 20}
        await stream.send_all(frame(OP_TEXT, json.dumps(request).encode()))
    # never read again: the socket's buffers fill, then the hub's, then the rows must go
    async with httpx.AsyncClient() as client:
        current = await stats(client, server.url)
        for _ in range(SLOW_POLLS):
            if current["steps"] > 0 and current["rows_active"] == 0 \
                    and current["streams_open"] == 0:
                break
            await trio.sleep(STATS_POLL_SLEEP)
            current = await stats(client, server.url)
        assert current["rows_active"] == 0 and current["streams_open"] == 0, current
        assert current["steps"] < max_tokens // 2, current  # cut off, not decoded to the end
        after = await stats(client, server.url)
        assert after["steps"] == current["steps"] and after["kv_bytes"] == 0, after
    # the socket is still open (it has unread frames): the server only stopped the rows
    assert await stream.receive_some(65536) != b""
    await stream.aclose()
