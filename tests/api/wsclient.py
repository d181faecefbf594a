"""Client helpers for the API tests: a WebSocket session that files frames by id.

`Session` wraps a trio-websocket connection: it sends JSON (text) or msgpack
(binary) frames and files the frames of each request under its id, with the
frame kind they came in; `reply` reads the error that answers a refused frame.
Every wait is bounded (a hang guard, never a measurement).
"""

from __future__ import annotations

import json
from typing import Any, Callable

import attrs
import httpx
import msgpack
import trio
from trio_websocket import WebSocketConnection, open_websocket_url

FRAME_TIMEOUT = 30.0   # seconds one frame may take before the test fails as hung
MAX_FRAMES = 20_000    # frames one wait may read
STATS_POLLS = 200      # bounded polling of /v1/stats ...
STATS_POLL_SLEEP = 0.02  # ... with this pause between reads
LONG_PROMPT = "import os\n"  # greedy output loops on "import re": no EOS for hundreds of tokens


@attrs.define
class Result:
    """Every frame of one request id, in arrival order."""

    rid: str
    frames: list[dict[str, Any]] = attrs.Factory(list)
    kinds: list[bool] = attrs.Factory(list)  # True: arrived as a binary (msgpack) frame

    @property
    def end(self) -> dict[str, Any] | None:
        last = self.frames[-1] if self.frames else None
        return last if last is not None and last["type"] in ("done", "error") else None

    @property
    def tokens(self) -> list[dict[str, Any]]:
        return [f for f in self.frames if f["type"] == "token"]

    @property
    def token_ids(self) -> list[int]:
        return [f["token_id"] for f in self.tokens]

    @property
    def text(self) -> str:
        return "".join(f["text"] for f in self.tokens)

    @property
    def finish_reason(self) -> str | None:
        end = self.end
        return end.get("finish_reason") if end is not None else None


def encode(obj: Any, binary: bool) -> str | bytes:
    return msgpack.packb(obj, use_bin_type=True) if binary else json.dumps(obj, ensure_ascii=False)


def decode(message: str | bytes) -> tuple[dict[str, Any], bool]:
    if isinstance(message, bytes):
        return msgpack.unpackb(message, raw=False), True
    return json.loads(message), False


def generate(rid: str, **fields: Any) -> dict[str, Any]:
    return {"type": "generate", "id": rid, **fields}


class Session:
    """One WebSocket connection; frames are filed by id into `results`."""

    def __init__(self, ws: WebSocketConnection) -> None:
        self.ws = ws
        self.results: dict[str, Result] = {}
        self.unrouted: list[tuple[dict[str, Any], bool]] = []  # frames with id null

    async def send(self, obj: Any, binary: bool = False) -> None:
        await self.ws.send_message(encode(obj, binary))

    async def send_raw(self, data: str | bytes) -> None:
        await self.ws.send_message(data)

    async def generate(self, rid: str, binary: bool = False, **fields: Any) -> None:
        await self.send(generate(rid, **fields), binary)

    async def recv(self) -> tuple[dict[str, Any], bool]:
        """Read one frame (not filed)."""
        with trio.fail_after(FRAME_TIMEOUT):
            return decode(await self.ws.get_message())

    def file(self, frame: dict[str, Any], binary: bool) -> None:
        rid = frame.get("id")
        if rid is None:
            self.unrouted.append((frame, binary))
            return
        result = self.results.get(rid)
        if result is None or result.end is not None:  # an id may be used again after its end
            assert result is None or frame["type"] in ("queued", "error"), \
                f"frame after the end of {rid!r}: {frame}"
            result = self.results[rid] = Result(rid)
        result.frames.append(frame)
        result.kinds.append(binary)

    async def reply(self, rid: str | None) -> tuple[dict[str, Any], bool]:
        """The answer to a refused frame: the next error (or done) for `rid`, or a frame
        with no id. It is returned, not filed; every other frame is filed under its id.
        (A `done` is returned so that a frame accepted by mistake fails fast.)
        """
        for _ in range(MAX_FRAMES):
            frame, binary = await self.recv()
            if frame.get("id") is None or (frame["id"] == rid
                                           and frame["type"] in ("error", "done")):
                return frame, binary
            self.file(frame, binary)
        raise AssertionError(f"no reply for {rid!r} within {MAX_FRAMES} frames")

    async def until(self, condition: Callable[[], bool], what: str) -> None:
        """File frames until `condition()` holds."""
        for _ in range(MAX_FRAMES):
            if condition():
                return
            self.file(*await self.recv())
        raise AssertionError(f"{what}: not within {MAX_FRAMES} frames")

    async def first_token(self, rid: str) -> None:
        """Read until `rid` has produced a token; it must still be running."""
        await self.until(lambda: rid in self.results and bool(
            self.results[rid].tokens or self.results[rid].end), f"a token of {rid}")
        result = self.results[rid]
        assert result.tokens and result.end is None, f"{rid} ended early: {result.frames}"

    async def queued(self, rid: str) -> None:
        """Read until `rid` is queued; it must not have started yet."""
        await self.until(lambda: rid in self.results, f"{rid} queued")
        assert [f["type"] for f in self.results[rid].frames] == ["queued"], \
            self.results[rid].frames

    async def wait(self, *rids: str) -> list[Result]:
        """Read until every id in `rids` has ended; return their results in order."""
        await self.until(lambda: all(r in self.results and self.results[r].end is not None
                                     for r in rids), f"the end of {rids}")
        return [self.results[r] for r in rids]


