"""Speculative decoding vs plain decoding, per method, at several batch sizes, one run.

    tqserve bench spec [--model PATH] [--draft-model PATH] [--dtype float32|bfloat16]
                       [--blas auto|none|PATH] [--batches 1,4,8] [--methods lookup,draft,mtp]
                       [--new-tokens N] [--num-speculative-tokens K] [--warmup-tokens N]
                       [--no-time-policy] [--quick] [--out FILE]

Tasks (greedy, EOS ignored, prefix cache off, B concurrent requests with distinct prompts):
  continuation  windows of mlx-lm's own source (generate.py): held-out code the models
                never saw (../shared/models README)
  edit          a function of mlx-lm's sample_utils.py, then "the same function with `x`
                renamed to `y`:" and its renamed first line; the model rewrites the rest
Figures per (task, B, method): aggregate decode tok/s once every request decodes
(tools.bench.all_decoding_rate: the tokens that arrive after the last request's first
token, over the time from then to the last token; a verify step delivers several tokens
at once, so per-request gaps would mislead, and the edit task's prompts of 300-800 tokens
prefill over several steps, which a window from the FIRST token would charge to decoding;
`burst_tok_s` keeps that window, tools.bench.burst_rate), the ratio to plain at the same B
(median of `--repeats` runs), and acceptance from the engine's books: proposed, accepted,
accepted / proposed (next to pycoder-29m's top-1 agreement ceilings: draft 73%, MTP 59%)
and mean accepted length per verify step, and the time policy's books per batch bucket
(mode, plain and speculative tok/s measured; engine.speculative.throughput). Before each
batch size one unmeasured burst of `--warmup-tokens` per request (plain and every method
alike): what a server that has run a while knows of that size. JSON out. Runs on CUDA in bf16 too (`--dtype
bfloat16`; no CPU-only path); on the CPU, float32 with an optimized BLAS (`--blas auto`).
"""

from __future__ import annotations

import argparse
import ast
import importlib
import json
import os
import re
import statistics
import sys
from pathlib import Path
from typing import Any, Sequence

from tqserve import blas
from tqserve.tools.bench import (REPO_ROOT, all_decoding_rate, burst_rate, machine, make_prompts,
                                 tq_batch)

CEILINGS = {"draft": 0.73, "mtp": 0.59}  # pycoder-29m top-1 agreement (models README)
DEFAULT_MODEL = "../shared/models/pycoder-29m"


def edit_prompts(tokenizer: Any, count: int) -> list[list[int]]:
    """`count` edit prompts from the functions of mlx-lm's sample_utils.py (cycled)."""
    source = Path(str(importlib.import_module("mlx_lm.sample_utils").__file__)).read_text()
    funcs = [n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef)
             and n.args.args and n.end_lineno - n.lineno >= 4]
    prompts = []
    for i in range(count):
        fn = funcs[i % len(funcs)]
        text = ast.get_source_segment(source, fn) or ""
        old = fn.args.args[0].arg
        new = f"{old}_{i % 7 + 2}"
        renamed = re.sub(rf"\b{re.escape(old)}\b", new, text)
        header = f"# The same function with `{old}` renamed to `{new}`:\n"
        prompt = f"{text}\n\n\n{header}{renamed.splitlines()[0]}\n"
        prompts.append(tokenizer.encode(prompt))
    return prompts


