"""The `tqserve` subcommands that hand their arguments to a tool module (api.cli).

`tqserve bench NAME ...` runs one benchmark; `tqserve bench ...` with no NAME runs the
mlx-lm comparison, as `tqserve bench` always did. The old `bench-NAME` commands stay as
hidden aliases (not in --help) that print one deprecation line; `attack` and `route-sim`
left the CLI and run as `python -m MODULE`.
"""

from __future__ import annotations

BENCHES = {  # tqserve bench NAME -> tool module, and what it measures
    "mlx-lm": "tqserve.tools.bench",
    "kv": "tqserve.tools.bench_kv",
    "prefix": "tqserve.tools.bench_prefix",
    "gpu": "tqserve.tools.bench_gpu",
    "spec": "tqserve.tools.bench_spec",
    "tp": "tqserve.tools.bench_tp",
    "ray": "tqserve.tools.bench_ray",
    "preempt": "tqserve.tools.bench_preempt",
}
BENCH_HELP = {
    "mlx-lm": "tqserve vs mlx-lm, side by side (the default NAME)",
    "kv": "TurboQuant vs plain decode speed",
    "prefix": "prefix cache TTFT cold/RAM/SSD and snapshot bytes",
    "gpu": "tqserve vs mlx-lm at B1..B64 on random Qwen3 shapes",
    "spec": "speculative decoding per method vs plain at B1/B4/B8",
    "tp": "tensor parallel (serve --distributed) vs one process",
    "ray": "a trace through Ray Serve: prefix router vs Ray's default",
    "preempt": "--kv-admission preempt vs reserve vs no budget, and mlx-lm",
}
OLD_BENCHES = {f"bench-{name}": name for name in BENCHES  # hidden
               if name not in ("mlx-lm", "ray", "preempt")}
TOOLS = {
    "route": "tqserve.api.router.cli",
    "ray-serve": "tqserve.api.rayserve.cli",
    "replay": "tqserve.tools.replay.cli",
    "eval-kv": "tqserve.tools.eval_kv",
}
TOOL_HELP = (  # the order of `tqserve --help`, after serve and generate
    ("route", "prefix-aware router in front of N servers (api/router)"),
    ("ray-serve", "N replicas on Ray Serve, a local or joined Ray cluster "
                  "(api/rayserve; pip install 'tqserve[ray]')"),
    ("replay", "replay, record-verify and A/B traces (tools/replay)"),
    ("bench", "benchmarks: tqserve bench NAME, NAME one of " + ", ".join(BENCHES)
              + " (tqserve bench --help)"),
    ("eval-kv", "KV-cache quality: perplexity and KL (tools/eval_kv)"),
)
COMMANDS = ("serve", "generate", *(name for name, _ in TOOL_HELP))
REMOVED = {"attack": "tqserve.tools.attack", "route-sim": "tqserve.tools.route_sim"}


def bench_help() -> str:
    """`tqserve bench --help`: the benchmarks by NAME."""
    width = max(map(len, BENCHES))
    lines = ["usage: tqserve bench [NAME] [ARGS ...]", "",
             "Run one benchmark; ARGS go to it (tqserve bench NAME --help lists them).",
             "Without NAME: mlx-lm, whose flags follow the list.", "", "NAME:"]
    lines += [f"  {name:<{width}}  {BENCH_HELP[name]}" for name in BENCHES]
    return "\n".join(lines) + "\n"
