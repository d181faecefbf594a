"""The KV budget's two admission modes on one workload, with mlx-lm beside them.

    tqserve bench preempt [--model PATH] [--requests 16] [--prompt-tokens 48]
                          [--max-tokens 1024] [--eos-bias 4] [--budget-lives 4]
                          [--repeats 2] [--blas auto] [--out FILE] [--quick]

The workload: R requests with distinct prompts (windows of mlx-lm's generate.py source),
seeded sampling (temperature 1, request i has seed i), `max_tokens` M, and a logit bias
of B on the EOS token, so that most rows stop well before M, as rows of clients that set
`max_tokens` high do. The budget (`--kv-budget-bytes`) holds L whole lives of KV (prompt
+ M positions, in the slot store's steps of 256). The same requests run, all submitted at once, on a fresh engine each:

  none     no budget
  reserve  --kv-admission reserve: a row is charged its whole life before it starts
  preempt  --kv-admission preempt: a row is charged what it holds plus 256 positions,
           and the longest row is preempted when the rows' next positions do not fit

and on mlx-lm's BatchGenerator, with no bound: the same prompts, each request's
`max_tokens` the length it had in the `none` run, EOS ignored, so it makes as many tokens.

Figures per side: tokens/s (all tokens over first submit to last token), the peak KV
bytes (tqserve: the runner's allocation after each step), the peak MLX memory above what
was in use before the run (both sides; tqserve's includes its prefix cache's RAM tier,
which keeps the snapshots of finished rows: its bytes at the end are reported), the most rows in one decode step, preemptions,
and how many requests made the tokens of the `none` run (seeded sampling continues across
a preemption). Medians over the repeats; the ratios are preempt / reserve, preempt / none
and preempt / mlx-lm. One warm-up run per side first.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any, Sequence

from tqserve.tools.bench import (REPO_ROOT, Settings, add_blas_flag, load_blas, machine,
                                 make_prompts, mlx_batch)

MODES = ("none", "reserve", "preempt")
QUICK = {"requests": 3, "prompt_tokens": 16, "max_tokens": 24, "eos_bias": 2.0,
         "budget_lives": 2, "repeats": 1}  # and no warm-up


async def _run_engine(loaded: Any, args: argparse.Namespace, prompts: list[list[int]],
                      mode: str) -> dict[str, Any]:
    """The workload on a fresh engine in `mode`: its figures and each request's tokens."""
    import mlx.core as mx
    import trio

    from tqserve.actors.engine import open_engine
    from tqserve.actors.messages import Done, Error, Token
    from tqserve.engine.config import Config
    from tqserve.engine.kv_budget import ceil_step
    from tqserve.engine.memory import kv_bytes_per_position
    from tqserve.engine.request import GenerateRequest
    from tqserve.engine.sampling import SamplingParams

    life = ceil_step(args.prompt_tokens + args.max_tokens)  # as the slots allocate
    budget = args.budget_lives * life * kv_bytes_per_position(loaded.model, None)
    config = Config(model=str(loaded.path), dtype=args.dtype, max_batch=len(prompts),
                    max_queued_requests=len(prompts), max_tokens_cap=max(args.max_tokens, 256),
                    kv_budget_bytes=0 if mode == "none" else budget,
                    kv_admission="reserve" if mode == "none" else mode)
    tokens: list[list[int]] = [[] for _ in prompts]
    peak = {"kv": 0, "rows": 0}
    async with open_engine(config, loaded=loaded) as engine:
        execute = engine.runner.execute

        def measured(plan: Any) -> Any:  # the runner's allocation and rows, every step
            result = execute(plan)
            peak["kv"] = max(peak["kv"], result.kv_bytes)
            peak["rows"] = max(peak["rows"], len(result.outputs))
            return result

        engine.runner.execute = measured

        async def one(i: int) -> None:
            params = SamplingParams(max_tokens=args.max_tokens, temperature=1.0, seed=i,
                                    logit_bias={eos: args.eos_bias for eos in loaded.eos_token_ids})
            async for event in engine.generate(GenerateRequest(prompt_tokens=prompts[i],
                                                               params=params)):
                if isinstance(event, Token):
                    tokens[i].append(event.token_id)
                elif isinstance(event, Error):
                    raise RuntimeError(f"{mode}: request {i}: {event.code}: {event.message}")
                elif isinstance(event, Done):
                    last[0] = time.perf_counter()

        last = [0.0]
        base = mx.get_active_memory()
        mx.reset_peak_memory()
        start = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for i in range(len(prompts)):
                nursery.start_soon(one, i)
        stats = engine.statistics()
    made = sum(map(len, tokens))
    return {"tokens_per_s": made / (last[0] - start), "tokens": made,
            "peak_kv_bytes": peak["kv"], "peak_mlx_bytes": mx.get_peak_memory() - base,
            "max_rows": peak["rows"], "preemptions": stats.kv_preemptions,
            "ram_tier_bytes": stats.prefix_cache.ram_bytes if stats.prefix_cache else 0,
            "budget_bytes": config.kv_budget_bytes, "outputs": tokens}


def _run_mlx_lm(loaded: Any, prompts: list[list[int]], lengths: list[int]) -> dict[str, Any]:
    """mlx-lm's BatchGenerator on the same prompts, each making `lengths[i]` tokens."""
    import mlx.core as mx

    base = mx.get_active_memory()
    mx.reset_peak_memory()
    traces = mlx_batch(loaded, prompts, lengths)
    peak = mx.get_peak_memory() - base
    made = sum(len(t.tokens) for t in traces)
    steps = Counter(at for t in traces for at in t.times)  # a step's tokens share one
    end = max((t.times[-1] for t in traces if t.times), default=traces[0].submit)
    return {"tokens_per_s": made / (end - traces[0].submit), "tokens": made,
            "peak_kv_bytes": None, "peak_mlx_bytes": peak,
            "max_rows": max(steps.values(), default=0), "preemptions": 0, "ram_tier_bytes": 0}


