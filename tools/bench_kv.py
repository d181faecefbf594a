"""Decode speed with a TurboQuant KV cache vs the plain cache, side by side in one run.

    python -m tqserve.tools.bench_kv --model ../shared/models/pycoder-29m --contexts 1024,4096
    python -m tqserve.tools.bench_kv --shape qwen3-8b --contexts 8192,32768      # random weights (GPU)

For each context length N: --rows rows (default 1) are prefilled with N random tokens
(forwards of --prefill-chunk tokens over all rows) for each scheme, then --steps greedy
decode steps are timed (each step: forward of one token per row, argmax, mx.eval — the
same loop for every scheme). Schemes (--schemes picks some; plain always runs): "plain",
the mlx-lm cache (the baseline, in the model's dtype); TurboQuant --turboquant (default
k4v4) "fused" (on CUDA the kernels of engine/attention/cuda_decode.py), "plain-ops", and on CUDA
"fused-compiled-ops" (the compiled graph instead of the kernels); "affine8", --kv-quant 8.
The three TurboQuant schemes are `--kv turboquant:...,decode=` auto, unfused, compiled. Schemes run interleaved,
--repeats times, median ms/step reported, with each scheme's ratio to the plain cache and
its resident KV bytes. Needs only MLX and engine/ (no trio), so it runs on the lent GPU.
On the H200 the 16k x 32-row figure (not measured yet) is
`--shape qwen3-8b --contexts 16384 --rows 32 --schemes fused,fused-compiled-ops`.
"""

from __future__ import annotations

import argparse
import functools
import importlib.metadata
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Sequence

SHAPES = {  # Qwen3 shapes for random-weight runs: (layers, hidden, heads, kv heads, ffn, vocab)
    "qwen3-0.6b": (28, 1024, 16, 8, 3072, 151936),
    "qwen3-8b": (36, 4096, 32, 8, 12288, 151936),
}


def _random_model(shape: str, dtype: str) -> Any:
    import mlx.core as mx
    from mlx_lm.models import qwen3

    layers, hidden, heads, kv_heads, ffn, vocab = SHAPES[shape]
    args = qwen3.ModelArgs(model_type="qwen3", hidden_size=hidden, num_hidden_layers=layers,
                           intermediate_size=ffn, num_attention_heads=heads,
                           num_key_value_heads=kv_heads, head_dim=128, rms_norm_eps=1e-6,
                           vocab_size=vocab, max_position_embeddings=65536, rope_theta=1e6,
                           tie_word_embeddings=False)
    mx.random.seed(0)
    model = qwen3.Model(args)
    model.set_dtype(getattr(mx, dtype))
    mx.eval(model.parameters())
    return model


def _schemes(turboquant: str, wanted: Sequence[str] | None) -> dict[str, tuple[Any, ...]]:
    """scheme -> (turboquant, TurboQuant decode path, affine bits)."""
    from tqserve.engine.attention import cuda_decode

    schemes: dict[str, tuple[Any, ...]] = {
        "plain": (None, "auto", None), f"{turboquant}-fused": (turboquant, "auto", None),
        f"{turboquant}-plain-ops": (turboquant, "unfused", None),
        "affine8": (None, "auto", 8)}
    if cuda_decode.available(128, 1):
        schemes[f"{turboquant}-fused-compiled-ops"] = (turboquant, "compiled", None)
    if wanted:
        unknown = [w for w in wanted if w not in schemes and f"{turboquant}-{w}" not in schemes]
        if unknown:
            raise ValueError(f"unknown schemes {unknown}; choose from {sorted(schemes)}")
        schemes = {k: v for k, v in schemes.items()
                   if k == "plain" or k in wanted or k.split("-", 1)[-1] in wanted}
    return schemes


def _make_cache(model: Any, turboquant: str | None, decode: str,
                affine: int | None = None) -> list[Any]:
    from mlx_lm.models.cache import make_prompt_cache

    from tqserve.engine.kv.factory import cache_factory_for

    factory = cache_factory_for(model, turboquant, kv_quant=affine, decode=decode)
    return factory(model) if factory is not None else make_prompt_cache(model)


