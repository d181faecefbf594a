"""Time and engine steps until a burst of prompts all have their first token.

    python -m tqserve.tools.bench_prefill [--model PATH] [--counts 16,64] [--prompt-tokens 256]
        [--max-step-tokens 512,1024,2048] [--blas PATH] [--repeats 3] [--out FILE]

For each burst size C and each --max-step-tokens budget, C greedy requests (max_tokens 1,
prompts of --prompt-tokens ids: windows of mlx-lm's generate.py source) are submitted
together to an embedded engine (open_engine, prefix cache off, max_batch >= C); figures:
seconds from the first submit to the last first token, and the engine steps that took
(EngineStatistics.steps). mlx-lm's BatchGenerator on the same prompts gives the reference
seconds. One warm-up burst per setting, then --repeats runs; medians. JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any, Sequence

from tqserve.tools.bench import (DEFAULT_MODEL, Settings, Trace, add_blas_flag, load_blas, machine,
                         make_prompts, mlx_batch, tq_batch)


def _all_first(traces: Sequence[Trace]) -> float:
    return max(t.times[0] for t in traces) - min(t.submit for t in traces)


async def _tq(loaded: Any, prompts: list[list[int]], budget: int | None,
              repeats: int) -> dict[str, Any]:
    from tqserve.actors.engine import open_engine
    from tqserve.engine.config import Config

    c = len(prompts)
    extra = {} if budget is None else {"max_step_tokens": max(budget, c)}
    config = Config(model=str(loaded.path), dtype=loaded.dtype, max_batch=max(32, c),
                    max_queued_requests=max(64, c), prefix_cache=False, **extra)
    seconds, steps = [], []
    async with open_engine(config, loaded=loaded) as engine:
        for i in range(repeats + 1):
            before = engine.statistics().steps
            traces = await tq_batch(engine, prompts, 1)
            if i > 0:
                seconds.append(_all_first(traces))
                steps.append(engine.statistics().steps - before)
    return {"seconds": statistics.median(seconds), "seconds_runs": seconds,
            "steps": statistics.median(steps), "steps_runs": steps}


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every (count, budget) figure plus BatchGenerator's per count."""
    import trio

    from tqserve.engine.model import load_model

    loaded = load_model(args.model, args.dtype)
    budgets: list[int | None] = ([int(x) for x in args.max_step_tokens.split(",")]
                                 if args.max_step_tokens else [None])
    figures: dict[str, Any] = {}
    for c in sorted({int(x) for x in args.counts.split(",")}):
        prompts = make_prompts(loaded.tokenizer, c, args.prompt_tokens)
        entry: dict[str, Any] = {}
        for budget in budgets:
            entry[f"tqserve_budget_{budget}"] = trio.run(_tq, loaded, prompts, budget,
                                                         args.repeats)
        lm = []
        for i in range(args.repeats + 1):
            start = time.perf_counter()
            traces = mlx_batch(loaded, prompts, 1)
            if i > 0:
                lm.append(max(t.times[0] for t in traces) - start)
        entry["mlx_lm_batch_generator"] = {"seconds": statistics.median(lm), "seconds_runs": lm}
        figures[f"c{c}"] = entry
    return {"machine": machine(Settings(model=args.model, dtype=args.dtype, blas=args.blas_used)),
            "settings": {"counts": args.counts, "prompt_tokens": args.prompt_tokens,
                         "repeats": args.repeats, "max_step_tokens": budgets},
            "figures": figures}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tqserve.tools.bench_prefill",
                                description=__doc__.splitlines()[0])
    p.add_argument("--model", default=DEFAULT_MODEL, help="model dir")
    p.add_argument("--dtype", default="float32", help="model dtype")
    p.add_argument("--counts", default="16,64", help="burst sizes, comma-separated")
    p.add_argument("--prompt-tokens", type=int, default=256, help="tokens of each prompt")
    p.add_argument("--max-step-tokens", default="",
                   help="budgets to compare, comma-separated (default: the engine's)")
    p.add_argument("--repeats", type=int, default=3, help="runs per figure (median)")
    p.add_argument("--out", type=Path, default=Path("bench-out/bench_prefill.json"),
                   help="JSON results file")
    add_blas_flag(p)
    args = p.parse_args(argv)
    args.blas_used = load_blas(args.blas)
    report = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    for key, entry in report["figures"].items():
        for side, fig in entry.items():
            print(f"{key} {side}: {fig['seconds']:.2f} s"
                  + (f", {fig['steps']:g} steps" if "steps" in fig else ""))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
