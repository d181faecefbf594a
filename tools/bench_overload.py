"""How fast a full server says no: a burst of HTTP requests over the admission bound.

    python -m tqserve.tools.bench_overload --burst 1000 --out bench-out/overload.json

Starts `tqserve serve` (bundled model) as a subprocess on loopback with a small admission
bound, fills its rows and queue with long requests, then opens --burst connections at
once, each sending one POST /v1/completions (raw sockets: the client's own cost stays
small), and times each answer's status line; /health is polled through the burst, and one
request admitted after it is timed to its first streamed byte. Reports p50/p99 of the
refusals (429), of /health, and that TTFT against the same request on the idle server.
"""

from __future__ import annotations

import argparse
import json
import statistics
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


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return round(1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))], 1) if ordered else 0.0


async def measure(port: int, burst: int, held: int) -> dict[str, Any]:
    idle_ttft, _ = await _first_bytes(port, _post(STREAMED), b"data:")
    async with trio.open_nursery() as keep:  # long streams that hold every row and slot
        for _ in range(held):
            keep.start_soon(_first_bytes, port, _post(LONG), b"\r\n\r\n0\r\n\r\n")
        await trio.sleep(2.0)
        refusals: list[float] = []
        statuses: dict[str, int] = {}
        health: list[float] = []
        done = trio.Event()

        async def one() -> None:
            seconds, got = await _first_bytes(port, _post(SHORT), b"\r\n")
            status = got.split(b" ", 2)[1].decode() if got.count(b" ") >= 2 else "none"
            statuses[status] = statuses.get(status, 0) + 1
            if status == "429":
                refusals.append(seconds)

        async def poll_health() -> None:
            while not done.is_set():
                seconds, _ = await _first_bytes(
                    port, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
                    b"\r\n")
                health.append(seconds)
                await trio.sleep(0.05)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(poll_health)
            async with trio.open_nursery() as shots:
                for _ in range(burst):
                    shots.start_soon(one)
            done.set()
        keep.cancel_scope.cancel()
    await trio.sleep(1.0)
    after_ttft, _ = await _first_bytes(port, _post(STREAMED), b"data:")
    return {"burst": burst, "statuses": statuses,
            "refusal_ms": {"p50": _pct(refusals, 0.5), "p99": _pct(refusals, 0.99)},
            "health_ms": {"p50": _pct(health, 0.5), "p99": _pct(health, 0.99),
                          "max": _pct(health, 1.0), "polls": len(health)},
            "idle_ttft_ms": round(1000 * idle_ttft, 1),
            "ttft_after_burst_ms": round(1000 * after_ttft, 1),
            "median_refusal_ms": round(1000 * statistics.median(refusals), 1) if refusals else None}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--burst", type=int, default=1000, help="connections opened at once")
    p.add_argument("--port", type=int, default=0,
                   help="attack a server already listening on this loopback port (it needs "
                        "--max-batch 4 --max-queued-requests 8); 0: start one")
    p.add_argument("--out", type=Path, default=Path("bench-out/overload.json"))
    args = p.parse_args(argv)
    if args.port:
        report = trio.run(measure, args.port, args.burst, 12)
    else:
        server = Server(SERVER_FLAGS)
        try:
            report = trio.run(measure, server.port, args.burst, 12)
        finally:
            server.stop()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
