"""Structured output cost: grammar mask time per decode step next to the step time.

    python -m tqserve.tools.bench_grammar [--model PATH] [--batch 1 8] [--steps N] [--blas PATH] [--out FILE]

For each batch size B, B rows decode `steps` steps after joining, three ways, interleaved
per repeat (medians over repeats):
  free       unconstrained rows (EOS ignored, so every row runs all steps)
  json       every row constrained by a JSON schema (an array of at least 64 objects with a
             string and an integer: long output, no EOS before it is complete), masks on
             the grammar worker thread (the engine's way)
  json_inline  the same, masks computed on the runner thread (what the worker saves)
Per mode: step_ms (median wall time of `Runner.execute` over the decode steps), and per
step the worker's mask compute (mask_ms), the runner's wait for a late mask (wait_ms) and
its token consumption (consume_ms), from `GrammarMasks.statistics()`. Temperature 1,
seeded; the runner is driven by the sans-io scheduler core directly (no actors), so the
time between steps, where the worker's mask hides, is the shortest it can be.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from tqserve.tools.bench import REPO_ROOT, Settings, add_blas_flag, load_blas, machine, make_prompts

DEFAULT_MODEL = "../shared/models/pycoder-29m"
MODES = ("free", "json", "json_inline")
SCHEMA = {"type": "object", "properties": {"items": {
    "type": "array", "minItems": 64,
    "items": {"type": "object", "properties": {"name": {"type": "string"},
                                               "value": {"type": "integer"}},
              "required": ["name", "value"], "additionalProperties": False}}},
    "required": ["items"], "additionalProperties": False}


def _run(loaded: Any, batch: int, steps: int, mode: str, prompts: list[list[int]],
         seed: int) -> dict[str, Any]:
    from tqserve.engine.runner import Runner
    from tqserve.engine.sampling import SamplingParams
    from tqserve.engine.scheduler import SchedulerCore
    from tqserve.engine.structured import GrammarMasks, validate_response_format

    masks = GrammarMasks(loaded.tokenizer, loaded.vocab_size, loaded.eos_token_ids,
                         inline=mode == "json_inline")
    fmt = None if mode == "free" else validate_response_format(
        {"type": "json_schema", "json_schema": {"name": "bench", "schema": SCHEMA}})
    core = SchedulerCore(max_batch=batch, prefill_chunk=4096, eos_token_ids=())
    runner = Runner(loaded.model, masks=masks)
    for i in range(batch):
        core.add(f"r{i}", tuple(prompts[i]),
                 SamplingParams(max_tokens=steps + 2, temperature=1.0, seed=seed + i),
                 response_format=fmt)
    times: list[float] = []
    before = None
    while core.has_work():
        plan, _ = core.schedule()
        snapshot = masks.statistics()
        started = time.perf_counter()
        result = runner.execute(plan)
        elapsed = time.perf_counter() - started
        core.postprocess(result)
        if len(result.outputs) == batch and not plan.join:
            if before is None:
                before = snapshot
            times.append(elapsed)
        if len(times) == steps:
            break
    after = masks.statistics()
    n = max(len(times), 1)
    per_step = {name: (getattr(after, name) - getattr(before, name)) / n * 1000
                for name in ("mask_seconds", "wait_seconds", "consume_seconds")} \
        if before is not None else {}
    return {"step_ms": statistics.median(times) * 1000, "steps": len(times),
            "mask_ms": per_step.get("mask_seconds", 0.0),
            "wait_ms": per_step.get("wait_seconds", 0.0),
            "consume_ms": per_step.get("consume_seconds", 0.0)}


def run_bench(model: str, dtype: str, batches: Sequence[int], steps: int, repeats: int,
              blas: str) -> dict[str, Any]:
    """Measure every mode at every batch size; return the JSON report."""
    from tqserve.engine.model import load_model

    in_repo = REPO_ROOT / model
    loaded = load_model(in_repo if in_repo.exists() else model, dtype)
    prompts = make_prompts(loaded.tokenizer, max(batches), 32)
    figures: dict[str, Any] = {}
    for batch in batches:
        _run(loaded, batch, 4, "json", prompts, 0)  # warm-up: compile paths, tokenizer
        runs: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
        for r in range(repeats):
            order = MODES if r % 2 == 0 else MODES[::-1]
            for mode in order:
                runs[mode].append(_run(loaded, batch, steps, mode, prompts, 100 * r))
        figures[f"B{batch}"] = {
            mode: {key: statistics.median(run[key] for run in results)
                   for key in ("step_ms", "mask_ms", "wait_ms", "consume_ms")}
            for mode, results in runs.items()}
        for mode in MODES[1:]:
            fig = figures[f"B{batch}"]
            fig[mode]["step_vs_free"] = fig[mode]["step_ms"] / fig["free"]["step_ms"]
    return {"machine": machine(Settings(dtype=dtype, blas=blas)),
            "model": {"name": loaded.path.name, "dtype": loaded.dtype},
            "settings": {"batches": list(batches), "steps": steps, "repeats": repeats,
                         "temperature": 1.0, "schema": SCHEMA},
            "figures": figures}


def format_table(report: dict[str, Any]) -> str:
    m = report["machine"]
    lines = [f"{report['model']['name']}, {m['dtype']}, BLAS {m['blas']}, "
             f"{report['settings']['steps']} decode steps, median of "
             f"{report['settings']['repeats']}",
             f"{'batch/mode':<16}{'step ms':>9}{'mask ms':>9}{'wait ms':>9}{'consume ms':>11}"
             f"{'vs free':>9}"]
    for batch, modes in report["figures"].items():
        for mode, fig in modes.items():
            lines.append(f"{batch + ' ' + mode:<16}{fig['step_ms']:>9.2f}{fig['mask_ms']:>9.3f}"
                         f"{fig['wait_ms']:>9.3f}{fig['consume_ms']:>11.3f}"
                         f"{fig.get('step_vs_free', 1.0):>9.3f}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Parse flags, load --blas, run, write JSON to --out and print the table."""
    p = argparse.ArgumentParser(prog="python -m tqserve.tools.bench_grammar",
                                description=__doc__.splitlines()[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    add_blas_flag(p)
    p.add_argument("--out", type=Path, default=Path("bench-out/bench_grammar.json"))
    args = p.parse_args(argv)
    if args.steps < 2 or args.repeats < 1 or min(args.batch) < 1:
        p.error("--steps must be >= 2, --repeats and --batch >= 1")
    blas = load_blas(args.blas)
    report = run_bench(args.model, args.dtype, args.batch, args.steps, args.repeats, blas)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(format_table(report))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
