"""The attack's phases against the engine behind the server (tools.attack): hostile
grammars, cancels inside batched prefill groups, and the cache dir taken away.

* grammars: a 3,000-rule Lark chain and a json_schema of 3,000 `$defs` chained by `$ref`
  (each once killed the server with SIGSEGV) -> 400 naming the limit; the next request
  is served.
* prefill_cancel: rounds of prompts of different lengths sent together (they prefill as
  one group) and an unrelated stream, the longest disconnected after a random delay ->
  no stream ends with `internal_error`, nothing leaks.
* kv_budget (a server of its own, `--kv-budget-bytes` 8 MiB): long rows sent at once ->
  only as many decode as the budget holds, the rest wait; KV bytes never pass it.
* cache_dir (a server of its own, `--cache-dir`): a `.tmp-*` symlink left in the dir is
  removed at start (its target is not); the dir removed under the running server -> the
  next SSD hit is a miss, counted in `ssd_errors`, and the server stays up.
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import trio

from tqserve.tools.attack_phases import Server, stats

CHAT = "/v1/chat/completions"


def lark_chain(n: int) -> dict[str, Any]:
    lines = ["start: r0"] + [f'r{i}: "t{i}" r{i + 1}?' for i in range(n)] + [f'r{n}: "e"']
    return {"type": "grammar", "lark": "\n".join(lines)}


def defs_chain(n: int) -> dict[str, Any]:
    defs: dict[str, Any] = {
        f"d{i}": {"type": "object", "properties": {"x": {"$ref": f"#/$defs/d{i + 1}"}},
                  "required": ["x"]} for i in range(n)}
    defs[f"d{n}"] = {"type": "string"}
    return {"type": "json_schema",
            "json_schema": {"name": "chain", "schema": {"$ref": "#/$defs/d0", "$defs": defs}}}


def request(path: str, body: dict[str, Any]) -> bytes:
    """A whole JSON POST on a connection of its own (Connection: close)."""
    data = json.dumps(body).encode()
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Connection: close\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)


async def exchange(port: int, raw: bytes) -> tuple[int, bytes]:
    """Send a whole request on a connection of its own (loopback) and read the answer to
    the connection's end: (status, body)."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(raw)
        got = b""
        while chunk := await stream.receive_some(65536):
            got += chunk
    head, _, rest = got.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), rest


async def post(port: int, path: str, body: dict[str, Any]) -> tuple[int, bytes]:
    """One JSON POST on its own connection, read to its end: (status, body)."""
    return await exchange(port, request(path, body))


async def phase_grammars(port: int) -> dict[str, Any]:
    out: dict[str, Any] = {"statuses": [], "limit_named": 0}
    for fmt in (lark_chain(3000), defs_chain(3000)):
        status, body = await post(port, CHAT, {"messages": [{"role": "user", "content": "x"}],
                                               "max_tokens": 4, "response_format": fmt})
        out["statuses"].append(status)
        out["limit_named"] += b"more than 1000" in body
    out["served_after"] = (await post(port, CHAT, {
        "messages": [{"role": "user", "content": "x"}], "max_tokens": 4}))[0]
    return out


async def _stream(port: int, prompt: str, ends: list[str], cancel_after: float = math.inf,
                  max_tokens: int = 8) -> None:
    """A streamed completion; its end ("finish:<reason>", "error:<code>"), or "cancelled"
    when it has not ended `cancel_after` seconds after it started (the client disconnects)."""
    got = b""
    with trio.move_on_after(cancel_after) as scope:
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        async with stream:
            await stream.send_all(request("/v1/completions", {
                "prompt": prompt, "max_tokens": max_tokens, "stream": True, "temperature": 0}))
            while chunk := await stream.receive_some(65536):
                got += chunk
    code = re.search(rb'"code":\s*"(\w+)"', got)
    reasons = re.findall(rb'"finish_reason":\s*"(\w+)"', got)
    if scope.cancelled_caught:
        ends.append("cancelled")
    elif code is not None:
        ends.append("error:" + code.group(1).decode())
    else:
        ends.append("finish:" + (reasons[-1].decode() if reasons else "none"))


