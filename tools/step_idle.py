"""How long the runner thread idles between steps: the trio side's time per step.

    python -m tqserve.tools.step_idle [--model PATH ...] [--batches 1 8 32] [--blas PATH] [--out FILE]

Between two steps the runner thread has handed its results back and waits for the next
plan while the pipelined forward computes (MLX's own threads): the scheduler postprocesses,
messages cross the actor graph, the hub fans tokens out, the next plan is built. The
runner times that gap whenever a forward was in flight (`Runner.step_gaps`). For each
model and batch size B this tool runs B concurrent greedy requests (EOS ignored, prefix
cache off) after one warm-up, and writes the gaps' median and mean (ms), the step time,
and the CPU time the trio thread spent per step (`trio_cpu_ms_per_step`: all actors and
consumers; unlike the wall-clock gap it does not grow when other processes load the
machine) to JSON. A gap shorter than the forward costs nothing on the GPU-free CPU backend only
while the two cores are not both busy; on a GPU every gap is time the device may idle.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from tqserve.tools.bench import REPO_ROOT, add_blas_flag, load_blas, make_prompts, tq_batch

DEFAULT_MODELS = ("models/pycoder-draft-4m", "../shared/models/pycoder-29m")


async def _measure(loaded: Any, batches: Sequence[int], new_tokens: int,
                   prompt_tokens: int) -> list[dict[str, Any]]:
    import attrs

    from tqserve.actors.engine import open_engine
    from tqserve.engine.config import Config

    config = Config(model=str(loaded.path), dtype=loaded.dtype, max_batch=max(32, *batches),
                    max_queued_requests=max(64, *batches),
                    max_tokens_cap=max(4096, new_tokens), prefix_cache=False)
    out = []
    async with open_engine(config, loaded=attrs.evolve(loaded, eos_token_ids=frozenset())) \
            as engine:
        runner = engine.runner
        for b in batches:
            prompts = make_prompts(loaded.tokenizer, b, prompt_tokens)
            await tq_batch(engine, prompts, 4)  # warm-up: this batch shape's kernels
            before, steps = runner.statistics(), engine.statistics().steps
            start, cpu = time.perf_counter(), time.thread_time()
            await tq_batch(engine, prompts, new_tokens)
            wall, cpu = time.perf_counter() - start, time.thread_time() - cpu
            after, steps = runner.statistics(), engine.statistics().steps - steps
            count = after.num_step_gaps - before.num_step_gaps
            gaps = runner.step_gaps()[-count:] if count else []
            total = after.step_gap_seconds - before.step_gap_seconds
            out.append({
                "batch": b, "new_tokens": new_tokens, "steps_timed": count,
                "gap_ms_median": 1e3 * statistics.median(gaps) if gaps else None,
                "gap_ms_mean": 1e3 * total / count if count else None,
                "wall_ms_per_token_step": 1e3 * wall / new_tokens,
                "steps": steps, "trio_cpu_ms_per_step": 1e3 * cpu / steps,
                "gap_share_of_wall": total / wall})
    return out


def run(models: Sequence[str], batches: Sequence[int], new_tokens: int,
        prompt_tokens: int, blas: str) -> dict[str, Any]:
    """Measure every model at every batch size; the JSON report."""
    import trio

    from tqserve.engine.model import load_model

    results = []
    for model in models:
        in_repo = REPO_ROOT / model
        loaded = load_model(in_repo if in_repo.exists() else model, "float32")
        rows = trio.run(_measure, loaded, batches, new_tokens, prompt_tokens)
        results.append({"model": loaded.path.name, "dtype": loaded.dtype, "rows": rows})
    return {"blas": blas, "results": results}


def main(argv: Sequence[str] | None = None) -> int:
    """Parse flags, load --blas, measure, write JSON and print one line per figure."""
    p = argparse.ArgumentParser(prog="python -m tqserve.tools.step_idle",
                                description=__doc__.splitlines()[0])
    p.add_argument("--model", action="append", help="model dir (repeatable); default: "
                   + ", ".join(DEFAULT_MODELS))
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=32)
    add_blas_flag(p)
    p.add_argument("--out", type=Path, default=Path("bench-out/step_idle.json"))
    args = p.parse_args(argv)
    if min(args.batches) < 1 or args.new_tokens < 8 or args.prompt_tokens < 2:
        p.error("--batches must be >= 1, --new-tokens >= 8, --prompt-tokens >= 2")
    blas = load_blas(args.blas)
    report = run(args.model or DEFAULT_MODELS, args.batches, args.new_tokens,
                 args.prompt_tokens, blas)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    for result in report["results"]:
        for row in result["rows"]:
            print(f"{result['model']} B{row['batch']}: gap median {row['gap_ms_median']:.2f} ms, "
                  f"mean {row['gap_ms_mean']:.2f} ms, trio CPU "
                  f"{row['trio_cpu_ms_per_step']:.2f} ms/step, step "
                  f"{row['wall_ms_per_token_step']:.2f} ms")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