async def run_alone(ws_url: str, rid: str, binary: bool = False, **fields: Any) -> Result:
    """Run one request on a fresh connection of its own."""
    async with open_websocket_url(ws_url) as ws:
        session = Session(ws)
        await session.generate(rid, binary, **fields)
        (result,) = await session.wait(rid)
        return result


def expected_text(tokenizer: Any, result: Result, stop_ids: frozenset[int]) -> str:
    """decode() of the generated ids, without a final stop token (its text is empty)."""
    ids = result.token_ids
    if result.finish_reason == "stop" and ids and ids[-1] in stop_ids:
        ids = ids[:-1]
    return tokenizer.decode(ids)


def assert_well_formed(result: Result, tokenizer: Any, *, binary: bool,
                       stop_ids: frozenset[int] = frozenset(), check_text: bool = True,
                       prompt_tokens: int | None = None) -> None:
    """queued, tokens 0..n-1, done with usage; one frame kind; text == decode(ids)."""
    frames = result.frames
    assert frames and frames[0]["type"] == "queued", frames[:2]
    assert result.end is not None and result.end["type"] == "done", result.end
    assert all(f["type"] == "token" for f in frames[1:-1]), [f["type"] for f in frames]
    assert set(result.kinds) == {binary}, f"{result.rid}: frame kinds {set(result.kinds)}"
    assert [f["index"] for f in result.tokens] == list(range(len(result.tokens)))
    usage = result.end["usage"]
    assert set(usage) == {"prompt_tokens", "completion_tokens", "cached_tokens",
                          "cached_tokens_by_tier"}
    by_tier = usage["cached_tokens_by_tier"]
    assert set(by_tier) == {"ram", "ssd"}
    assert sum(by_tier.values()) == usage["cached_tokens"] < max(1, usage["prompt_tokens"])
    assert all(isinstance(v, int) and v >= 0 for k, v in usage.items()
               if k != "cached_tokens_by_tier"), usage
    assert usage["completion_tokens"] == len(result.tokens)
    if prompt_tokens is not None:
        assert usage["prompt_tokens"] == prompt_tokens
    if check_text:
        assert result.text == expected_text(tokenizer, result, stop_ids)


async def stats(client: httpx.AsyncClient, url: str) -> dict[str, Any]:
    response = await client.get(url + "/v1/stats")
    assert response.status_code == 200, response.text
    return response.json()


async def wait_stats(client: httpx.AsyncClient, url: str, **want: int) -> dict[str, Any]:
    """Poll /v1/stats (bounded) until every field in `want` has its value."""
    current: dict[str, Any] = {}
    for _ in range(STATS_POLLS):
        current = await stats(client, url)
        if all(current.get(k) == v for k, v in want.items()):
            return current
        await trio.sleep(STATS_POLL_SLEEP)
    raise AssertionError(f"stats never reached {want}: last {current}")
