"""tqserve vs mlx-lm at GPU scale: random-weight Qwen3 shapes, B1..B64, one process.

    python -m tqserve.tools.bench_gpu --shape qwen3-8b --concurrency 1,8,32,64 --out bench-out/gpu.json
    python -m tqserve.tools.bench_gpu --shape bundled --concurrency 1,8     # real weights: same tokens?

For each concurrency C (prompts of --prompt-tokens ids, --new-tokens greedy tokens, EOS
ignored), tools.bench's drivers run tqserve embedded (open_engine) against mlx-lm's
BatchGenerator, and at C = 1 also against stream_generate: one warm-up per side and shape
(MLX-CUDA compiles kernels per shape on first use), then --repeats interleaved runs, medians.
The engine also warms up at start on a GPU (Config.warmup "auto": engine.warmup, every batch
size up to max(32, C) once); `engine_start_s` in the JSON is the time open_engine took.
Figures: decode tok/s once every request has its first token (tools.bench.decode_rate), and
"all first" = seconds from the burst's submit until every request has its first token.

Random weights (`qwen3-0.6b`, `qwen3-8b`: tools.bench_kv.SHAPES, the real vocabulary) have
near-tied logits, so token equality is only meaningful with real weights: `--shape bundled`
(pycoder-draft-4m) or `--model PATH`. The tokenizer is the bundled model's (ids past its
8,192 decode to nothing; the figures count tokens, not text). Needs a GPU to mean anything.

Greedy equality on real weights in the same command: `--equality-model` (default
../shared/models/pycoder-29m, relative to the working directory; `bundled` for
pycoder-draft-4m, `none` to skip) runs --equality-count prompts through tqserve as one
burst and through BatchGenerator, and the first through stream_generate, and reports
whether the tokens are identical (`equality` in the JSON). `--max-step-tokens` sets the
engine's per-step token budget (default: Config's), so one command can sweep it.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import time
from pathlib import Path
from typing import Any, Sequence

from tqserve.tools.bench import (Settings, Trace, compare, decode_rate, machine, make_prompts, mlx_batch,
                         mlx_stream, tq_batch)


# MLX-CUDA's CUDA-graph sizes (read once by MLX): recorded with each report
MLX_GRAPH_VARIABLES = ("MLX_MAX_OPS_PER_BUFFER", "MLX_MAX_MB_PER_BUFFER")


def all_first(traces: Sequence[Trace]) -> float:
    """Seconds from the first submit until the last request's first token."""
    return max(t.times[0] for t in traces) - min(t.submit for t in traces)


def _loaded(shape: str, model: str | None, dtype: str) -> Any:
    import attrs
    import mlx.core as mx

    from tqserve.engine.model import DEFAULT_MODEL, load_model
    from tqserve.tools.bench_kv import SHAPES, _random_model

    if model is not None:
        return load_model(model, dtype)
    base = load_model(DEFAULT_MODEL, dtype)
    if shape == "bundled":
        return base
    random = _random_model(shape, dtype if dtype != "auto" else "bfloat16")
    layers, _, _, _, _, vocab = SHAPES[shape]
    return attrs.evolve(base, model=random, path=Path(f"random-{shape}"),
                        fingerprint=f"random-{shape}-{mx.default_device()}",
                        num_layers=layers, head_dims=(128,) * layers, vocab_size=vocab,
                        context_length=65536)


def _config(loaded: Any, top: int, prompt_tokens: int, n: int,
            max_step_tokens: int | None, fast_decode: str = "auto") -> Any:
    from tqserve.engine.config import Config

    extra = {} if max_step_tokens is None else {"max_step_tokens": max(max_step_tokens, top,
                                                                       32)}
    return Config(model=str(loaded.path), dtype=loaded.dtype, max_batch=max(32, top),
                  fast_decode=fast_decode,
                  max_queued_requests=max(64, top), max_queued_tokens=max(65536, top *
                  prompt_tokens), max_tokens_cap=max(4096, n), prefix_cache=False, **extra)


