"""Decode-step variants on one model: where a step's host time goes, as ms per step.

    python -m tqserve.tools.step_variants --shape qwen3-8b --batches 1,8,64 --out bench-out/variants.json
    python -m tqserve.tools.step_variants --shape qwen3-8b --env MLX_MAX_OPS_PER_BUFFER=1000 ...

Each variant decodes B rows of equal length (a --prompt-tokens prompt each, greedy, EOS
ignored) for --warm steps, then times --steps steps (medians over --repeats runs):

  mlx_loop    mlx-lm's model with KVCache, pipelined as generate_step (the next forward is
              built on the lazy token and started before the token is read back)
  mlx_upload  mlx_loop, but every step's RoPE offset is a new host array (one upload per
              step, shared by all layers, as a batch with per-row offsets needs)
  fused       the same after engine.fastpath.fuse_projections (q/k/v and gate/up weights
              concatenated: 3 fewer matmuls per layer)
  compiled    fused, plus engine.fastpath's compiled decode layers (each layer's norms,
              projections, RoPE and MLP traced once per batch size by mx.compile; only the
              cache write and attention run op by op)
  runner      tqserve's Runner driven by the sans-io scheduler core (no actors): the
              engine's own step (slot caches, batched sampling, one read-back per step)
  runner_fast the runner with --fast-decode (fused weights and compiled decode layers)
  build_ms    (reported per variant) host time to build one forward's graph, not evaluated

--env KEY=VALUE sets MLX environment variables (MLX_MAX_OPS_PER_BUFFER,
MLX_MAX_MB_PER_BUFFER: how many ops / MB of inputs go into one CUDA graph) in a child process
per setting, since MLX reads them once. Random weights (tools.bench_kv.SHAPES) or --model.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

VARIANTS = ("mlx_loop", "mlx_upload", "runner", "fused", "compiled", "runner_fast")


def _model(shape: str | None, path: str | None, dtype: str) -> tuple[Any, int]:
    if path is not None:
        from tqserve.engine.model import load_model

        loaded = load_model(path, dtype)
        return loaded.model, loaded.vocab_size
    from tqserve.tools.bench_kv import SHAPES, _random_model

    return _random_model(shape, dtype), SHAPES[shape][-1]


def _mlx_loop(model: Any, forward: Callable[..., Any], prompt: Any, batch: int, warm: int,
              steps: int) -> tuple[float, float]:
    """ms/step of a pipelined greedy loop, and ms to build one forward's graph."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    tokens = mx.broadcast_to(prompt[None], (batch, prompt.shape[0]))
    logits = model(tokens, cache=cache)[:, -1, :]
    y = mx.argmax(logits, axis=-1)
    mx.eval(y)
    times = []
    build = []
    for i in range(warm + steps):
        start = time.perf_counter()
        nxt = mx.argmax(forward(y[:, None], cache)[:, -1, :], axis=-1)
        built = time.perf_counter()
        mx.async_eval(nxt)
        y.tolist()
        y = nxt
        if i >= warm:
            times.append(time.perf_counter() - start)
            build.append(built - start)
    mx.eval(y)
    return statistics.median(times) * 1000, statistics.median(build) * 1000


class _UploadedOffset:
    """A KVCache whose RoPE offset is a host array made anew each step (mlx_upload)."""

    def __init__(self, cache: Any, holder: list[Any]) -> None:
        self._cache = cache
        self._holder = holder

    @property
    def offset(self) -> Any:
        return self._holder[0]

    def update_and_fetch(self, keys: Any, values: Any) -> Any:
        return self._cache.update_and_fetch(keys, values)

    def make_mask(self, *args: Any, **kwargs: Any) -> Any:
        return self._cache.make_mask(*args, **kwargs)


def _uploading(model: Any) -> Callable[..., Any]:
    import mlx.core as mx

    def forward(y: Any, cache: list[Any]) -> Any:
        holder = [mx.array(cache[0].offset, dtype=mx.int32)]
        return model(y, cache=[_UploadedOffset(c, holder) for c in cache])

    return forward


def _runner(model: Any, prompt: list[int], batch: int, warm: int, steps: int,
            fast: bool = False) -> float:
    from tqserve.engine.runner import Runner
    from tqserve.engine.sampling import SamplingParams
    from tqserve.engine.scheduler import SchedulerCore

    core = SchedulerCore(max_batch=batch, prefill_chunk=4096, eos_token_ids=(),
                         max_step_tokens=max(4096, batch * len(prompt)))
    runner = Runner(model, fast_decode=fast)
    for i in range(batch):
        core.add(f"r{i}", tuple(prompt), SamplingParams(max_tokens=warm + steps + 4,
                                                        temperature=0.0))
    times: list[float] = []
    seen = 0
    start = time.perf_counter()
    while core.has_work() and len(times) < steps:
        plan, _ = core.schedule()
        result = runner.execute(plan)
        core.postprocess(result)
        end = time.perf_counter()  # a whole step: schedule, execute, postprocess
        if len(result.outputs) == batch and not plan.join:
            seen += 1
            if seen > warm:
                times.append(end - start)
        start = end
    runner.close()
    return statistics.median(times) * 1000


