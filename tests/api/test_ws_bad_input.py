"""Bad input on one socket: each frame gets an `error` naming the field; nothing else breaks.

A long request runs across the whole battery and must finish normally; a normal
request after the battery must too; no row, queue slot or stream may leak.
"""

from __future__ import annotations

from typing import Any

import attrs
import httpx
import msgpack
from trio_websocket import open_websocket_url

from tests.api.wsclient import LONG_PROMPT, Session, assert_well_formed, generate, wait_stats
from tests.conftest import start_server

LONG_TOKENS = 300  # must outlive the battery, which takes a few dozen engine steps


_DROP = object()  # marks a field to leave out of a frame


@attrs.frozen
class Case:
    name: str
    payload: Any          # a dict (sent in the pass's frame kind) or raw str/bytes
    code: str
    needles: tuple[str, ...]  # each must appear in the error message
    rid: str | None       # the id the error frame must carry


def object_cases(rid: str, vocab: int, context: int, cap: int) -> list[Case]:
    """Frames with a bad field; `rid` tags those whose error names the request."""

    def gen(**fields: Any) -> dict[str, Any]:
        obj = generate(rid, prompt="def f():", max_tokens=4, temperature=0)
        obj.update(fields)
        return {k: v for k, v in obj.items() if v is not _DROP}

    def bad(field: str, value: Any, *needles: str) -> Case:
        return Case(f"{field}={value!r}", gen(**{field: value}), "invalid_request",
                    needles or (field,), rid)

    return [
        Case("missing type", {"id": rid, "prompt": "x"}, "unknown_type", ("type",), rid),
        Case("unknown type", {"type": "fly", "id": rid}, "unknown_type", ("type", "fly"), rid),
        Case("missing id", gen(id=_DROP), "invalid_request", ("id",), None),
        Case("int id", gen(id=5), "invalid_request", ("id",), None),
        Case("empty id", gen(id=""), "invalid_request", ("id",), None),
        Case("long id", gen(id="x" * 129), "invalid_request", ("id", "128"), None),
        Case("unknown field", gen(temprature=0.5), "invalid_request", ("temprature",), rid),
        bad("temperature", "hot"), bad("temperature", -0.5), bad("max_tokens", 1.5),
        bad("max_tokens", 0), bad("max_tokens", True), bad("top_k", -1), bad("top_p", 0),
        bad("top_p", 1.5), bad("min_p", 2), bad("repetition_penalty", 0), bad("seed", -1),
        bad("seed", "x"), bad("logprobs", "yes"), bad("top_logprobs", 21),
        bad("stop", "abc"), bad("stop", [1]), bad("stop_token_ids", [-1]),
        bad("stop_token_ids", "5"),
        bad("prompt", 5), bad("prompt", ""),
        bad("speculative", {"method": "beam"}, "speculative.method", "beam"),
        bad("speculative", {"method": "lookup", "num_tokens": 99}, "speculative.num_tokens"),
        bad("speculative", "yes", "speculative"),
        bad("speculative", {"method": "draft"}, "speculative.method", "not served"),
        Case("prompt and prompt_tokens", gen(prompt_tokens=[1, 2]), "invalid_request",
             ("prompt", "prompt_tokens"), rid),
        Case("no prompt", gen(prompt=_DROP), "invalid_request", ("prompt", "messages"), rid),
        Case("token out of vocab", gen(prompt=_DROP, prompt_tokens=[1, vocab]),
             "invalid_request", ("prompt_tokens", str(vocab)), rid),
        Case("prompt_tokens not a list", gen(prompt=_DROP, prompt_tokens="1 2"),
             "invalid_request", ("prompt_tokens",), rid),
        Case("empty prompt_tokens", gen(prompt=_DROP, prompt_tokens=[]),
             "invalid_request", ("prompt_tokens",), rid),
        Case("prompt_tokens with a string", gen(prompt=_DROP, prompt_tokens=[1, "a"]),
             "invalid_request", ("prompt_tokens",), rid),
        Case("bad role", gen(prompt=_DROP, messages=[{"role": "wizard", "content": "hi"}]),
             "invalid_request", ("messages[0].role",), rid),
        Case("missing content", gen(prompt=_DROP, messages=[{"role": "user"}]),
             "invalid_request", ("messages[0].content",), rid),
        Case("messages not a list", gen(prompt=_DROP, messages="hi"),
             "invalid_request", ("messages",), rid),
        Case("max_tokens over the cap", gen(max_tokens=cap + 1), "invalid_request",
             ("max_tokens", str(cap)), rid),
        Case("prompt over the context", gen(prompt=_DROP, prompt_tokens=[1] * (context + 1),
                                            max_tokens=1),
             "invalid_request", ("prompt", "context", str(context)), rid),
        Case("duplicate id", generate("long", prompt="x", max_tokens=4), "duplicate_id",
             ("long",), "long"),
        Case("cancel unknown id", {"type": "cancel", "id": rid}, "unknown_id", (rid,), rid),
        Case("cancel without id", {"type": "cancel"}, "invalid_request", ("id",), None),
        Case("cancel with a stray field", {"type": "cancel", "id": "long", "force": True},
             "invalid_request", ("force",), "long"),
    ]