def _engine_model(loaded: Any, fast_decode: str) -> Any:
    """The model the engine runs: with the fast decode path a fused copy (sharing every
    other weight), so that mlx-lm keeps running the model as loaded."""
    import attrs

    from tqserve.engine import fastpath

    if not fastpath.wanted(fast_decode):
        return loaded
    return attrs.evolve(loaded, model=fastpath.fuse_projections(loaded.model, copy=True)[0])


async def _equality(path: str, dtype: str, count: int, prompt_tokens: int, n: int,
                    max_step_tokens: int | None, fast_decode: str = "auto") -> dict[str, Any]:
    """Greedy tokens of a real model: tqserve burst vs BatchGenerator and stream_generate
    (mlx-lm on the model as loaded, the engine on `_engine_model`)."""
    import attrs

    from tqserve.actors.engine import open_engine
    from tqserve.engine.model import DEFAULT_MODEL, load_model

    loaded = load_model(str(DEFAULT_MODEL) if path == "bundled" else path, dtype)
    loaded = attrs.evolve(loaded, eos_token_ids=frozenset())
    prompts = make_prompts(loaded.tokenizer, count, prompt_tokens)
    async with open_engine(_config(loaded, count, prompt_tokens, n, max_step_tokens,
                                   fast_decode),
                           loaded=_engine_model(loaded, fast_decode)) as engine:
        ours = [t.tokens for t in await tq_batch(engine, prompts, n)]
    batch = [t.tokens for t in mlx_batch(loaded, prompts, n)]
    single = mlx_stream(loaded, prompts[0], n)[0].tokens
    return {"model": str(loaded.path), "count": count, "new_tokens": n,
            "batch_match": ours == batch, "stream_match": ours[0] == single,
            "rows_differing_from_batch": sum(a != b for a, b in zip(ours, batch))}


async def _measure(loaded: Any, levels: list[int], prompt_tokens: int, n: int,
                   repeats: int, max_step_tokens: int | None = None, fast_decode: str = "auto"
                   ) -> tuple[dict[str, Any], float]:
    """Figures per concurrency level, and the seconds open_engine took (its warm-up);
    the engine runs `_engine_model`, mlx-lm the model as loaded."""
    import attrs

    from tqserve.actors.engine import open_engine

    top = max(levels)
    prompts = make_prompts(loaded.tokenizer, top, prompt_tokens)
    config = _config(loaded, top, prompt_tokens, n, max_step_tokens, fast_decode)
    no_eos = attrs.evolve(_engine_model(loaded, fast_decode), eos_token_ids=frozenset())
    out: dict[str, Any] = {}
    start = time.perf_counter()
    async with open_engine(config, loaded=no_eos) as engine:
        started = time.perf_counter() - start
        for c in levels:
            batch = prompts[:c]
            figures = await compare(functools.partial(tq_batch, engine, batch, n),
                                    functools.partial(mlx_batch, loaded, batch, n),
                                    {"decode": decode_rate, "all_first": all_first},
                                    n, repeats)
            if c == 1:
                figures["decode_vs_stream"] = (await compare(
                    functools.partial(tq_batch, engine, batch, n),
                    functools.partial(mlx_stream, loaded, batch[0], n),
                    {"decode": decode_rate}, n, repeats))["decode"]
            out[f"c{c}"] = figures
    return out, started