def _measure(model: Any, cache_fn: Callable[[], list[Any]], context: int, steps: int,
             chunk: int, vocab: int, rows: int = 1) -> tuple[float, int]:
    """Prefill `rows` x `context` random tokens, then time `steps` decode steps:
    (ms/step, kv bytes)."""
    import mlx.core as mx

    cache = cache_fn()
    tokens = mx.random.randint(0, vocab, (rows, context), key=mx.random.key(1))
    per_row = max(1, chunk // rows)  # a forward of ~`chunk` tokens over all rows
    for start in range(0, context, per_row):
        model(tokens[:, start:start + per_row], cache=cache)
        mx.eval([c.state for c in cache])
        mx.clear_cache()  # growing caches leave buffers MLX-CUDA does not reuse
    y = mx.ones((rows, 1), dtype=mx.int32)
    for _ in range(3):  # warm the decode shapes
        y = mx.argmax(model(y, cache=cache)[:, -1, :], axis=-1, keepdims=True)
        mx.eval(y)
    tic = time.perf_counter()
    for _ in range(steps):
        y = mx.argmax(model(y, cache=cache)[:, -1, :], axis=-1, keepdims=True)
        mx.eval(y)
    elapsed = time.perf_counter() - tic
    nbytes = sum(c.nbytes for c in cache)
    del cache
    mx.clear_cache()
    return 1000.0 * elapsed / steps, nbytes


def run(args: argparse.Namespace) -> dict[str, Any]:
    import mlx.core as mx

    from tqserve.engine.model import load_model

    if args.shape:
        dtype = "float32" if mx.default_device() == mx.cpu and args.dtype == "auto" else (
            "bfloat16" if args.dtype == "auto" else args.dtype)
        model, name, vocab = _random_model(args.shape, dtype), f"random {args.shape}", \
            SHAPES[args.shape][-1]
    else:
        loaded = load_model(args.model, args.dtype)
        model, name, vocab, dtype = loaded.model, loaded.path.name, loaded.vocab_size, loaded.dtype
    schemes = _schemes(args.turboquant, args.schemes)
    results: dict[str, Any] = {}
    for context in args.contexts:
        runs: dict[str, list[float]] = {s: [] for s in schemes}
        nbytes: dict[str, int] = {}
        for _ in range(args.repeats):
            for scheme, (tq, decode, affine) in schemes.items():
                make = functools.partial(_make_cache, model, tq, decode, affine)
                ms, nb = _measure(model, make,
                                  context, args.steps, args.prefill_chunk, vocab, args.rows)
                runs[scheme].append(ms)
                nbytes[scheme] = nb
        base = statistics.median(runs["plain"])
        results[str(context)] = {
            scheme: {"ms_per_step": statistics.median(v), "tokens_per_s": args.rows * 1000.0 / statistics.median(v),
                     "ratio_vs_plain": base / statistics.median(v), "kv_bytes": nbytes[scheme],
                     "runs_ms": v}
            for scheme, v in runs.items()}
    return {
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "mlx": importlib.metadata.version("mlx"), "device": str(mx.default_device()),
                    "blas": os.environ.get("TQSERVE_BENCH_BLAS", "mlx default")},
        "model": name, "dtype": dtype, "turboquant": args.turboquant, "rows": args.rows,
        "steps": args.steps,
        "repeats": args.repeats, "prefill_chunk": args.prefill_chunk, "results": results,
    }


def _table(report: dict[str, Any]) -> str:
    lines = [f"{report['model']} ({report['dtype']}, {report['machine']['device']}, "
             f"{report['rows']} rows): decode ms/step, tokens/s, ratio vs plain, KV MB",
             f"{'context':>8} {'scheme':<20} {'ms/step':>9} {'tok/s':>9} {'ratio':>7} {'KV MB':>9}"]
    for context, schemes in report["results"].items():
        for scheme, r in schemes.items():
            lines.append(f"{context:>8} {scheme:<20} {r['ms_per_step']:>9.2f} "
                         f"{r['tokens_per_s']:>9.1f} {r['ratio_vs_plain']:>7.2f} "
                         f"{r['kv_bytes'] / 2**20:>9.1f}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tqserve bench kv", description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", default="../shared/models/pycoder-29m",
                     help="model dir or hub id")
    src.add_argument("--shape", choices=sorted(SHAPES),
                     help="a random-weight model of this shape instead of --model (default: off)")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                   help="model dtype")
    p.add_argument("--turboquant", default="k4v4", help="TurboQuant scheme kXvY")
    p.add_argument("--contexts", type=lambda s: [int(x) for x in s.split(",")],
                   default=[1024, 4096], help="context lengths, comma-separated")
    p.add_argument("--rows", type=int, default=1, help="rows decoded together")
    p.add_argument("--schemes", type=lambda s: [x for x in s.split(",") if x], default=None,
                   help="comma-separated subset (plain always runs), e.g. fused,affine8")
    p.add_argument("--steps", type=int, default=32, help="timed decode steps per run")
    p.add_argument("--repeats", type=int, default=3, help="runs per figure (median)")
    p.add_argument("--prefill-chunk", type=int, default=2048,
                   help="tokens per prefill forward, all rows together")
    p.add_argument("--out", type=Path, default=Path("bench-out/bench_kv.json"),
                   help="JSON results file")
    args = p.parse_args(argv)
    if args.steps < 1 or args.repeats < 1 or args.rows < 1 or min(args.contexts) < 1:
        p.error("--steps, --repeats, --rows and --contexts must be positive")
    try:
        report = run(args)
    except ValueError as e:
        p.error(str(e))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(_table(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
