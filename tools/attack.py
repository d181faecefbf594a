"""A bounded attack run against a tqserve on loopback; writes the figures as JSON.

    python -m tqserve.tools.attack --out bench-out/attack.json            # spawns its own server
    python -m tqserve.tools.attack --fuzz 200 --bombs 10 --oversize 10    # smaller

It starts `tqserve serve` (bundled model, default limits, except --ws-message-timeout,
which the run shortens so that its waits stay short) as a subprocess on a loopback port,
runs each phase with a bounded count, reads the server's RSS from /proc, and stops the
server. Nothing leaves 127.0.0.1. The phases and what must hold (`invariants`):

* fuzz: mutated JSON and msgpack generate/cancel frames -> no `internal_error`, no socket
  closed by the server.
* cancels: requests cancelled at random moments -> 0 rows, 0 KV bytes, 0 streams after.
* pings: WebSocket pings -> each answered with a pong.
* slowloris / random bytes / connections: sockets that never finish a request, random
  bytes (raw and after a handshake), many open WebSockets -> /health answers meanwhile;
  every socket that never completes a request or a message is closed by the server.
* bombs / oversize: permessage-deflate bombs (1 GiB inflated) and oversize frames ->
  closed (1002 / 1009), /health answers, RSS returns within 50 MB of its baseline.
* overload: a burst over the admission bound -> every refusal counted in /v1/stats.
* slow: a client that never reads -> its rows are cancelled (rows_active back to 0) long
  before max_tokens, while its socket stays open.
* stall: a victim stream's tokens/s before and while a 250k-character prompt is tokenized
  (on a worker thread) -> the victim goes on.
* http (tools.attack_http): sockets that send one request and stay, bodies trickled a
  byte at a time, a 16 MB Content-Length, a hostile Origin -> every idle socket closed,
  every trickled body 408 and closed, every oversized body 413 unread, the hostile
  Origin 403 and a loopback one 101; /health and a WebSocket work meanwhile.
* grammars, prefill_cancel, cache_dir (tools.attack_engine): grammar and `$defs` bombs ->
  400 naming the limit; cancels inside batched prefill groups -> no other stream harmed;
  a `.tmp-*` symlink removed at start, the cache dir removed under a running server ->
  it goes on serving.

* router (tools.attack_router): a backend that never answers, one that floods, the
  router's two keys -> 504 `backend_timeout`, 502 `backend_failed` within the byte limit
  (RSS within 64 MiB), the admin route on the admin key only, /v1/models on the client's.

* kv_budget (tools.attack_engine): long rows at once against an 8 MiB KV budget -> KV
  bytes within it, every row served.

Not covered here (its own test is): an unreadable cache dir (chmod 000 means nothing to root:
tests/e2e/test_cache_dir_failures.py).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any

import trio

from tqserve.tools.attack_engine import (phase_cache_dir, phase_grammars, phase_kv_budget,
                                         phase_prefill_cancel)
from tqserve.tools.attack_http import phase_http
from tqserve.tools.attack_router import phase_router
from tqserve.tools.attack_phases import (Server, phase_cancels, phase_fuzz, phase_held, phase_memory,
                                 phase_overload, phase_pings, phase_slow, phase_stall)

PHASE_TIMEOUT = 120.0       # seconds any one phase may take before the run fails
SLOW_STREAMS = 32          # requests of the client that never reads (they fill the socket ...
SLOW_MAX_TOKENS = 4000     # ... buffers sooner together) and what each asks for


async def attack(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    server = Server(["--ws-message-timeout", str(args.ws_message_timeout),
                     "--max-streams-per-connection", "64", "--max-queued-requests", "8",
                     "--stream-buffer", "64", "--http-header-timeout",
                     str(args.http_timeout), "--http-body-timeout", str(args.http_timeout)])
    out: dict[str, Any] = {"server": {"ws_message_timeout": args.ws_message_timeout,
                                      "max_queued_requests": 8, "stream_buffer": 64,
                                      "http_header_and_body_timeout": args.http_timeout}}
    try:
        with trio.fail_after(PHASE_TIMEOUT):
            out["fuzz"] = await phase_fuzz(server.port, args.fuzz, rng)
        with trio.fail_after(PHASE_TIMEOUT):
            out["cancels"] = await phase_cancels(server.port, args.cancels, rng)
        with trio.fail_after(PHASE_TIMEOUT):
            out["pings"] = await phase_pings(server.port, args.pings)
        with trio.fail_after(PHASE_TIMEOUT):
            out["held"] = await phase_held(server.port, args.slowloris, args.random,
                                           args.connections, rng)
        with trio.fail_after(PHASE_TIMEOUT):
            out["memory"] = await phase_memory(server, args.bombs, args.oversize,
                                               args.bomb_bytes)
        with trio.fail_after(PHASE_TIMEOUT):
            out["overload"] = await phase_overload(server.port, args.overload)
        with trio.fail_after(PHASE_TIMEOUT):
            out["slow"] = await phase_slow(server.port, SLOW_STREAMS, SLOW_MAX_TOKENS)
        with trio.fail_after(PHASE_TIMEOUT):
            out["stall"] = await phase_stall(server.port, 250_000)
        with trio.fail_after(PHASE_TIMEOUT):
            out["http"] = await phase_http(server.port, args.idle, args.trickle,
                                           args.oversize_bodies)
        with trio.fail_after(PHASE_TIMEOUT):
            out["grammars"] = await phase_grammars(server.port)
        with trio.fail_after(PHASE_TIMEOUT):
            out["prefill_cancel"] = await phase_prefill_cancel(server.port, args.prefill_rounds,
                                                               rng)
        with trio.fail_after(PHASE_TIMEOUT):
            out["router"] = await phase_router(server.port)
        out["server_alive"] = server.alive()
    finally:
        server.stop()
    with trio.fail_after(PHASE_TIMEOUT):
        out["cache_dir"] = await phase_cache_dir()
    with trio.fail_after(PHASE_TIMEOUT):
        out["kv_budget"] = await phase_kv_budget(args.kv_rows)
    out["invariants"] = invariants(out)
    return out


def invariants(out: dict[str, Any]) -> dict[str, bool]:
    """What must hold after the run (the module docstring), by name."""
    mem, held, web = out["memory"], out["held"], out["http"]
    grammars, prefill, cache = out["grammars"], out["prefill_cancel"], out["cache_dir"]
    router, kv = out["router"], out["kv_budget"]
    return {
        "no_internal_error": out["fuzz"]["internal_error"] == 0,
        "fuzz_sockets_kept": out["fuzz"]["sockets_closed_by_server"] == 0,
        "cancels_leave_nothing": (out["cancels"]["rows_active"], out["cancels"]["kv_bytes"],
                                  out["cancels"]["streams_open"]) == (0, 0, 0),
        "pings_answered": out["pings"]["pongs"] == out["pings"]["pings"],
        "health_during_held_sockets": held["health_answered"],
        "unfinished_sockets_closed": held["unfinished_sockets_still_open"] == 0,
        "health_during_bombs": mem["health_answered"],
        # None: the connection was reset before the close frame could be read
        "bombs_and_oversize_closed": set(mem["close_codes"]) <= {"1002", "1009", "None"},
        "rss_back_within_50mb": mem["rss_after_mb"] - mem["rss_baseline_mb"] <= 50,
        "every_refusal_counted": (out["overload"]["rejected_counted"]
                                  == out["overload"]["requests"]
                                  - out["overload"]["replies"].get("done", 0)),
        "slow_client_rows_cancelled": (out["slow"]["rows_active_after"] == 0
                                       and out["slow"]["steps_until_cancelled"]
                                       < SLOW_MAX_TOKENS // 2),
        "victim_goes_on_during_huge_prompt": out["stall"]["victim_tokens_during"] > 0,
        "idle_http_sockets_closed": web["idle_closed"] == web["idle_sockets"],
        "health_and_ws_during_idle_sockets": web["health_answered"]
        and web["websocket_accepted"],
        "trickled_bodies_408": web["trickle_408"] == web["trickled_bodies"],
        "oversize_bodies_413": web["oversize_413"] == web["oversize_requests"],
        "hostile_origin_refused": web["origin_status"] == {"http://evil.example": 403,
                                                           "http://localhost:3000": 101},
        "grammar_bombs_400_naming_the_limit": grammars["statuses"] == [400, 400]
        and grammars["limit_named"] == 2 and grammars["served_after"] == 200,
        "prefill_group_cancels_harm_no_other_row": prefill["internal_error"] == 0
        and (prefill["rows_active_after"], prefill["kv_bytes_after"]) == (0, 0),
        "tmp_symlink_removed_at_start": cache["tmp_symlink_removed"]
        and cache["symlink_target_kept"],
        "cache_dir_removed_server_serves": cache["server_alive"]
        and (cache["first"], cache["after_removal"]) == (200, 200),
        "router_bounds_its_backends": (router["silent"]["status"], router["silent"]["code"],
                                       router["flood"]["status"], router["flood"]["code"])
        == (504, "backend_timeout", 502, "backend_failed") and router["rss_growth_mb"] <= 64,
        "router_keys": router["keys"] == {"models_client_key": 200, "models_no_key": 401,
                                          "drain_admin_key": 200, "drain_client_key": 401},
        "kv_bytes_within_the_budget": kv["peak_kv_charged_bytes"] <= kv["kv_budget_bytes"]
        and kv["peak_kv_bytes"] <= kv["kv_budget_bytes"]
        and kv["peak_rows_active"] < kv["requests"]  # some waited for the budget
        and kv["ends"] == {"finish:length": kv["requests"]} and kv["server_alive"],
        "server_alive": out["server_alive"],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tqserve.tools.attack", description=__doc__.split("\n")[0])
    for name, default in (("fuzz", 2000), ("cancels", 500), ("pings", 5000), ("slowloris", 200),
                          ("random", 100), ("connections", 500), ("bombs", 100),
                          ("oversize", 100), ("overload", 200), ("seed", 0), ("idle", 1000),
                          ("trickle", 50), ("oversize_bodies", 40), ("prefill_rounds", 10),
                          ("kv_rows", 24)):
        p.add_argument("--" + name.replace("_", "-"), type=int, default=default)
    p.add_argument("--bomb-bytes", type=int, default=1 << 30, help="inflated size of a bomb")
    p.add_argument("--ws-message-timeout", type=float, default=3.0)
    p.add_argument("--http-timeout", type=float, default=3.0,
                   help="the server's --http-header-timeout and --http-body-timeout")
    p.add_argument("--out", default=None, help="write the JSON here (default: stdout only)")
    args = p.parse_args(argv)
    result = trio.run(attack, args)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    return 0 if all(result["invariants"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