def run(args: argparse.Namespace) -> dict[str, Any]:
    import trio

    loaded = _loaded(args.shape, args.model, args.dtype)
    levels = sorted({int(x) for x in args.concurrency.split(",")})
    figures, engine_start = trio.run(_measure, loaded, levels, args.prompt_tokens, args.new_tokens,
                       args.repeats, args.max_step_tokens, args.fast_decode)
    equality = None
    if args.equality_model != "none":
        equality = trio.run(_equality, args.equality_model, args.dtype, args.equality_count,
                            args.prompt_tokens, args.new_tokens, args.max_step_tokens,
                            args.fast_decode)
    return {"equality": equality,"machine": machine(Settings(model=str(loaded.path), dtype=loaded.dtype)),
            "model": {"shape": args.shape, "path": str(loaded.path), "dtype": loaded.dtype},
            "settings": {"concurrency": levels, "prompt_tokens": args.prompt_tokens,
                         "new_tokens": args.new_tokens, "repeats": args.repeats,
                         "max_step_tokens": args.max_step_tokens,
                         "fast_decode": args.fast_decode,
                         "mlx_env": {k: os.environ.get(k) for k in MLX_GRAPH_VARIABLES},
                         "greedy": True, "ignore_eos": True},
            "engine_start_s": engine_start, "figures": figures}


def table(report: dict[str, Any]) -> str:
    """Medians as rows: C, tqserve and mlx-lm decode tok/s and ms/step, ratio, all-first s."""
    lines = [f"{report['model']['shape']} ({report['model']['dtype']}) on "
             f"{report['machine']['device']}, {report['settings']['prompt_tokens']}-token "
             f"prompts, {report['settings']['new_tokens']} new tokens",
             f"{'C':>3} {'tqserve tok/s':>14} {'BatchGen tok/s':>15} {'ratio':>6} "
             f"{'all-first tq/BG s':>18} {'same tokens':>12}"]
    for key, fig in report["figures"].items():
        c = int(key[1:])
        d, f = fig["decode"], fig["all_first"]
        lines.append(f"{c:>3} {d['tqserve']['median']:>14.1f} {d['mlx_lm']['median']:>15.1f} "
                     f"{d['ratio']:>6.2f} {f['tqserve']['median']:>8.2f}/"
                     f"{f['mlx_lm']['median']:<9.2f} {str(d['outputs_match']):>12}")
        if "decode_vs_stream" in fig:
            s = fig["decode_vs_stream"]
            lines.append(f"    vs stream_generate: {s['tqserve']['median']:.1f} vs "
                         f"{s['mlx_lm']['median']:.1f} tok/s, ratio {s['ratio']:.2f}, "
                         f"ms/step {1000 / s['tqserve']['median']:.2f} vs "
                         f"{1000 / s['mlx_lm']['median']:.2f}")
    eq = report.get("equality")
    if eq is not None:
        lines.append(f"greedy equality on {eq['model']} ({eq['count']} prompts, "
                     f"{eq['new_tokens']} tokens): BatchGenerator {eq['batch_match']}, "
                     f"stream_generate {eq['stream_match']}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tqserve bench gpu", description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--shape", default="qwen3-8b", choices=("qwen3-0.6b", "qwen3-8b", "bundled"),
                   help="random-weight model shape")
    p.add_argument("--model", default=None,
                   help="a real model dir instead of --shape (default: off)")
    p.add_argument("--dtype", default="auto",
                   help="auto: the model's dtype on a GPU, float32 on the CPU; random: bf16")
    p.add_argument("--concurrency", default="1,8,32,64", help="batch sizes, comma-separated")
    p.add_argument("--prompt-tokens", type=int, default=256, help="tokens of each prompt")
    p.add_argument("--new-tokens", type=int, default=128, help="tokens generated per request")
    p.add_argument("--repeats", type=int, default=3, help="runs per figure (median)")
    p.add_argument("--fast-decode", choices=("auto", "on", "off"), default="auto",
                   help="the engine's --fast-decode (auto: on a GPU)")
    p.add_argument("--max-step-tokens", type=int, default=None,
                   help="the engine's per-step token budget (default: Config's)")
    p.add_argument("--equality-model", default="../shared/models/pycoder-29m",
                   help="real model for the greedy token check (bundled, none, or a path)")
    p.add_argument("--equality-count", type=int, default=8,
                   help="prompts of the greedy token check (one burst)")
    p.add_argument("--out", type=Path, default=Path("bench-out/bench_gpu.json"),
                   help="JSON results file")
    args = p.parse_args(argv)
    report = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(table(report))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
