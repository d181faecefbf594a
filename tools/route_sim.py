"""`python -m tqserve.tools.route_sim TRACE`: what prefix-aware routing predicts for N
replicas on a Mooncake trace, with no server (the router's own sans-io route table decides).

    python -m tqserve.tools.route_sim mooncake_conversation_trace.jsonl --replicas 1 2 4 8

Every request of the trace, in arrival order, is routed by `api.router.core.RouteTable`
(policy prefix, then round-robin) with its 512-token hash blocks as the prefix blocks.
Each replica holds the prefixes it has served, in an LRU of `--replica-blocks` blocks
(default: unbounded), and a request reuses the longest of its prefixes that its replica
holds (at most input_length - 1 tokens, as a server reuses). The model ignores load: no
request is in flight when the next arrives, so affinity never spills; a real run at load
spills some requests (and loses their reuse), so these are upper bounds for each policy.
Prints, per N and policy, the reused fraction of prompt tokens and the load balance
(requests on the busiest replica / the mean); `--json` writes them too.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import OrderedDict
from typing import Any, NoReturn, Sequence

from tqserve.api.router.core import HealthEvent, RouteTable, RoutingConfig, token_keys

MOONCAKE_BLOCK = 512  # tokens per hash block in the Mooncake traces


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def read_trace(path: str) -> list[tuple[int, list[int]]]:
    """(input_length, hash_ids) of every Mooncake row; ValueError naming a bad line."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                rows.append((int(row["input_length"]), [int(h) for h in row["hash_ids"]]))
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{lineno}: not a Mooncake row: {exc}") from None
    if not rows:
        raise ValueError(f"{path}: no requests")
    return rows


def simulate(rows: Sequence[tuple[int, list[int]]], replicas: int, policy: str,
             replica_blocks: int | None = None,
             min_match_fraction: float = RoutingConfig().min_match_fraction
             ) -> dict[str, Any]:
    """Route every row; the reused fraction and the load balance (see the module doc)."""
    names = [f"r{i}" for i in range(replicas)]
    table = RouteTable(names, RoutingConfig(policy=policy, block_tokens=1,
                                            min_match_fraction=min_match_fraction))
    for name in names:
        table.set_health(name, HealthEvent.UP)
    held: dict[str, OrderedDict[bytes, None]] = {n: OrderedDict() for n in names}
    served = dict.fromkeys(names, 0)
    total = reused = 0
    for n_in, ids in rows:
        keys = token_keys(ids, 1)
        route = table.choose(keys)
        table.started(route, keys)
        table.finished(route.backend)
        cache = held[route.backend]
        depth = next((d for d in range(len(keys), 0, -1) if keys[d - 1] in cache), 0)
        reused += min(depth * MOONCAKE_BLOCK, n_in - 1)
        total += n_in
        for key in keys:
            cache[key] = None
            cache.move_to_end(key)
        while replica_blocks is not None and len(cache) > replica_blocks:
            cache.popitem(last=False)
        served[route.backend] += 1
    mean = len(rows) / replicas
    return {"replicas": replicas, "policy": policy, "reused_fraction": reused / total,
            "balance": max(served.values()) / mean}


def main(argv: Sequence[str] | None = None) -> int:
    p = _Parser(prog="python -m tqserve.tools.route_sim", description=__doc__.split("\n\n")[0])
    p.add_argument("trace", help="Mooncake .jsonl")
    p.add_argument("--replicas", type=int, nargs="+", default=[1, 2, 3, 4, 8])
    p.add_argument("--replica-blocks", type=int, default=None,
                   help="512-token blocks each replica's prefix cache holds (default: all)")
    p.add_argument("--max-requests", type=int, default=None)
    p.add_argument("--json", default=None, metavar="FILE")
    args = p.parse_args(argv)
    try:
        if any(n < 1 for n in args.replicas):
            raise ValueError("--replicas: each count must be >= 1")
        if args.replica_blocks is not None and args.replica_blocks < 1:
            raise ValueError("--replica-blocks must be >= 1")
        rows = read_trace(args.trace)[:args.max_requests]
    except (OSError, ValueError) as exc:
        print(f"route_sim: error: {exc}", file=sys.stderr)
        return 2
    out = []
    print(f"{'replicas':>8} {'policy':>12} {'reused':>8} {'balance':>8}")
    for n in args.replicas:
        for policy in ("prefix", "round-robin"):
            r = simulate(rows, n, policy, args.replica_blocks)
            out.append(r)
            print(f"{n:>8} {policy:>12} {r['reused_fraction']:>8.3f} {r['balance']:>8.2f}")
            if n == 1:
                break  # one replica: both policies are the same server
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"trace": args.trace, "rows": len(rows), "results": out}, f, indent=1)
    return 0 if all(math.isfinite(r["reused_fraction"]) for r in out) else 1


if __name__ == "__main__":
    sys.exit(main())