RAW_CASES = [
    Case("invalid JSON", '{"type": "generate", "id": ', "bad_frame", ("JSON",), None),
    Case("JSON array", '[1, 2]', "bad_frame", ("object",), None),
    Case("JSON string", '"generate"', "bad_frame", ("object",), None),
    Case("JSON number", '42', "bad_frame", ("object",), None),
    Case("JSON NaN temperature",
         '{"type": "generate", "id": "nan", "prompt": "x", "temperature": NaN}',
         "invalid_request", ("temperature",), "nan"),
    Case("deeply nested JSON", "[" * 50_000 + "]" * 50_000, "bad_frame", ("JSON",), None),
    Case("lone surrogate in id",
         '{"type": "generate", "id": "\\ud800", "prompt": "x", "max_tokens": 1}',
         "bad_frame", ("JSON",), None),
    Case("lone surrogate in prompt",
         '{"type": "generate", "id": "sur", "prompt": "\\udc00", "max_tokens": 1}',
         "bad_frame", ("JSON",), None),
    Case("invalid msgpack", b"\xc1", "bad_frame", ("msgpack",), None),
    Case("truncated msgpack", b"\x92\x01", "bad_frame", ("msgpack",), None),
    Case("msgpack array", msgpack.packb([1, 2]), "bad_frame", ("object",), None),
    Case("msgpack invalid UTF-8", b"\x81\xa4type\xa2\xff\xfe", "bad_frame", ("msgpack",), None),
    Case("msgpack unhashable key", b"\x81\x91\x01\x02", "bad_frame", ("msgpack",), None),
    Case("msgpack int and str keys",
         msgpack.packb({"type": "generate", "id": "mk", "prompt": "x", 1: 2, "zz": 3}),
         "invalid_request", ("unknown field",), "mk"),
    Case("msgpack bytes prompt",
         msgpack.packb({"type": "generate", "id": "bp", "prompt": b"x"}, use_bin_type=True),
         "invalid_request", ("prompt",), "bp"),
]


async def send_case(session: Session, case: Case, binary: bool) -> str | None:
    """Send one case; return a description of what went wrong, or None."""
    if isinstance(case.payload, (str, bytes)):
        binary = isinstance(case.payload, bytes)
        await session.send_raw(case.payload)
    else:
        await session.send(case.payload, binary)
    frame, got_binary = await session.reply(case.rid)
    problems = []
    if set(frame) != {"type", "id", "code", "message"} or frame["type"] != "error":
        problems.append(f"not an error frame: {frame}")
    elif frame["code"] != case.code:
        problems.append(f"code {frame['code']!r} != {case.code!r} ({frame['message']})")
    elif not all(n in frame["message"] for n in case.needles):
        problems.append(f"message {frame['message']!r} lacks {case.needles}")
    if frame.get("id") != case.rid:
        problems.append(f"id {frame.get('id')!r} != {case.rid!r}")
    if got_binary != binary:
        problems.append(f"answered in a {'binary' if got_binary else 'text'} frame")
    return f"{case.name} ({'msgpack' if binary else 'JSON'}): {'; '.join(problems)}" \
        if problems else None


async def test_bad_input_battery_keeps_the_socket(server, draft_model):
    tok = draft_model.tokenizer
    limits = (draft_model.vocab_size, draft_model.context_length,
              server.config.engine.max_tokens_cap)
    problems: list[str] = []
    async with open_websocket_url(server.ws_url) as ws, httpx.AsyncClient() as client:
        session = Session(ws)
        await session.generate("long", prompt=LONG_PROMPT, max_tokens=LONG_TOKENS, temperature=0)
        await session.first_token("long")
        for binary in (False, True):
            cases = object_cases("m" if binary else "j", *limits)
            if not binary:
                cases += RAW_CASES
            for case in cases:
                problems.append(await send_case(session, case, binary))
        assert [p for p in problems if p] == []
        assert session.unrouted == []
        assert session.results["long"].end is None, "the long request ended inside the battery"
        await session.generate("after", True, prompt="def f():", max_tokens=6, temperature=0)
        after, long = await session.wait("after", "long")
        assert_well_formed(after, tok, binary=True, stop_ids=draft_model.eos_token_ids)
        assert_well_formed(long, tok, binary=False)
        assert long.finish_reason == "length" and len(long.tokens) == LONG_TOKENS
        # nothing leaked, and every refused frame is counted as a rejection
        final = await wait_stats(client, server.url, rows_active=0, rows_queued=0, kv_bytes=0,
                                 streams_open=0)
        refused = len(problems) - 2  # the unknown-id cancels (one per pass) refuse no request
        assert (final["requests_total"], final["requests_rejected"]) == (2 + refused, refused)
        assert sum(final["rejections"].values()) == refused
        assert "internal_error" not in final["rejections"]
        assert "overloaded" not in final["rejections"]


async def test_message_over_the_size_limit(nursery, draft_model):
    server = await start_server(nursery, draft_model, max_message_bytes=1024)
    big = generate("big", prompt="a" * 2000, max_tokens=1)
    wide = generate("wide", prompt="\u00e9" * 700, max_tokens=1)  # 700 characters, 1400 bytes
    async with open_websocket_url(server.ws_url) as ws:
        session = Session(ws)
        for payload, binary in ((big, False), (big, True), (wide, False)):
            await session.send(payload, binary)
            frame, got_binary = await session.reply(payload["id"])
            assert frame["type"] == "error" and frame["code"] == "message_too_large", frame
            assert frame["id"] is None
            assert "1024" in frame["message"] and got_binary == binary
        await session.generate("after", prompt="def f():", max_tokens=4, temperature=0)
        (after,) = await session.wait("after")
    assert_well_formed(after, draft_model.tokenizer, binary=False,
                       stop_ids=draft_model.eos_token_ids)
    assert set(session.results) == {"after"}  # the refused frames started nothing
