"""tqserve vs mlx-lm on one model, dtype and BLAS, side by side in one process.

    python -m tqserve.tools.bench [--model PATH] [--dtype float32] [--blas PATH] [--quick] [--out FILE]

Figures, each per side and as the ratio tqserve / mlx-lm (DESIGN.md §5); t = token arrival:
  single           one request: (n - 1) / (t_last - t_first)
  aggregate        C concurrent requests, once all have their first token (t0 = max t_first):
                   sum over requests of (m_i - 1) / (t_last_i - s_i), where s_i is request i's
                   first arrival >= t0 and m_i its arrivals from s_i on
  aggregate_burst  the same requests: sum(n_i - 1) / (max t_last - min t_first), which also
                   charges how the engine brings the burst into its batch
  ttft             seconds from submit to the first token, one request with a long prompt
tqserve runs embedded (open_engine; C generate() calls in one trio nursery); mlx-lm runs
stream_generate (single, ttft) and BatchGenerator (aggregate). Both sides: the same
LoadedModel (weights, dtype), the same prompt ids (windows of mlx-lm's generate.py source),
greedy, EOS ignored so every request yields exactly n tokens. One warm-up per side, then R
repeats interleaved (A B, B A, ...); medians. mlx is imported lazily, after --blas.
"""

from __future__ import annotations

import argparse
import copy
import importlib.metadata
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Awaitable, Callable, Sequence

from tqserve import blas

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = "../shared/models/pycoder-29m"
FIGURES = {"single": "decode tok/s", "aggregate": "decode tok/s",
           "aggregate_burst": "decode tok/s", "ttft": "s (ratio < 1: tqserve faster)"}


@dataclass(frozen=True)
class Settings:
    """What to measure; the defaults are the full bench."""

    model: str = DEFAULT_MODEL
    dtype: str = "float32"
    new_tokens: int = 128
    concurrency: int = 8
    repeats: int = 3
    prompt_tokens: int = 256
    decode_prompt_tokens: int = 48
    blas: str = "reference"


QUICK: dict[str, Any] = {"new_tokens": 8, "concurrency": 2, "repeats": 1,
                         "prompt_tokens": 32, "decode_prompt_tokens": 16}


@dataclass
class Trace:
    """One request as the client saw it: submit time, per-token arrival times, token ids."""

    submit: float = 0.0
    times: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)


def decode_rate(traces: Sequence[Trace]) -> float:
    """Sum of per-request decode rates while every request has its first token."""
    start = max(t.times[0] for t in traces)
    total = 0.0
    for trace in traces:
        times = [x for x in trace.times if x >= start]
        if len(times) > 1:
            total += (len(times) - 1) / (times[-1] - times[0])
    return total


def burst_rate(traces: Sequence[Trace]) -> float:
    """Tokens after each request's first, over min(first arrival) to max(last arrival)."""
    tokens = sum(len(t.times) - 1 for t in traces)
    return tokens / (max(t.times[-1] for t in traces) - min(t.times[0] for t in traces))


def all_decoding_rate(traces: Sequence[Trace]) -> float:
    """Tokens that arrived after every request had its first one, over the time from then
    to the last arrival: aggregate decode throughput without the prefill of the others
    (a verify step delivers several tokens at once; counted here as they arrive)."""
    start = max(t.times[0] for t in traces)
    tokens = sum(sum(1 for x in t.times if x > start) for t in traces)
    end = max(t.times[-1] for t in traces)
    return tokens / (end - start) if end > start else 0.0


def first_token_latency(traces: Sequence[Trace]) -> float:
    """Seconds from submit to the first token of the first request."""
    return traces[0].times[0] - traces[0].submit