def _median_runs(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Each figure's median over the runs (the output tokens left out)."""
    out = {k: v for k, v in runs[-1].items() if k != "outputs"}
    out.update({k: statistics.median(r[k] for r in runs) for k, v in out.items()
                if isinstance(v, (int, float)) and k != "budget_bytes"})
    out["runs_tokens_per_s"] = [r["tokens_per_s"] for r in runs]
    return out


def measure(loaded: Any, args: argparse.Namespace) -> dict[str, Any]:
    """Every side, one warm-up each, then the repeats in turn; medians and ratios."""
    import trio

    prompts = make_prompts(loaded.tokenizer, args.requests, args.prompt_tokens)
    runs: dict[str, list[dict[str, Any]]] = {side: [] for side in (*MODES, "mlx_lm")}
    reference: list[list[int]] = []
    for i in range(0 if args.quick else -1, args.repeats):
        for mode in MODES:
            got = trio.run(_run_engine, loaded, args, prompts, mode)
            if mode == "none":
                reference = got["outputs"]
            got["same_tokens_as_none"] = sum(a == b for a, b in zip(got["outputs"], reference))
            if i >= 0:
                runs[mode].append(got)
        lm = _run_mlx_lm(loaded, prompts, [len(t) for t in reference])
        if i >= 0:
            runs["mlx_lm"].append(lm)
    sides = {side: _median_runs(r) for side, r in runs.items()}
    pre = sides["preempt"]
    ratios = {f"preempt/{other}": {
        "tokens_per_s": pre["tokens_per_s"] / sides[other]["tokens_per_s"],
        "peak_mlx_bytes": pre["peak_mlx_bytes"] / max(1, sides[other]["peak_mlx_bytes"])}
        for other in ("reserve", "none", "mlx_lm")}
    return {"sides": sides, "ratios": ratios,
            "output_lengths": sorted(len(t) for t in reference)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    from tqserve.engine.model import load_model

    in_repo = REPO_ROOT / args.model
    loaded = load_model(in_repo if in_repo.exists() else args.model, args.dtype)
    figures = measure(loaded, args)
    settings = {k: v for k, v in vars(args).items() if k not in ("out", "quick")}
    return {"machine": machine(Settings(dtype=args.dtype, blas=args.blas_used)),
            "model": {"name": loaded.path.name, "dtype": loaded.dtype},
            "settings": settings, **figures}


def format_table(report: dict[str, Any]) -> str:
    s, sides = report["settings"], report["sides"]
    lines = [f"{report['model']['name']}, {s['requests']} requests, max_tokens "
             f"{s['max_tokens']}, budget {s['budget_lives']} lives; output lengths "
             f"{report['output_lengths']}",
             f"{'side':<8} {'tok/s':>8} {'peak KV MB':>11} {'peak MLX MB':>12} "
             f"{'RAM tier MB':>12} {'rows':>5} {'preempted':>9} {'same':>5}"]
    for side, f in sides.items():
        kv = f"{f['peak_kv_bytes'] / 2**20:.1f}" if f["peak_kv_bytes"] is not None else "-"
        lines.append(f"{side:<8} {f['tokens_per_s']:>8.1f} {kv:>11} "
                     f"{f['peak_mlx_bytes'] / 2**20:>12.1f} {f['ram_tier_bytes'] / 2**20:>12.1f} "
                     f"{f['max_rows']:>5} "
                     f"{f['preemptions']:>9} {f.get('same_tokens_as_none', '-'):>5}")
    for name, r in report["ratios"].items():
        lines.append(f"{name}: tok/s {r['tokens_per_s']:.2f}x, peak MLX memory "
                     f"{r['peak_mlx_bytes']:.2f}x")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tqserve bench preempt", description=(
        "--kv-admission preempt vs reserve vs no budget, and mlx-lm, on one workload of "
        "rows that mostly stop early (module doc of tools/bench_preempt.py)."))
    p.add_argument("--model", default="../shared/models/pycoder-29m",
                   help="model dir (relative to the repo) or hub id")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--requests", type=int, default=16, help="requests, all at once")
    p.add_argument("--prompt-tokens", type=int, default=48, help="prompt length")
    p.add_argument("--max-tokens", type=int, default=1024, help="max_tokens of each request")
    p.add_argument("--eos-bias", type=float, default=4.0,
                   help="logit bias on EOS: the higher, the shorter the outputs")
    p.add_argument("--budget-lives", type=int, default=4,
                   help="the KV budget, in whole lives (prompt + max_tokens positions; >= 2)")
    p.add_argument("--repeats", type=int, default=2, help="timed runs per side")
    p.add_argument("--out", type=Path, help="also write the JSON report here")
    p.add_argument("--quick", action="store_true", help="a tiny run (a smoke test)")
    add_blas_flag(p)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # preempt admits a request only if it could resume alone by prefilling: two lives
    for name, value, least in (("requests", args.requests, 1),
                               ("prompt-tokens", args.prompt_tokens, 1),
                               ("max-tokens", args.max_tokens, 1),
                               ("budget-lives", args.budget_lives, 2),
                               ("repeats", args.repeats, 1)):
        if value < least:
            print(f"tqserve bench preempt: error: --{name} must be >= {least}, got {value}",
                  file=sys.stderr)
            return 2
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    args.blas_used = load_blas(args.blas)
    report = run(args)
    text = json.dumps(report, indent=2)
    if args.out is not None:
        args.out.write_text(text)
    print(text)
    print(format_table(report), file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
