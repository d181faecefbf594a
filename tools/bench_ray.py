"""`tqserve bench ray`: a shared trace replayed through Ray Serve, by routing policy.

One local Ray cluster, Ray Serve's proxy, and the tqserve application
(api.rayserve.deployment) deployed in turn as
* `single`: one replica (what one server reuses: the ideal the routers are held to),
* `pow2`: N replicas behind Ray Serve's default request router (power of two choices),
* `prefix`: N replicas behind tqserve's PrefixRouter (least work, prefix caches counted).
Each run replays the same requests (the Mooncake conversation trace's prefix families,
as `tqserve replay` builds them) over the proxy's WebSocket, closed loop, and reads the
reused-token fraction and TTFT from the replay's own summary (tools/replay/metrics.py).
`--rounds N` replays every policy N times in turn, each time on fresh replicas (empty
caches), so that a machine whose load drifts weighs on every policy alike; the figures
are then pooled over the rounds' requests (reuse: all cached over all prompt tokens; TTFT:
all first tokens), and each round's are kept too. The JSON holds the pooled figures, each
round's, and the ratios: prefix reuse / single reuse, and prefix TTFT / pow2 TTFT (mean,
median, p99), pooled and per round. Timing figures are for the docs, never asserted.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import trio

from tqserve.tools.agent_server import free_port
from tqserve.tools.replay.metrics import RequestResult, ideal_reuse, summarize
from tqserve.tools.replay.run import replay
from tqserve.tools.replay.targets import UrlTarget
from tqserve.tools.replay.traces import TraceRequest, load_mooncake, subsample_families

POLICIES = ("single", "pow2", "prefix")
_REPO = Path(__file__).resolve().parents[1]
TRACE = _REPO.parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl"
READY_S = 180.0  # seconds an application may take to come up


def trace_requests(path: Path, families: float, block_tokens: int, max_output: int,
                   workdir: Path) -> list[TraceRequest]:
    """The kept prefix families of a Mooncake trace (rows filtered before their blocks
    are built, as `--family-fraction` keeps them)."""
    class Row:
        def __init__(self, line: str) -> None:
            self.line = line
            self.family = ":".join(map(str, json.loads(line)["hash_ids"][:2]))

    with open(path) as f:
        rows = subsample_families([Row(line) for line in f if line.strip()], families)
    kept = workdir / "kept.jsonl"
    kept.write_text("".join(r.line for r in rows))
    return load_mooncake(kept, block_tokens=block_tokens, vocab_size=8192,
                         max_output=max_output)


# figures over the time one replay took: meaningless for requests of several rounds
_PER_RUN = ("duration_s", "request_throughput", "output_throughput", "total_token_throughput")


async def replay_url(ws_url: str, reqs: Sequence[TraceRequest],
                     concurrency: int) -> list[RequestResult]:
    async with UrlTarget(ws_url) as target:
        return await replay(target, reqs, concurrency=concurrency)


def summary_of(results: Sequence[RequestResult], *, pooled: bool = False) -> dict[str, Any]:
    """The replay's summary (pooled: of several rounds' requests, without the figures
    per unit of one run's time)."""
    summary = summarize(results)
    summary["errors"] = sorted({str(r.error) for r in results if r.error})[:5]
    for key in _PER_RUN if pooled else ():
        del summary[key]
    return summary


def wait_ready(base: str, replicas: int, app_name: str) -> None:
    """Until the application answers through the proxy (every replica up)."""
    import httpx
    from ray import serve

    from tqserve.api.rayserve.deployment import DEPLOYMENT_NAME

    deadline = time.monotonic() + READY_S
    while time.monotonic() < deadline:
        app = serve.status().applications.get(app_name)
        if app is not None and app.status == "RUNNING":
            deployment = app.deployments[DEPLOYMENT_NAME]
            if deployment.replica_states.get("RUNNING", 0) == replicas:
                try:
                    if httpx.get(base + "/health", timeout=10).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
        time.sleep(0.5)
    raise RuntimeError(f"the application was not up within {READY_S:g} s")


def run_policy(config: Any, policy: str, replicas: int, base: str,
               reqs: Sequence[TraceRequest], concurrency: int,
               before_delete: Callable[[], None] | None = None,
               **router: Any) -> list[RequestResult]:
    """Deploy the application for one policy, replay, (call `before_delete`,) delete it;
    the replay's results. `router`: RayServeConfig's prefix-router knobs."""
    from ray import serve

    from tqserve.api.rayserve.deployment import APP_NAME, RayServeConfig, build_app

    n = 1 if policy == "single" else replicas
    ray_config = RayServeConfig(num_replicas=n, num_cpus=0.5,
                                router="pow2" if policy == "pow2" else "prefix", **router)
    # an application of its own per run: a Ray worker process reused for the next run's
    # front keeps its routers cached by (application, deployment), so a second run under
    # the same names would route with the first run's router class
    app_name = f"{APP_NAME}-{policy}"
    serve.run(build_app(config, ray_config), name=app_name, route_prefix="/",
              blocking=False)
    try:
        wait_ready(base, n, app_name)
        results = trio.run(replay_url, base.replace("http://", "ws://") + "/v1/stream",
                           reqs, concurrency)
        if before_delete is not None:
            before_delete()
    finally:
        serve.delete(app_name)
    return results


