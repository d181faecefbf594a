"""`tqserve ray-serve --replicas N [--address ADDR] [serve's flags]`: tqserve on Ray Serve.

Starts a local Ray cluster (or joins `--address`), Ray Serve's HTTP proxy on --host/--port,
and the tqserve application (api.rayserve.deployment) with N replicas, each one engine
with serve's flags (mapped 1:1 onto api.config.ServerConfig and the engine's Config in it,
as for `tqserve serve`).
Runs until SIGTERM or SIGINT, then deletes the application (each replica shuts its engine
down cleanly) and, for a cluster it started, stops Ray. Bad arguments print one line and
exit with code 2, Ray missing too (naming the extra to install).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from typing import Sequence

from tqserve.api.cli import HelpFormatter, _Parser, _server_config
from tqserve.api.flags import add_config_flags

_RAY_MISSING = "tqserve ray-serve needs Ray Serve: pip install 'tqserve[ray]'"


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="tqserve ray-serve", formatter_class=HelpFormatter,
                description="tqserve replicas as a Ray Serve application, behind Ray "
                            "Serve's HTTP proxy (same HTTP and WebSocket APIs as serve).")
    add_config_flags(p, server=True)
    p.add_argument("--replicas", type=int, default=1,
                   help="replicas (engines) to run; with --max-replicas, the autoscaling "
                        "minimum")
    p.add_argument("--max-replicas", type=int, default=0,
                   help="autoscale up to this many replicas on --autoscale-metric "
                        "(0: a fixed --replicas)")
    p.add_argument("--autoscale-metric", choices=("ongoing", "queue"), default="ongoing",
                   help="what autoscaling counts per replica: Ray's ongoing requests, or "
                        "the engine's rows running + queued (its own statistics)")
    p.add_argument("--target-ongoing-requests", type=int, default=0,
                   help="autoscaling target per replica: ongoing requests, or engine rows "
                        "with --autoscale-metric queue (0: --max-batch)")
    p.add_argument("--max-ongoing-requests", type=int, default=0,
                   help="requests Ray Serve sends one replica at once; the rest wait in "
                        "Ray (0: --max-batch + --max-queued-requests)")
    p.add_argument("--num-cpus", type=float, default=1.0,
                   help="CPUs Ray reserves for each replica")
    p.add_argument("--num-gpus", type=float, default=0.0,
                   help="GPUs Ray reserves for each replica")
    p.add_argument("--route-prefix", default="/", help="URL prefix of the application")
    p.add_argument("--router", choices=("prefix", "pow2"), default="prefix",
                   help="replica choice: the least prompt work, prefix caches counted "
                        "(tqserve's, fed by KV events), or Ray Serve's power-of-two default")
    p.add_argument("--spill-threshold", type=int, default=8,
                   help="prefix router: a replica this many requests busier than the least "
                        "loaded one gets none, whatever prefix it holds")
    p.add_argument("--front-replicas", type=int, default=1,
                   help="replicas of the front deployment (reads, keys and relays requests)")
    p.add_argument("--address", default=None,
                   help="join this Ray cluster (e.g. auto, or ray://head:10001) instead of "
                        "starting a local one (default: start one)")
    p.add_argument("--cluster-cpus", type=int, default=None,
                   help="CPUs of the local cluster this starts (default: all; not with "
                        "--address)")
    return p


def _wait_for_signal() -> str:
    """Block until SIGTERM or SIGINT; the signal's name."""
    got: list[str] = []
    event = threading.Event()

    def note(signum: int, _frame: object) -> None:
        got.append(signal.Signals(signum).name)
        event.set()

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, note)
    event.wait()
    return got[0]


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        from tqserve.api.rayserve.deployment import APP_NAME, RayServeConfig, build_app
    except ModuleNotFoundError as exc:
        if exc.name is None or exc.name.split(".")[0] != "ray":
            raise  # our bug, not a missing extra
        print(f"tqserve: error: {_RAY_MISSING}", file=sys.stderr)
        return 2
    try:
        if args.distributed:
            raise ValueError("--distributed is not supported under ray-serve (each replica "
                             "is one process; docs/scale-out-ray.md)")
        if args.address is not None and args.cluster_cpus is not None:
            raise ValueError("--cluster-cpus sizes a local cluster: not with --address")
        config = _server_config(args)
        if config.port == 0:
            raise ValueError("--port 0: Ray Serve's proxy needs a fixed port")
        ray_config = RayServeConfig(
            num_replicas=args.replicas, max_replicas=args.max_replicas,
            target_ongoing_requests=args.target_ongoing_requests,
            autoscale_metric=args.autoscale_metric, num_cpus=args.num_cpus,
            num_gpus=args.num_gpus, max_ongoing_requests=args.max_ongoing_requests,
            route_prefix=args.route_prefix, router=args.router,
            spill_threshold=args.spill_threshold,
            front_replicas=args.front_replicas)
    except ValueError as exc:
        print(f"tqserve: error: {exc}", file=sys.stderr)
        return 2
    import ray
    from ray import serve

    ray.init(address=args.address, num_cpus=args.cluster_cpus, include_dashboard=False,
             runtime_env={"env_vars": {"TQSERVE_BLAS": args.blas}})
    try:
        serve.start(http_options={"host": config.host, "port": config.port})
        serve.run(build_app(config, ray_config), name=APP_NAME,
                  route_prefix=ray_config.route_prefix)
        url = f"http://{config.host}:{config.port}{ray_config.route_prefix.rstrip('/')}"
        scale = (f"replicas {ray_config.num_replicas}..{ray_config.max_replicas}"
                 if ray_config.max_replicas > ray_config.num_replicas
                 else f"replicas: {ray_config.num_replicas}")
        print(f"tqserve: serving {config.engine.model} on {url} through Ray Serve ({scale}; "
              "WebSocket /v1/stream, HTTP /v1/completions, /v1/chat/completions, "
              f"/v1/messages, /v1/responses; router {ray_config.router})", flush=True)
        name = _wait_for_signal()
        serve.delete(APP_NAME)  # each replica: lifespan shutdown, the engine closes
        print(f"tqserve: shut down on {name}", file=sys.stderr, flush=True)
    finally:
        if args.address is None:
            serve.shutdown()
        ray.shutdown()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)
