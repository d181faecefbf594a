"""How fast a full server says no: a burst of HTTP requests over the admission bound.

    python -m tqserve.tools.bench_overload --burst 1000 --out bench-out/overload.json

Starts `tqserve serve` (bundled model) as a subprocess on loopback with a small admission
bound, fills its rows and queue with long requests, then opens --burst connections at
once, each sending one POST /v1/completions, and times each answer's status line from its
connect; /health is polled through the burst, and one request admitted after it is timed
to its first streamed byte. Reports p50/p99 of the refusals (429), of /health, and that
TTFT against the same request on the idle server.

The burst's client is one thread on non-blocking sockets and epoll (a trio task per
connection costs the client itself ~0.25 ms each: 1,000 of them put a 220 ms floor under
any server). Side by side in the same run, the same burst is sent to a floor server: a
subprocess on plain trio that answers every request with a canned 429 and does nothing
else. `floor_refusal_ms` and the ratios say how far tqserve's refusal is above what this
machine and this client can show at all.
"""

from __future__ import annotations

import argparse
import json
import math
import selectors
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import trio

from tqserve.tools.attack_phases import Server

LONG = b'{"prompt": "import os\\n", "max_tokens": 4000, "stream": true}'
SHORT = b'{"prompt": "import os\\n", "max_tokens": 2}'
STREAMED = b'{"prompt": "import os\\n", "max_tokens": 8, "stream": true}'
SERVER_FLAGS = ["--max-batch", "4", "--max-queued-requests", "8", "--max-step-tokens", "64"]


def _post(body: bytes) -> bytes:
    return (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
            b"application/json\r\nConnection: close\r\nContent-Length: "
            + str(len(body)).encode() + b"\r\n\r\n" + body)


async def _first_bytes(port: int, request: bytes, until: bytes) -> tuple[float, bytes]:
    """Seconds from connect to the first received bytes containing `until`, and them."""
    start = time.perf_counter()
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(request)
        got = b""
        while until not in got:
            chunk = await stream.receive_some(65536)
            if not chunk:
                break
            got += chunk
    return time.perf_counter() - start, got


def burst(port: int, count: int, request: bytes) -> dict[str, list[float]]:
    """Open `count` connections at once, send `request` on each; by answer status, the
    seconds from each connect to its status line (blocking: run it on a thread)."""
    selector = selectors.DefaultSelector()
    started: dict[socket.socket, float] = {}
    got: dict[socket.socket, bytes] = {}
    seconds: dict[str, list[float]] = {}
    for _ in range(count):
        sock = socket.socket()
        sock.setblocking(False)
        started[sock] = time.perf_counter()
        sock.connect_ex(("127.0.0.1", port))
        got[sock] = b""
        selector.register(sock, selectors.EVENT_WRITE)
    # answers stop coming when what is left was admitted (it waits behind the held rows):
    # 2 s without one ends the burst, and those count as "pending"
    last = time.monotonic()
    while started and time.monotonic() < last + 2.0:
        for key, events in selector.select(timeout=0.5):
            last = time.monotonic()
            sock = key.fileobj  # type: ignore[assignment]
            if events & selectors.EVENT_WRITE:
                try:
                    sock.sendall(request)
                    selector.modify(sock, selectors.EVENT_READ)
                    continue
                except OSError:
                    chunk = b""
            else:
                try:
                    chunk = sock.recv(65536)
                except OSError:
                    chunk = b""
                got[sock] += chunk
                if chunk and b"\r\n" not in got[sock]:
                    continue
            line = got[sock].split(b"\r\n", 1)[0].split(b" ")
            status = line[1].decode() if len(line) > 1 and got[sock] else "none"
            seconds.setdefault(status, []).append(time.perf_counter() - started.pop(sock))
            selector.unregister(sock)
            sock.close()
    for sock in started:
        seconds.setdefault("pending", []).append(math.inf)
        sock.close()
    return seconds


CANNED = (b"HTTP/1.1 429 Too Many Requests\r\ncontent-length: 2\r\nconnection: close"
          b"\r\n\r\n{}")