def ratios(runs: dict[str, dict[str, Any]]) -> dict[str, float]:
    out: dict[str, float] = {}
    single, prefix, pow2 = runs.get("single"), runs.get("prefix"), runs.get("pow2")
    if single and prefix and single["achieved_reuse_fraction"]:
        out["prefix_reuse_vs_single"] = (prefix["achieved_reuse_fraction"]
                                         / single["achieved_reuse_fraction"])
    if single and pow2 and single["achieved_reuse_fraction"]:
        out["pow2_reuse_vs_single"] = (pow2["achieved_reuse_fraction"]
                                       / single["achieved_reuse_fraction"])
    if prefix and pow2:
        for stat in ("mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms"):
            if pow2.get(stat):
                out[f"prefix_{stat}_vs_pow2"] = prefix[stat] / pow2[stat]
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tqserve bench ray", description=__doc__.split("\n")[0])
    p.add_argument("--trace", type=Path, default=TRACE, help="a Mooncake trace (JSONL)")
    p.add_argument("--families", type=float, default=0.005,
                   help="fraction of the trace's prefix families kept")
    p.add_argument("--block-tokens", type=int, default=16,
                   help="token ids per Mooncake block (the trace's are 512)")
    p.add_argument("--max-output", type=int, default=4, help="tokens generated per request")
    p.add_argument("--replicas", type=int, default=2, help="replicas of pow2 and prefix")
    p.add_argument("--concurrency", type=int, default=4, help="requests in flight")
    p.add_argument("--policies", default=",".join(POLICIES),
                   help="comma-separated, of " + ", ".join(POLICIES))
    p.add_argument("--rounds", type=int, default=1,
                   help="replay every policy this many times in turn, fresh replicas each "
                        "time; figures pooled over the rounds")
    p.add_argument("--spill-threshold", type=int, default=8,
                   help="the prefix router's: a replica this many requests busier than the "
                        "least loaded gets none")
    p.add_argument("--model", default=None, help="model (default: the bundled one)")
    p.add_argument("--cluster-cpus", type=int, default=None, help="CPUs of the local cluster")
    p.add_argument("--out", type=Path, default=Path("bench_ray.json"))
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    policies = [x for x in args.policies.split(",") if x]
    bad = [x for x in policies if x not in POLICIES]
    if bad or not policies:
        print(f"tqserve bench ray: error: --policies: unknown {bad or 'none'} "
              f"(of {', '.join(POLICIES)})", file=sys.stderr)
        return 2
    if args.rounds < 1:
        print(f"tqserve bench ray: error: --rounds must be >= 1, got {args.rounds}",
              file=sys.stderr)
        return 2
    if not args.trace.is_file():
        print(f"tqserve bench ray: error: --trace: no file at {args.trace}", file=sys.stderr)
        return 2
    try:
        import ray
        from ray import serve
    except ModuleNotFoundError:
        print("tqserve bench ray: error: needs Ray Serve: pip install 'tqserve[ray]'",
              file=sys.stderr)
        return 2
    import tempfile

    from tqserve.api.config import ServerConfig
    from tqserve.engine.config import Config

    config = ServerConfig(engine=Config(dtype="float32", warmup="off", max_batch=8,
                                        **({"model": args.model} if args.model else {})),
                          shutdown_timeout=2.0)
    with tempfile.TemporaryDirectory() as tmp:
        reqs = trace_requests(args.trace, args.families, args.block_tokens, args.max_output,
                              Path(tmp))
    ideal = ideal_reuse([r.prompt_tokens for r in reqs], [r.arrival_s for r in reqs],
                        [None] * len(reqs))
    ray.init(num_cpus=args.cluster_cpus, include_dashboard=False, log_to_driver=False)
    try:
        results, rounds = _run_rounds(config, policies, reqs, args)
    finally:
        serve.shutdown()
        ray.shutdown()
    runs = {policy: {**summary_of(rs, pooled=args.rounds > 1), "policy": policy,
                     "replicas": 1 if policy == "single" else args.replicas}
            for policy, rs in results.items()}
    out = {"requests": len(reqs), "prompt_tokens": sum(len(r.prompt_tokens) for r in reqs),
           "ideal_reuse_infinite": ideal["ideal_reuse_infinite"], "runs": runs,
           "ratios": ratios(runs), "rounds": rounds,
           "rounds_ratios": [ratios(r) for r in rounds], "concurrency": args.concurrency,
           "replicas": args.replicas, "block_tokens": args.block_tokens,
           "spill_threshold": args.spill_threshold}
    args.out.write_text(json.dumps(out, indent=2, default=str))
    print(json.dumps(out["ratios"], indent=2))
    return 0


def _run_rounds(config: Any, policies: Sequence[str], reqs: Sequence[TraceRequest],
                args: argparse.Namespace
                ) -> tuple[dict[str, list[RequestResult]], list[dict[str, Any]]]:
    """Every policy replayed `args.rounds` times in turn: each policy's results, and each
    round's summaries."""
    from ray import serve

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    results: dict[str, list[RequestResult]] = {policy: [] for policy in policies}
    rounds = []
    for n in range(args.rounds):
        this: dict[str, Any] = {}
        for policy in policies:
            got = run_policy(config, policy, args.replicas, f"http://127.0.0.1:{port}",
                             reqs, args.concurrency, spill_threshold=args.spill_threshold)
            results[policy] += got
            r = this[policy] = summary_of(got)
            print(f"round {n + 1}/{args.rounds} {policy:>6}: reuse "
                  f"{r['achieved_reuse_fraction']:.3f}, TTFT mean "
                  f"{r.get('mean_ttft_ms', 0):.1f} ms p99 {r.get('p99_ttft_ms', 0):.1f} ms, "
                  f"{r['completed']}/{len(reqs)} completed", flush=True)
        rounds.append(this)
    return results, rounds


if __name__ == "__main__":
    sys.exit(main())