def _decode_logits(model: Any, forward: Callable[..., Any], prompt: Any) -> Any:
    """Logits of 4 greedy decode steps after the prompt (float32), for the variants' check."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    y = mx.argmax(model(prompt[None], cache=cache)[:, -1, :], axis=-1)
    out = []
    for _ in range(4):
        logits = forward(y[:, None], cache)[:, -1, :].astype(mx.float32)
        out.append(logits)
        y = mx.argmax(logits, axis=-1)
    return mx.concatenate(out)


def run_variants(shape: str | None, path: str | None, dtype: str, batches: Sequence[int],
                 variants: Sequence[str], prompt_tokens: int, warm: int, steps: int,
                 repeats: int) -> dict[str, Any]:
    """Every variant at every batch size, interleaved per repeat; medians."""
    import mlx.core as mx

    from tqserve.engine import fastpath

    model, vocab = _model(shape, path, dtype)
    prompt = [int(x) for x in mx.random.randint(2, min(vocab, 8192), (prompt_tokens,)).tolist()]
    prompt_array = mx.array(prompt)
    plain = lambda y, cache: model(y, cache=cache)  # noqa: E731
    results: dict[str, Any] = {}
    reference = _decode_logits(model, plain, prompt_array)
    compiled = None  # the compiled forward, once the weights are fused
    for variant in sorted(variants, key=VARIANTS.index):  # the fused ones after the plain
        if variant in ("fused", "compiled", "runner_fast") and compiled is None:
            model, _ = fastpath.fuse_projections(model)
            compiled = fastpath.DecodeForward(model)  # one per model: traces are kept
            for name, fwd in (("fused", plain), ("compiled", compiled)):
                got = _decode_logits(model, fwd, prompt_array)
                results[f"check_{name}"] = {
                    "max_abs_logit_diff": mx.abs(got - reference).max().item(),
                    "argmax_equal": bool(mx.all(mx.argmax(got, -1)
                                                == mx.argmax(reference, -1)).item())}
                print(f"check {name}: {results[f'check_{name}']}", flush=True)
        for batch in batches:
            runs, builds = [], []
            key = f"{variant}_b{batch}"
            try:
                for _ in range(repeats):
                    if variant.startswith("runner"):
                        runs.append(_runner(model, prompt, batch, warm, steps,
                                            fast=variant == "runner_fast"))
                        continue
                    forward = plain
                    if variant == "compiled":
                        forward = compiled
                    elif variant == "mlx_upload":
                        forward = _uploading(model)
                    ms, build = _mlx_loop(model, forward, prompt_array, batch, warm, steps)
                    runs.append(ms)
                    builds.append(build)
            except Exception as exc:  # a variant that fails on this backend: say so, go on
                results[key] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
                print(f"{key}: {results[key]['error']}", flush=True)
                continue
            results[key] = {"ms_per_step": statistics.median(runs), "runs": runs,
                            "tok_per_s": batch * 1000 / statistics.median(runs)}
            if builds:
                results[key]["build_ms"] = statistics.median(builds)
            print(f"{key}: {results[key]['ms_per_step']:.2f} ms/step "
                  f"({results[key]['tok_per_s']:.0f} tok/s)"
                  + (f", build {results[key]['build_ms']:.2f} ms" if builds else ""),
                  flush=True)
    results["device"] = str(mx.default_device())
    return results


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tqserve-step-variants", description=__doc__.split("\n")[0])
    src = p.add_mutually_exclusive_group()
    src.add_argument("--shape", default=None, help="random-weight shape (tools.bench_kv.SHAPES)")
    src.add_argument("--model", default=None, help="model path instead of --shape")
    p.add_argument("--dtype", default="bfloat16", help="model dtype (default: bfloat16)")
    p.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1],
                   help="batch sizes, comma-separated (default: 1)")
    p.add_argument("--variants", type=lambda s: s.split(","), default=list(VARIANTS),
                   help=f"comma-separated subset of {','.join(VARIANTS)}")
    p.add_argument("--prompt-tokens", type=int, default=256, help="prompt length (default 256)")
    p.add_argument("--warm", type=int, default=16, help="untimed steps first (default 16)")
    p.add_argument("--steps", type=int, default=48, help="timed steps (default 48)")
    p.add_argument("--repeats", type=int, default=2, help="runs per figure (default 2)")
    p.add_argument("--env", action="append", default=[],
                   help="KEY=VALUE[,KEY=VALUE]: run everything again in a child process with "
                        "these MLX variables (repeatable)")
    p.add_argument("--out", default=None, help="write the JSON report here (- for stdout)")
    args = p.parse_args(argv)
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:
        p.error(f"unknown --variants {unknown}; choose from {list(VARIANTS)}")
    if args.shape is None and args.model is None:
        p.error("give --shape or --model")
    report: dict[str, Any] = {"settings": {k: v for k, v in vars(args).items() if k != "env"}}
    child = list(argv if argv is not None else sys.argv[1:])
    child = [a for i, a in enumerate(child) if a not in ("--env", "--out")
             and (i == 0 or child[i - 1] not in ("--env", "--out"))]
    for setting in args.env:  # children first: this process holds no model meanwhile
        env = dict(os.environ, **dict(kv.split("=", 1) for kv in setting.split(",")))
        print(f"--- {setting}", flush=True)
        out = subprocess.run([sys.executable, "-m", "tqserve.tools.step_variants", *child,
                              "--out", "-"], env=env, capture_output=True, text=True)
        lines = out.stdout.splitlines()
        start = next((i for i, line in enumerate(lines) if line.startswith("{")), None)
        for line in lines[:start]:
            print(line, flush=True)
        report[setting] = (json.loads("\n".join(lines[start:]))["default"] if start is not None
                           else {"error": out.stderr[-1000:]})
        if start is None:
            print(out.stderr[-1000:], flush=True)
    print("--- default", flush=True)
    report["default"] = run_variants(args.shape, args.model, args.dtype, args.batches,
                                     args.variants, args.prompt_tokens, args.warm, args.steps,
                                     args.repeats)
    text = json.dumps(report, indent=2)
    if args.out == "-":
        print(text)
    elif args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