async def _run(loaded: Any, draft_path: str | None, method: str | None, task_prompts: list,
               batches: Sequence[int], n: int, k: int, repeats: int,
               warmup: int, time_policy: bool) -> dict[int, dict]:
    """One engine for `method` (None: plain); every batch size; rates and acceptance."""
    import attrs

    from tqserve.actors.engine import open_engine
    from tqserve.engine.config import Config
    from tqserve.engine.model import DTYPES

    extra: dict[str, Any] = {}
    if method is not None:
        extra = {"speculative": method, "num_speculative_tokens": k,
                 "speculative_time_policy": time_policy}
        if method == "draft":
            extra["draft_model"] = draft_path
    config = Config(model=str(loaded.path), dtype=loaded.dtype if loaded.dtype in DTYPES
                    else "auto", max_batch=max(batches),
                    max_tokens_cap=max(4096, n), prefix_cache=False, **extra)
    no_eos = attrs.evolve(loaded, eos_token_ids=frozenset())
    out: dict[int, dict] = {}
    async with open_engine(config, loaded=no_eos) as engine:
        await tq_batch(engine, task_prompts[:1], 4)  # warm-up
        for b in batches:
            if warmup:  # a server that has run a while: its time policy knows this size
                await tq_batch(engine, task_prompts[:b], warmup)
            before = engine.statistics().speculative
            traces = [await tq_batch(engine, task_prompts[:b], n) for _ in range(repeats)]
            rates = [all_decoding_rate(t) for t in traces]
            after = engine.statistics().speculative
            row: dict[str, Any] = {"tok_s": statistics.median(rates), "runs": rates,
                                   "burst_tok_s": statistics.median(map(burst_rate, traces))}
            if before is not None and after is not None:
                proposed = after.num_proposed - before.num_proposed
                accepted = after.num_accepted - before.num_accepted
                steps = after.num_verify_steps - before.num_verify_steps
                row.update(proposed=proposed, accepted=accepted,
                           acceptance=accepted / proposed if proposed else 0.0,
                           mean_accepted_length=accepted / steps if steps else 0.0,
                           ceiling=CEILINGS.get(method or ""),
                           buckets=[attrs.asdict(x) for x in after.buckets])
            out[b] = row
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    import trio

    from tqserve.engine.model import load_model

    in_repo = REPO_ROOT / args.model
    loaded = load_model(in_repo if in_repo.exists() else args.model, args.dtype)
    draft = args.draft_model
    if draft is None:
        from tqserve.engine.model import DEFAULT_MODEL as BUNDLED
        draft = str(BUNDLED)
    batches = [int(b) for b in args.batches.split(",")]
    methods = [m for m in args.methods.split(",") if m]
    tasks = {"continuation": make_prompts(loaded.tokenizer, max(batches), args.prompt_tokens),
             "edit": edit_prompts(loaded.tokenizer, max(batches))}
    results: dict[str, Any] = {}
    for task, prompts in tasks.items():
        common = (args.num_speculative_tokens, args.repeats, args.warmup_tokens,
                  args.time_policy)
        plain = trio.run(_run, loaded, draft, None, prompts, batches, args.new_tokens, *common)
        per_b: dict[str, Any] = {str(b): {"plain": plain[b]} for b in batches}
        for method in methods:
            got = trio.run(_run, loaded, draft, method, prompts, batches, args.new_tokens,
                           *common)
            for b in batches:
                got[b]["speedup"] = got[b]["tok_s"] / plain[b]["tok_s"]
                per_b[str(b)][method] = got[b]
        results[task] = per_b
    settings = {k: v for k, v in vars(args).items() if k != "out"}
    settings["blas"] = args.blas_loaded
    return {"machine": machine(argparse.Namespace(dtype=args.dtype, blas=args.blas_loaded)),
            "model": {"name": loaded.path.name, "dtype": loaded.dtype,
                      "fingerprint": loaded.fingerprint},
            "settings": settings, "results": results}


def format_table(report: dict[str, Any]) -> str:
    lines = [f"{'task':<13} {'B':>2} {'method':<7} {'tok/s':>8} {'x plain':>8} {'accept':>7}"
             f" {'ceiling':>7} {'mean len':>8}"]
    for task, per_b in report["results"].items():
        for b, per_m in per_b.items():
            for method, r in per_m.items():
                acc = f"{r['acceptance']:.0%}" if "acceptance" in r else "-"
                ceil = f"{r['ceiling']:.0%}" if r.get("ceiling") else "-"
                mean = f"{r['mean_accepted_length']:.2f}" if "acceptance" in r else "-"
                lines.append(f"{task:<13} {b:>2} {method:<7} {r['tok_s']:>8.1f} "
                             f"{r.get('speedup', 1.0):>8.2f} {acc:>7} {ceil:>7} {mean:>8}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tqserve bench spec", description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL, help="target model (relative to the repo)")
    p.add_argument("--draft-model", default=None, help="draft model (default: the bundled one)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                   help="bfloat16 on a GPU")
    p.add_argument("--blas", default="auto", help="auto | none | PATH (tqserve/blas.py)")
    p.add_argument("--batches", default="1,4,8", help="comma-separated batch sizes")
    p.add_argument("--methods", default="lookup,draft,mtp", help="comma-separated methods")
    p.add_argument("--new-tokens", type=int, default=96, help="tokens per request")
    p.add_argument("--prompt-tokens", type=int, default=128, help="continuation prompt length")
    p.add_argument("--num-speculative-tokens", type=int, default=3, help="k per verify step")
    p.add_argument("--repeats", type=int, default=2, help="runs per figure (median)")
    p.add_argument("--warmup-tokens", type=int, default=32,
                   help="tokens per request of one unmeasured burst before each batch size "
                        "(every method and plain alike: the time policy learns the size)")
    p.add_argument("--no-time-policy", dest="time_policy", action="store_false",
                   help="run with --no-speculative-time-policy (speculation always on)")
    p.add_argument("--quick", action="store_true", help="tiny sizes (smoke test)")
    p.add_argument("--out", type=Path, default=Path("bench-out/bench-spec.json"),
                   help="JSON report")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.quick:
        args.batches, args.new_tokens, args.repeats, args.prompt_tokens = "2", 12, 1, 32
        args.warmup_tokens = 4
    path = blas.resolve(args.blas) if args.blas != "none" else None
    os.environ[blas.ENV] = path or "none"  # read when the engine is first imported
    if path is not None and "mlx.core" not in sys.modules:  # the CLI may have loaded it
        blas.load(path)
    args.blas_loaded = path or "reference"
    report = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(format_table(report))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