async def floor_server(task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
    """The floor: read a request head, answer a canned 429, close; nothing else."""
    async def answer(stream: trio.SocketStream) -> None:
        async with stream:
            head = b""
            while b"\r\n\r\n" not in head:
                chunk = await stream.receive_some(65536)
                if not chunk:
                    return
                head += chunk
            await stream.send_all(CANNED)

    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1", backlog=4096)
    task_status.started(listeners[0].socket.getsockname()[1])
    await trio.serve_listeners(answer, listeners)


def measure_floor(count: int) -> dict[str, Any]:
    """The same burst against the floor server, in a subprocess of its own."""
    proc = subprocess.Popen([sys.executable, "-m", "tqserve.tools.bench_overload",
                             "--floor-server"], stdout=subprocess.PIPE, text=True)
    try:
        port = int(proc.stdout.readline()) if proc.stdout else 0
        seconds = burst(port, count, _post(SHORT))
    finally:
        proc.kill()
        proc.wait()
    refusals = seconds.get("429", [])
    return {"statuses": {k: len(v) for k, v in seconds.items()},
            "p50": _pct(refusals, 0.5), "p99": _pct(refusals, 0.99)}


async def _hold(port: int, request: bytes) -> None:
    """Send `request` and read its answer away until the server ends it (kept: nothing,
    so that the bench's own loop stays idle under long streams)."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(request)
        while await stream.receive_some(65536):
            pass


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return round(1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))], 1) if ordered else 0.0


async def measure(port: int, count: int, held: int) -> dict[str, Any]:
    idle_ttft, _ = await _first_bytes(port, _post(STREAMED), b"data:")
    async with trio.open_nursery() as keep:  # long streams that hold every row and slot
        for _ in range(held):
            keep.start_soon(_hold, port, _post(LONG))
        await trio.sleep(2.0)
        health: list[float] = []
        done = trio.Event()
        result: list[dict[str, list[float]]] = []

        async def shoot() -> None:
            result.append(await trio.to_thread.run_sync(burst, port, count, _post(SHORT)))

        async def poll_health() -> None:
            while not done.is_set():
                seconds, _ = await _first_bytes(
                    port, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
                    b"\r\n")
                health.append(seconds)
                await trio.sleep(0.05)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(poll_health)
            await shoot()
            done.set()
        keep.cancel_scope.cancel()
    await trio.sleep(1.0)
    after_ttft, _ = await _first_bytes(port, _post(STREAMED), b"data:")
    refusals = result[0].get("429", [])
    return {"burst": count, "statuses": {k: len(v) for k, v in result[0].items()},
            "refusal_ms": {"p50": _pct(refusals, 0.5), "p99": _pct(refusals, 0.99)},
            "health_ms": {"p50": _pct(health, 0.5), "p99": _pct(health, 0.99),
                          "max": _pct(health, 1.0), "polls": len(health)},
            "idle_ttft_ms": round(1000 * idle_ttft, 1),
            "ttft_after_burst_ms": round(1000 * after_ttft, 1),
            "median_refusal_ms": round(1000 * statistics.median(refusals), 1) if refusals else None}


def _measure_started(acceptor: str, count: int) -> dict[str, Any]:
    server = Server([*SERVER_FLAGS, "--acceptor", acceptor])
    try:
        return trio.run(measure, server.port, count, 12)
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--burst", type=int, default=1000, help="connections opened at once")
    p.add_argument("--port", type=int, default=0,
                   help="attack a server already listening on this loopback port (it needs "
                        "--max-batch 4 --max-queued-requests 8); 0: start one")
    p.add_argument("--acceptor", default="process,off", metavar="MODE,...",
                   help="the server's --acceptor settings to measure, one server each (the "
                        "top-level figures are the first one's)")
    p.add_argument("--out", type=Path, default=Path("bench-out/overload.json"))
    p.add_argument("--floor-server", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.floor_server:  # the floor's subprocess: print the port, serve until killed
        async def floor() -> None:
            async with trio.open_nursery() as nursery:
                print(await nursery.start(floor_server), flush=True)
        trio.run(floor)
        return 0
    if args.port:
        report = trio.run(measure, args.port, args.burst, 12)
    else:
        by_mode = {mode: _measure_started(mode, args.burst) for mode in args.acceptor.split(",")}
        report = {**next(iter(by_mode.values())), "by_acceptor": by_mode}
    floor = measure_floor(args.burst)
    report["floor_refusal_ms"] = floor
    for part in (report, *report.get("by_acceptor", {}).values()):
        part["vs_floor"] = {q: round(part["refusal_ms"][q] / floor[q], 2) if floor[q] else None
                            for q in ("p50", "p99")}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
