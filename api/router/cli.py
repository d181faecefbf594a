"""`tqserve route --backend URL [--backend URL ...]`: run the router until SIGTERM/SIGINT.

The flags map 1:1 onto RouterConfig and RoutingConfig. Bad arguments print one line
and exit with code 2. On SIGTERM or SIGINT the router drains: it stops admitting,
in-flight requests finish (up to --shutdown-timeout), then it exits 0.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from typing import NoReturn, Sequence

import trio

from tqserve.api.httpconn import TIMEOUT_FLAGS, HttpLimits, add_timeout_flags
from tqserve.api.router.core import POLICIES, RoutingConfig
from tqserve.api.router.service import RouterConfig


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    r, c = RoutingConfig(), RouterConfig(backends=("http://x",))
    p = _Parser(prog="tqserve route", description="Prefix-aware router in front of N "
                "tqserve servers (same WebSocket and HTTP APIs).",
                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--backend", action="append", required=True, metavar="URL",
                   help="a tqserve server, http://host:port (repeat for each replica)")
    p.add_argument("--host", default=c.host, help="address to listen on")
    p.add_argument("--port", type=int, default=c.port, help="port (0: any free port)")
    p.add_argument("--policy", choices=POLICIES, default=r.policy,
                   help="prefix: affinity by prompt prefix blocks, load-aware; "
                        "round-robin: ignore prefixes")
    p.add_argument("--block-tokens", type=int, default=r.block_tokens,
                   help="token ids per prefix block (prompt_tokens requests)")
    p.add_argument("--block-chars", type=int, default=r.block_chars,
                   help="characters per prefix block (text prompts and chat messages)")
    p.add_argument("--max-keys", type=int, default=r.max_keys,
                   help="prefix keys remembered (LRU) across all backends")
    p.add_argument("--spill-threshold", type=int, default=r.spill_threshold,
                   help="an affinity target with this many more requests in flight than "
                        "the least loaded backend spills to it")
    p.add_argument("--min-match-fraction", type=float, default=r.min_match_fraction,
                   help="affinity only when the known prefix covers this fraction of the "
                        "prompt's blocks")
    p.add_argument("--health-interval", type=float, default=c.health_interval,
                   help="seconds between /health checks of each backend")
    p.add_argument("--health-timeout", type=float, default=c.health_timeout,
                   help="seconds a /health check may take")
    p.add_argument("--health-failures", type=int, default=r.health_failures,
                   help="consecutive failed checks that take a backend out (a connection "
                        "lost under a request takes it out at once)")
    p.add_argument("--max-attempts", type=int, default=c.max_attempts,
                   help="backends a request may be tried on before its first token")
    p.add_argument("--max-message-bytes", type=int, default=c.max_message_bytes,
                   help="largest WebSocket frame / HTTP body a client may send")
    p.add_argument("--max-streams-per-connection", type=int,
                   default=c.max_streams_per_connection, help="concurrent requests on one "
                   "client WebSocket")
    p.add_argument("--backend-streams", type=int, default=c.backend_streams,
                   help="requests per WebSocket to a backend (<= its "
                        "--max-streams-per-connection)")
    p.add_argument("--api-key", default=os.environ.get("TQSERVE_API_KEY") or None,
                   help="require this key ('Authorization: Bearer KEY' or x-api-key) on "
                        "every route but /health and on the WebSocket upgrade (default: "
                        "$TQSERVE_API_KEY; unset = no auth)")
    p.add_argument("--backend-api-key", default=os.environ.get("TQSERVE_BACKEND_API_KEY")
                   or None, help="key the router sends to the backends (WebSocket and "
                   "HTTP; default: $TQSERVE_BACKEND_API_KEY; unset = HTTP requests forward "
                   "the client's own key)")
    p.add_argument("--admin-key", default=None,
                   help="enables POST /admin/drain (drain or undrain one backend) for "
                        "'Authorization: Bearer KEY' (default: off)")
    p.add_argument("--shutdown-timeout", type=float, default=c.shutdown_timeout,
                   help="on SIGTERM/SIGINT, seconds in-flight requests get to finish")
    p.add_argument("--max-connections", type=int, default=c.http.max_connections,
                   help="open client connections (HTTP and WebSocket) at once (a request "
                        "beyond it: HTTP 503, code too_many_connections)")
    add_timeout_flags(p, c.http)
    p.add_argument("--allowed-origins", default="", metavar="ORIGIN,...",
                   help="browser origins allowed besides the router's own and loopback "
                        "ones, comma-separated (* = any)")
    p.add_argument("--backend-read-timeout", type=float, default=c.backend_read_timeout,
                   metavar="SECONDS", help="a backend sending nothing this long under a request: "
                   "504 / error frame / SSE error event backend_timeout")
    p.add_argument("--max-backend-bytes", type=int, default=c.max_backend_bytes,
                   help="bytes of a backend's whole answer, or of one SSE event, the router "
                        "holds (over it: 502 backend_failed)")
    return p


def config_from(args: argparse.Namespace) -> RouterConfig:
    """The RouterConfig of parsed flags; ValueError naming the flag."""
    routing_fields = ("policy", "block_tokens", "block_chars", "max_keys", "spill_threshold",
                      "min_match_fraction", "health_failures")
    try:
        routing = RoutingConfig(**{k: getattr(args, k) for k in routing_fields})
        http = HttpLimits(**{k: getattr(args, k) for k in (*TIMEOUT_FLAGS, "max_connections")})
        return RouterConfig(
            backends=tuple(args.backend), routing=routing, http=http,
            **{k: getattr(args, k) for k in (
                "host", "port", "health_interval", "health_timeout", "max_attempts",
                "max_message_bytes", "max_streams_per_connection", "backend_streams",
                "api_key", "backend_api_key", "admin_key", "shutdown_timeout",
                "backend_read_timeout", "max_backend_bytes", "allowed_origins")})
    except ValueError as exc:
        message = str(exc)
        if message.startswith("'"):  # attrs validators: "'name' must be >= 1: 0"
            name = message.split("'")[1]
            message = f"--{name.replace('_', '-')}{message.split(chr(39), 2)[2]}"
        raise ValueError(message) from None


async def _route(config: RouterConfig) -> int:
    from tqserve.api.router.app import serve_router

    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    trigger = trio.Event()
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        received: list[int] = []

        async def watch() -> None:
            async for signum in signals:
                if not received:
                    received.append(signum)
                    trigger.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch)

            async def run(task_status: trio.TaskStatus[str]) -> None:
                await serve_router(config, shutdown_trigger=trigger, task_status=task_status)
                nursery.cancel_scope.cancel()

            url = await nursery.start(run)
            print(f"tqserve: routing {len(config.backends)} backends "
                  f"({config.routing.policy}) on {url} (WebSocket /v1/stream; HTTP "
                  "/v1/completions, /v1/chat/completions, /v1/messages, /metrics)", flush=True)
    name = signal.Signals(received[0]).name if received else "exit"
    print(f"tqserve: router shut down on {name}", file=sys.stderr, flush=True)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        config = config_from(args)
        return trio.run(_route, config)
    except ValueError as exc:
        print(f"tqserve route: error: {exc}", file=sys.stderr)
        return 2
    except BaseExceptionGroup as group:  # raised inside the nursery (a taken port)
        leaf = group
        while isinstance(leaf, BaseExceptionGroup) and len(leaf.exceptions) == 1:
            leaf = leaf.exceptions[0]
        if not isinstance(leaf, ValueError):
            raise
        print(f"tqserve route: error: {leaf}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