def _blas_arg(text: str) -> str:
    """--blas auto | none | PATH (engine.blas.resolve); a bad path is a one-line usage error."""
    try:
        return blas.resolve(text) or "none"
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_blas_flag(p: argparse.ArgumentParser) -> None:
    """The --blas flag every CPU bench shares (see `load_blas`)."""
    p.add_argument("--blas", default=None, type=_blas_arg,
                   help="optimized BLAS loaded before mlx: auto (the system's OpenBLAS, "
                        "or tqserve's shim over scipy-openblas32), none, or a path, e.g. "
                        "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 (default: "
                        "MLX's bundled reference BLAS)")


def load_blas(path: str | None) -> str:
    """Load an optimized BLAS before mlx (tqserve.blas: TQSERVE_BLAS, read when the engine
    is first imported); return what the JSON records. A bench measures MLX's reference
    BLAS unless --blas names one. A file that is not a loadable library: exit 2."""
    os.environ[blas.ENV] = path or "none"
    if path is None or path == "none":
        preload = os.environ.get("LD_PRELOAD")
        return f"LD_PRELOAD={preload}" if preload else "reference"
    try:
        blas.load(path)
    except ValueError as exc:
        print(f"{Path(sys.argv[0]).name}: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    return path


def make_prompts(tokenizer: Any, count: int, length: int, skip: int = 0) -> list[list[int]]:
    """`count` distinct windows of `length` token ids of mlx-lm's generate.py source."""
    source = importlib.import_module("mlx_lm.generate").__file__
    ids = tokenizer.encode(Path(str(source)).read_text())
    need = skip + count * length
    ids = (ids * (need // len(ids) + 1))[:need]
    return [ids[skip + i * length: skip + (i + 1) * length] for i in range(count)]


def mlx_stream(loaded: Any, prompt: list[int], n: int) -> list[Trace]:
    """One request through mlx_lm.stream_generate, EOS ignored."""
    from mlx_lm.generate import stream_generate

    tokenizer = copy.copy(loaded.tokenizer)
    tokenizer.eos_token_ids = []
    trace = Trace(submit=time.perf_counter())
    for response in stream_generate(loaded.model, tokenizer, prompt, max_tokens=n):
        trace.times.append(time.perf_counter())
        trace.tokens.append(response.token)
    return [trace]


def mlx_batch(loaded: Any, prompts: list[list[int]], n: int | Sequence[int]) -> list[Trace]:
    """Requests through mlx_lm's BatchGenerator (as batch_generate drives it, no stop
    tokens): `n` tokens each, or n[i] for request i. The traces of one step share its
    arrival time."""
    from mlx_lm.generate import BatchGenerator

    lengths = [n] * len(prompts) if isinstance(n, int) else list(n)
    gen = BatchGenerator(loaded.model, max_tokens=max(lengths, default=1))
    submit = time.perf_counter()
    uids = gen.insert(prompts, max_tokens=lengths)
    traces = {uid: Trace(submit=submit) for uid in uids}
    while responses := gen.next_generated():
        now = time.perf_counter()
        for r in responses:
            traces[r.uid].times.append(now)
            traces[r.uid].tokens.append(r.token)
    gen.close()
    return [traces[uid] for uid in uids]


async def tq_request(engine: Any, prompt: list[int], n: int, trace: Trace) -> None:
    """One greedy request through Engine.generate, recording into `trace`."""
    from tqserve.actors.messages import Error, Token
    from tqserve.engine.request import GenerateRequest
    from tqserve.engine.sampling import SamplingParams

    request = GenerateRequest(prompt_tokens=prompt,
                              params=SamplingParams(max_tokens=n, temperature=0.0))
    trace.submit = time.perf_counter()
    async for event in engine.generate(request):
        if isinstance(event, Token):
            trace.times.append(time.perf_counter())
            trace.tokens.append(event.token_id)
        elif isinstance(event, Error):
            raise RuntimeError(f"tqserve request failed: {event.code}: {event.message}")


async def tq_batch(engine: Any, prompts: list[list[int]], n: int) -> list[Trace]:
    """Concurrent requests, one generate() task each in one nursery."""
    import trio

    traces = [Trace() for _ in prompts]
    async with trio.open_nursery() as nursery:
        for prompt, trace in zip(prompts, traces):
            nursery.start_soon(tq_request, engine, prompt, n, trace)
    return traces


async def compare(tq: Callable[[], Awaitable[list[Trace]]], lm: Callable[[], list[Trace]],
                  metrics: dict[str, Callable[[Sequence[Trace]], float]], n: int,
                  repeats: int) -> dict[str, Any]:
    """Warm up both sides, run them interleaved; per metric: medians, ratio, same tokens."""
    values: dict[str, dict[str, list[float]]] = {m: {"tqserve": [], "mlx_lm": []}
                                                 for m in metrics}
    last: dict[str, list[list[int]]] = {}
    for i in range(-1, repeats):
        for side in ("tqserve", "mlx_lm") if i % 2 == 0 else ("mlx_lm", "tqserve"):
            traces = await tq() if side == "tqserve" else lm()
            last[side] = [t.tokens for t in traces]
            if any(len(t) != n for t in last[side]):
                raise RuntimeError(f"{side} made {[len(t) for t in last[side]]} tokens, not {n}")
            for name, metric in metrics.items() if i >= 0 else ():
                values[name][side].append(metric(traces))
    out: dict[str, Any] = {}
    for name, sides in values.items():
        medians = {side: statistics.median(v) for side, v in sides.items()}
        out[name] = {**{side: {"median": medians[side], "runs": v} for side, v in sides.items()},
                     "ratio": medians["tqserve"] / medians["mlx_lm"],
                     "outputs_match": last["tqserve"] == last["mlx_lm"]}
    return out


def machine(settings: Settings) -> dict[str, Any]:
    """Where the figures were taken; an fp32 512x512 @ 512x1536 matmul shows the live BLAS."""
    import mlx.core as mx

    a, b = mx.random.normal((512, 512)), mx.random.normal((512, 1536))
    mx.eval(a @ b)
    start = time.perf_counter()
    for _ in range(3):
        mx.eval(a @ b)
    gflops = 3 * 2 * 512 * 512 * 1536 / (time.perf_counter() - start) / 1e9
    return {"platform": platform.platform(), "python": platform.python_version(),
            "cpu_count": os.cpu_count(), "mlx": importlib.metadata.version("mlx"),
            "mlx_lm": importlib.metadata.version("mlx-lm"),
            "device": str(mx.default_device()), "dtype": settings.dtype, "blas": settings.blas,
            "fp32_matmul_gflops": gflops}


async def _measure(settings: Settings, loaded: Any) -> dict[str, Any]:
    import attrs

    from tqserve.actors.engine import open_engine
    from tqserve.engine.config import Config

    n, c = settings.new_tokens, settings.concurrency
    prompts = make_prompts(loaded.tokenizer, c, settings.decode_prompt_tokens)
    long_prompt = make_prompts(loaded.tokenizer, 1, settings.prompt_tokens,
                               skip=c * settings.decode_prompt_tokens)[0]
    # The prefix cache is off: every run repeats the same prompts, and mlx-lm has none,
    # so with it on TTFT would measure cache hits (tools/bench_prefix measures those).
    config = Config(model=str(loaded.path), dtype=settings.dtype, max_batch=max(32, c),
                    max_queued_requests=max(64, c), max_tokens_cap=max(4096, n),
                    prefix_cache=False)
    no_eos = attrs.evolve(loaded, eos_token_ids=frozenset())
    async with open_engine(config, loaded=no_eos) as engine:
        single = await compare(lambda: tq_batch(engine, prompts[:1], n),
                               lambda: mlx_stream(loaded, prompts[0], n),
                               {"single": decode_rate}, n, settings.repeats)
        batch = await compare(lambda: tq_batch(engine, prompts, n),
                              lambda: mlx_batch(loaded, prompts, n),
                              {"aggregate": decode_rate, "aggregate_burst": burst_rate},
                              n, settings.repeats)
        ttft = await compare(lambda: tq_batch(engine, [long_prompt], 2),
                             lambda: mlx_stream(loaded, long_prompt, 2),
                             {"ttft": first_token_latency}, 2, settings.repeats)
    return {**single, **batch, **ttft}


def run_bench(settings: Settings) -> dict[str, Any]:
    """Load the model once and measure every figure; return the JSON report."""
    import trio

    from tqserve.engine.model import load_model

    in_repo = REPO_ROOT / settings.model
    loaded = load_model(in_repo if in_repo.exists() else settings.model, settings.dtype)
    figures = trio.run(_measure, settings, loaded)
    return {
        "machine": machine(settings),
        "model": {"name": loaded.path.name, "path": str(loaded.path), "dtype": loaded.dtype,
                  "fingerprint": loaded.fingerprint},
        "settings": {**asdict(settings), "greedy": True, "ignore_eos": True,
                     "order": "one warm-up each, then interleaved A B / B A",
                     "units": FIGURES},
        **figures,
    }


def format_table(report: dict[str, Any]) -> str:
    """The report as a fixed-width table of medians and ratios."""
    m, s = report["machine"], report["settings"]
    rows = [("single-stream decode tok/s", "single", 1.0),
            (f"aggregate decode tok/s (x{s['concurrency']})", "aggregate", 1.0),
            (f"burst decode tok/s (x{s['concurrency']})", "aggregate_burst", 1.0),
            (f"TTFT ms ({s['prompt_tokens']}-token prompt)", "ttft", 1000.0)]
    lines = [f"{report['model']['name']}, {m['dtype']}, BLAS {m['blas']} "
             f"({m['fp32_matmul_gflops']:.1f} GFLOP/s fp32), {m['cpu_count']} CPUs, "
             f"{s['new_tokens']} new tokens, median of {s['repeats']}",
             f"{'figure':<34}{'tqserve':>10}{'mlx-lm':>10}{'ratio':>8}  same tokens"]
    for label, key, scale in rows:
        fig = report[key]
        lines.append(f"{label:<34}{fig['tqserve']['median'] * scale:>10.1f}"
                     f"{fig['mlx_lm']['median'] * scale:>10.1f}{fig['ratio']:>8.3f}  "
                     f"{fig['outputs_match']}")
    return "\n".join(lines)


_COUNTS = {"new_tokens": (2, "tokens per request"), "concurrency": (1, "aggregate requests"),
           "repeats": (1, "timed runs per side"), "prompt_tokens": (1, "TTFT prompt length"),
           "decode_prompt_tokens": (1, "prompt length of the decode figures")}


def build_parser() -> argparse.ArgumentParser:
    """The bench's flags (kept separate so `tqserve bench` can reuse them)."""
    d = Settings()
    p = argparse.ArgumentParser(prog="tqserve bench", description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default=d.model, help="model dir (relative to the repo) or hub id")
    p.add_argument("--dtype", default=d.dtype, choices=("float32", "bfloat16", "float16"),
                   help="model dtype")
    for name, (_, what) in _COUNTS.items():
        p.add_argument("--" + name.replace("_", "-"), type=int,
                       default=getattr(d, name), help=what)
    add_blas_flag(p)
    p.add_argument("--out", type=Path, default=Path("bench-out/bench.json"),
                   help="JSON results file")
    p.add_argument("--quick", action="store_true", help="tiny sizes (smoke test)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Parse flags, load --blas, run the bench, write JSON to --out and print the table."""
    parser = build_parser()
    args = parser.parse_args(argv)
    for name, (minimum, _) in _COUNTS.items():
        if getattr(args, name) < minimum:
            parser.error(f"--{name.replace('_', '-')} must be >= {minimum}")
    settings = Settings(model=args.model, dtype=args.dtype,
                        **{name: getattr(args, name) for name in _COUNTS})
    if args.quick:
        settings = replace(settings, **QUICK)
    settings = replace(settings, blas=load_blas(args.blas))
    report = run_bench(settings)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(format_table(report))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