async def phase_prefill_cancel(port: int, rounds: int, rng: random.Random) -> dict[str, Any]:
    ends: list[str] = []
    for _ in range(rounds):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_stream, port, "def f():\n", ends)  # unrelated
            for repeat in (rng.randint(5, 40), rng.randint(40, 120)):
                nursery.start_soon(_stream, port, "import os\n" * repeat, ends)
            nursery.start_soon(_stream, port, "x = [1, 2]\n" * rng.randint(150, 300), ends,
                               rng.uniform(0.0, 0.3))
    with trio.fail_after(30):
        while (s := await stats(port)).get("rows_active") or s.get("streams_open") or (
                s.get("kv_bytes")):
            await trio.sleep(0.05)
    return {"rounds": rounds, "ends": {e: ends.count(e) for e in sorted(set(ends))},
            "internal_error": ends.count("error:internal_error"),
            "rows_active_after": s.get("rows_active"), "kv_bytes_after": s.get("kv_bytes")}


async def _remove(directory: Path) -> None:
    """Remove the directory under the running server: a write it finishes meanwhile may
    rename a file inside it (or make the directory again), so try until it is gone."""
    for _ in range(100):
        shutil.rmtree(directory, ignore_errors=True)
        if not directory.exists():
            return
        await trio.sleep(0.02)
    raise RuntimeError(f"could not remove {directory}")


async def phase_cache_dir() -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="tqserve-attack-") as root:
        cache, target = Path(root, "cache"), Path(root, "target")
        cache.mkdir(mode=0o700)
        target.write_text("keep me")
        os.symlink(target, cache / ".tmp-planted")
        server = Server(["--cache-dir", str(cache), "--ram-cache-bytes", "1",
                         "--ssd-flush", "sync"])
        try:
            out: dict[str, Any] = {"tmp_symlink_removed": not os.path.lexists(
                cache / ".tmp-planted"), "symlink_target_kept": target.exists()}
            body = {"prompt": "import os\n" * 20, "max_tokens": 4, "temperature": 0}
            out["first"] = (await post(server.port, "/v1/completions", body))[0]
            await _remove(cache)
            out["after_removal"] = (await post(server.port, "/v1/completions", body))[0]
            prefix = (await stats(server.port)).get("prefix_cache", {})
            out["ssd_errors"] = prefix.get("ssd_errors")
            out["ssd_state"] = prefix.get("ssd_state")
            out["server_alive"] = server.alive()
        finally:
            server.stop()
    return out


async def _watch(port: int, peak: dict[str, int]) -> None:
    """Keep the highest figure of each of `peak`'s /v1/stats fields, until cancelled."""
    while True:
        current = await stats(port)
        for key in peak:
            peak[key] = max(peak[key], current.get(key, 0))
        await trio.sleep(0.05)


KV_BUDGET = 8 << 20  # the kv_budget phase's server: a few long rows of the bundled model


async def phase_kv_budget(requests: int) -> dict[str, Any]:
    """`requests` long rows at once against a server whose KV budget holds only some:
    the rest wait in the queue; the KV bytes never pass the budget."""
    server = Server(["--kv-budget-bytes", str(KV_BUDGET), "--max-batch", "32",
                     "--max-queued-requests", str(requests)])
    ends: list[str] = []
    peak = {"kv_bytes": 0, "kv_charged_bytes": 0, "rows_active": 0}
    try:
        async with trio.open_nursery() as nursery:
            for i in range(requests):
                nursery.start_soon(_stream, server.port, f"# row {i}\n", ends, math.inf, 300)

            async with trio.open_nursery() as watching:
                watching.start_soon(_watch, server.port, peak)
                while len(ends) < requests:
                    await trio.sleep(0.1)
                watching.cancel_scope.cancel()
        out = {"requests": requests, "kv_budget_bytes": KV_BUDGET, **{f"peak_{k}": v for k, v in
                                                                      peak.items()},
               "ends": {e: ends.count(e) for e in sorted(set(ends))},
               "server_alive": server.alive()}
    finally:
        server.stop()
    return out
