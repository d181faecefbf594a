"""The phases of tools.attack, and the subprocess server they attack.

Each phase sends a bounded count of one kind of hostile input to a tqserve on loopback
and returns its figures as a dict (see tools.attack for what must hold).
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import msgpack
import trio

from tqserve.tools.rawws import (OP_BINARY, OP_CLOSE, OP_PING, OP_TEXT, FrameReader, connect,
                         deflate_bomb, frame, http_get, read_close, send_quietly)

REPO = Path(__file__).resolve().parent.parent
RSS_SLACK = 50 << 20        # RSS after the bombs and oversize frames, over the baseline
RSS_POLLS = 100             # reads of /proc while waiting for RSS to come back ...
RSS_POLL_SLEEP = 0.1        # ... this far apart
CLOSE_WAIT = 15.0           # seconds the server gets to close sockets that never finish
EDGE_VALUES: tuple[Any, ...] = (
    None, True, False, 0, -1, 1, 2**31, 2**63 - 1, 2**64 - 1, -2**63, 1e308, -1e-308, 0.5,
    "", "x" * 300, "\u00e9\u6f22", [], [1, 2], [-1], [2**63], ["a"] * 20, {"a": 1}, [[1]])
FIELDS = ("type", "id", "prompt", "prompt_tokens", "messages", "max_tokens", "temperature",
          "top_p", "top_k", "min_p", "repetition_penalty", "seed", "logprobs",
          "top_logprobs", "stop", "stop_token_ids", "bogus")


class Server:
    """`tqserve serve` as a subprocess on a free loopback port."""

    def __init__(self, extra: list[str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tqserve.api.cli", "serve", "--port", "0", *extra], cwd=REPO,
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        if " on http://" not in line:
            self.proc.kill()
            raise RuntimeError(f"server did not start: {line!r}")
        self.port = int(line.split(" on http://", 1)[1].split()[0].rsplit(":", 1)[1])

    def rss(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError("no VmRSS")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


async def stats(port: int) -> dict[str, Any]:
    status, body = await http_get(port, "/v1/stats")
    return json.loads(body) if status == 200 else {}


async def health(port: int, latencies: list[float]) -> bool:
    start = time.perf_counter()
    try:
        with trio.fail_after(30):
            status, _ = await http_get(port, "/health")
    except (OSError, trio.TooSlowError):
        return False
    latencies.append(time.perf_counter() - start)
    return status == 200


def fuzz_frame(rng: random.Random, n: int) -> tuple[Any, bool]:
    """A mutated generate (or cancel) object, and whether to send it as msgpack."""
    obj: dict[Any, Any] = {"type": "generate", "id": f"z{n}", "prompt": "def f():",
                           "max_tokens": 3, "temperature": 0}
    if rng.random() < 0.1:
        obj = {"type": "cancel", "id": f"z{rng.randrange(n + 1)}"}
    for _ in range(rng.randint(1, 3)):
        obj[rng.choice(FIELDS)] = rng.choice(EDGE_VALUES)
    binary = rng.random() < 0.5
    if not binary:
        obj = json.loads(json.dumps(obj))  # what JSON can carry
    return obj, binary


async def phase_fuzz(port: int, count: int, rng: random.Random) -> dict[str, Any]:
    codes: Counter[str] = Counter()
    closed = 0
    stream, _ = await connect(port)
    reader = FrameReader(stream)
    for n in range(count):
        obj, binary = fuzz_frame(rng, n)
        data = msgpack.packb(obj, use_bin_type=True) if binary else json.dumps(obj).encode()
        if rng.random() < 0.05:  # raw garbage: truncated or random bytes
            data = data[:rng.randrange(len(data))] if rng.random() < 0.5 else rng.randbytes(40)
            binary = True
        await stream.send_all(frame(OP_BINARY if binary else OP_TEXT, data))
        rid = obj.get("id") if isinstance(obj.get("id"), str) else None
        while True:
            got = await reader.next()
            if got is None or got[0] == OP_CLOSE:
                closed += 1
                stream, _ = await connect(port)
                reader = FrameReader(stream)
                break
            op, payload = got
            event = msgpack.unpackb(payload) if op == OP_BINARY else json.loads(payload)
            if event["type"] == "queued" and event["id"] == rid and obj.get("type") == "generate":
                await stream.send_all(frame(OP_TEXT, json.dumps(
                    {"type": "cancel", "id": rid}).encode()))
            if event["type"] in ("error", "done") and event["id"] in (rid, None):
                codes[event.get("code", "done")] += 1
                break
    await stream.aclose()
    return {"frames": count, "replies": dict(codes), "internal_error": codes["internal_error"],
            "sockets_closed_by_server": closed}


async def phase_cancels(port: int, count: int, rng: random.Random) -> dict[str, Any]:
    stream, _ = await connect(port)
    for n in range(count):
        req = {"type": "generate", "id": f"c{n}", "prompt": "import os\n",
               "max_tokens": rng.randint(1, 64), "temperature": 0}
        await stream.send_all(frame(OP_TEXT, json.dumps(req).encode()))
        if rng.random() < 0.7:
            await trio.sleep(rng.random() * 0.01)
            await stream.send_all(frame(OP_TEXT, json.dumps(
                {"type": "cancel", "id": f"c{n}"}).encode()))
        if n % 8 == 7:  # drain what came back so the socket never backs up
            with trio.move_on_after(0.05):
                while await stream.receive_some(65536):
                    pass
    await stream.aclose()  # closing cancels whatever still runs
    after: dict[str, Any] = {}
    for _ in range(RSS_POLLS):
        after = await stats(port)
        if all(after.get(k) == 0 for k in ("rows_active", "kv_bytes", "streams_open")):
            break
        await trio.sleep(RSS_POLL_SLEEP)
    return {"requests": count, "rows_active": after.get("rows_active"),
            "kv_bytes": after.get("kv_bytes"), "streams_open": after.get("streams_open")}


async def phase_pings(port: int, count: int) -> dict[str, Any]:
    stream, _ = await connect(port)
    reader = FrameReader(stream)
    pongs = 0
    for i in range(count):
        await stream.send_all(frame(OP_PING, str(i).encode()))
        got = await reader.next()
        pongs += got is not None and got[0] == 0xA and got[1] == str(i).encode()
    await stream.aclose()
    return {"pings": count, "pongs": pongs}


async def phase_held(port: int, slowloris: int, randoms: int, connections: int,
                     rng: random.Random) -> dict[str, Any]:
    """Sockets that never finish; /health meanwhile; how many the server closed."""
    latencies: list[float] = []
    held: list[trio.SocketStream] = []
    for _ in range(slowloris):
        s = await trio.open_tcp_stream("127.0.0.1", port)
        await s.send_all(b"GET /health HTTP/1.1\r\nHost: x\r\nX-a: ")
        held.append(s)
    for i in range(randoms):
        if i % 2:
            s, _ = await connect(port)
        else:
            s = await trio.open_tcp_stream("127.0.0.1", port)
        await s.send_all(rng.randbytes(rng.randint(1, 600)))
        held.append(s)
    opened = []
    for _ in range(connections):
        s, head = await connect(port)
        opened.append(head.startswith(b"HTTP/1.1 101"))
        held.append(s)
    answered = all([await health(port, latencies) for _ in range(5)])
    closed = 0

    async def until_closed(s: trio.SocketStream) -> None:
        nonlocal closed
        while await _receive(s):
            pass
        closed += 1

    unfinished = held[:slowloris + randoms]
    with trio.move_on_after(CLOSE_WAIT):  # the idle (keep-alive) and message timeouts
        async with trio.open_nursery() as nursery:
            for s in unfinished:
                nursery.start_soon(until_closed, s)
    still_open = len(unfinished) - closed
    for s in held:
        await s.aclose()
    return {"slowloris": slowloris, "random_byte_sockets": randoms,
            "connections": connections, "connections_accepted": sum(opened),
            "health_answered": answered, "health_max_s": round(max(latencies), 3),
            "unfinished_sockets_still_open": still_open}


async def _receive(s: trio.SocketStream) -> bytes:
    try:
        return await s.receive_some(65536)
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        return b""


async def phase_memory(server: Server, bombs: int, oversize: int,
                       bomb_bytes: int) -> dict[str, Any]:
    port = server.port
    baseline = server.rss()
    peak = baseline
    latencies: list[float] = []
    codes: Counter[int | None] = Counter()
    bomb = deflate_bomb(bomb_bytes)
    big = frame(OP_BINARY, b"x" * (4 << 20))  # twice the hard cap at the default limit
    answered = True
    for i in range(max(bombs, oversize)):
        for payload, wanted in ((bomb, i < bombs), (big, i < oversize)):
            if not wanted:
                continue
            ext = "permessage-deflate" if payload is bomb else None
            s, _ = await connect(port, extensions=ext)
            data = frame(OP_BINARY, payload, rsv1=True) if payload is bomb else payload
            await send_quietly(s, data)
            codes[await read_close(s)] += 1
            await s.aclose()
            peak = max(peak, server.rss())
        if i % 10 == 0:
            answered &= await health(port, latencies)
    after = server.rss()
    for _ in range(RSS_POLLS):
        after = server.rss()
        if after <= baseline + RSS_SLACK:
            break
        await trio.sleep(RSS_POLL_SLEEP)
    return {"bombs": bombs, "bomb_compressed_bytes": len(bomb), "bomb_inflated_bytes": bomb_bytes,
            "oversize_frames": oversize, "oversize_frame_bytes": len(big),
            "close_codes": {str(k): v for k, v in codes.items()},
            "rss_baseline_mb": round(baseline / 2**20, 1), "rss_peak_mb": round(peak / 2**20, 1),
            "rss_after_mb": round(after / 2**20, 1), "health_answered": answered,
            "health_max_s": round(max(latencies, default=0.0), 3)}


async def phase_overload(port: int, count: int) -> dict[str, Any]:
    before = await stats(port)
    stream, _ = await connect(port)
    reader = FrameReader(stream)
    for n in range(count):
        req = {"type": "generate", "id": f"o{n}", "prompt": "import os\n", "max_tokens": 64,
               "temperature": 0}
        await stream.send_all(frame(OP_TEXT, json.dumps(req).encode()))
    codes: Counter[str] = Counter()
    ends = 0
    while ends < count:
        got = await reader.next()
        if got is None:
            break
        event = json.loads(got[1])
        if event["type"] in ("done", "error"):
            ends += 1
            codes[event.get("code", "done")] += 1
    await stream.aclose()
    after = await stats(port)
    return {"requests": count, "replies": dict(codes),
            "rejected_counted": after["requests_rejected"] - before["requests_rejected"]}


async def phase_slow(port: int, streams: int, max_tokens: int) -> dict[str, Any]:
    stream, _ = await connect(port, receive_buffer=4096)  # a small window, never read
    before = await stats(port)
    for i in range(streams):
        req = {"type": "generate", "id": f"s{i}", "prompt": "import os\n", "temperature": 0,
               "max_tokens": max_tokens, "logprobs": True, "top_logprobs": 20}
        await stream.send_all(frame(OP_TEXT, json.dumps(req).encode()))
    now = before
    for _ in range(RSS_POLLS * 10):
        await trio.sleep(RSS_POLL_SLEEP)
        now = await stats(port)
        if now["rows_active"] == 0 and now["streams_open"] == 0 and now["steps"] > before["steps"]:
            break
    await stream.aclose()
    return {"streams": streams, "max_tokens": max_tokens,
            "steps_until_cancelled": now["steps"] - before["steps"],
            "rows_active_after": now["rows_active"]}


async def phase_stall(port: int, prompt_chars: int) -> dict[str, Any]:
    stream, _ = await connect(port)
    reader = FrameReader(stream)
    await stream.send_all(frame(OP_TEXT, json.dumps(
        {"type": "generate", "id": "victim", "prompt": "import os\n", "max_tokens": 3000,
         "temperature": 0}).encode()))
    times: list[float] = []

    async def count() -> None:
        while (got := await reader.next()) is not None:
            if b'"token"' in got[1]:
                times.append(time.perf_counter())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(count)
        while len(times) < 50:
            await trio.sleep(0.01)
        huge, _ = await connect(port)
        huge_reader = FrameReader(huge)
        start = time.perf_counter()
        await huge.send_all(frame(OP_TEXT, json.dumps(
            {"type": "generate", "id": "huge", "prompt": ("x = 1\n" * prompt_chars)[:prompt_chars],
             "max_tokens": 1}).encode()))
        reply = await huge_reader.next()
        end = time.perf_counter()
        await huge.aclose()
        nursery.cancel_scope.cancel()
    await stream.aclose()
    window = end - start
    during = sum(start <= t <= end for t in times)
    base = [t for t in times if t < start]
    base_rate = (len(base) - 1) / (base[-1] - base[0]) if len(base) > 1 else 0.0
    return {"prompt_chars": prompt_chars, "huge_reply": json.loads(reply[1]).get("code", "ok")
            if reply else None, "window_s": round(window, 3),
            "victim_tok_s_before": round(base_rate, 1),
            "victim_tok_s_during": round(during / window, 1) if window > 0 else None,
            "victim_tokens_during": during}
