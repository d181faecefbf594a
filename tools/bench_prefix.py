"""Prefix cache speed and size: TTFT cold vs RAM hit vs SSD hit, snapshot bytes on disk vs RAM.

    python -m tqserve.tools.bench_prefix [--model PATH] [--dtype float32] [--blas PATH]
                                 [--prompt-tokens 2048] [--repeats 3] [--quick] [--out FILE]
    python -m tqserve.tools.bench_prefix --index [--entries 10000] [--prompt-tokens 2048] [--out FILE]

TTFT = seconds from submit to the first token of one greedy request (embedded engine,
open_engine), for R distinct prompts of --prompt-tokens ids (windows of mlx-lm's generate.py):
  cold  engine A (prefix cache on, large RAM budget): each prompt the first time (a miss)
  ram   engine A again: the same prompt, reusing all but its last token from the RAM tier
  ssd   engine B (--ram-cache-bytes 1, sync flush) runs each prompt once, which writes its
        snapshots to a fresh --cache-dir; engine C, a restart on that directory, then runs
        each prompt again: reused from the SSD tier (read, verified, decompressed, rebuilt)
Every engine gets one short warm-up request first. Medians over R; speedup = cold / hit.
Each hit's Done reports the tier and the reused tokens, and the hit's tokens equal cold's.

Snapshot bytes: the snapshot file of one prompt for the plain cache and for TurboQuant
k4v4: RAM bytes (the planes' raw bytes, what the RAM tier holds) vs file bytes on disk
(zstd planes plus header); ratio = RAM / disk. mlx is imported lazily, after --blas.

--index (no model): the PrefixIndex alone. E entries (--entries) under one system prompt
of --prompt-tokens ids, each followed by its own 64-token suffix; then E more publishes
(new suffixes) and E lookups (prompts that share the system prompt and half a suffix),
each timed alone with perf_counter_ns; p50/p99/max in microseconds.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

from tqserve.tools.bench import REPO_ROOT, add_blas_flag, load_blas, machine, make_prompts, Settings

DEFAULT_MODEL = "../shared/models/pycoder-29m"
WARMUP_TOKENS = 16
DEFAULT_OUT = Path("bench-out/bench_prefix.json")
SETTLE_S = 0.1  # idle time before each request (not timed)


async def _ttft(engine: Any, prompt: list[int], n: int = 2) -> dict[str, Any]:
    """One greedy request: TTFT, its tokens and where its reused prefix came from."""
    from tqserve.actors.messages import Done, Error, Token
    from tqserve.engine.request import GenerateRequest
    from tqserve.engine.sampling import SamplingParams

    import trio

    # The previous row is snapshotted (and spilled) by the steps after its Done: let them run.
    await trio.sleep(SETTLE_S)
    request = GenerateRequest(prompt_tokens=prompt,
                              params=SamplingParams(max_tokens=n, temperature=0.0))
    submit = time.perf_counter()
    first, tokens, done = None, [], None
    async for event in engine.generate(request):
        if isinstance(event, Token):
            first = first if first is not None else time.perf_counter() - submit
            tokens.append(event.token_id)
        elif isinstance(event, Done):
            done = event
        elif isinstance(event, Error):
            raise RuntimeError(f"request failed: {event.code}: {event.message}")
    assert first is not None and done is not None
    return {"ttft": first, "tokens": tokens, "cached": done.cached_tokens_by_tier}


def _snapshot_sizes(directory: Path) -> dict[str, Any]:
    from tqserve.storage import read_snapshot

    files = sorted(directory.glob("*.tqsnap"))
    if not files:
        raise RuntimeError(f"no snapshot file was written to {directory}")
    path = max(files, key=lambda p: p.stat().st_size)
    header, _ = read_snapshot(path)
    ram = sum(spec.raw_len for spec in header.planes)
    disk = path.stat().st_size
    return {"tokens": header.offset, "cache_kind": header.cache_kind, "ram_bytes": ram,
            "disk_bytes": disk, "zstd_ratio": ram / disk}


async def _measure(loaded: Any, prompt_tokens: int, repeats: int, workdir: Path) -> dict:
    import attrs

    from tqserve.actors.engine import open_engine
    from tqserve.engine.config import Config

    prompts = make_prompts(loaded.tokenizer, repeats + 1, prompt_tokens)
    warmup = make_prompts(loaded.tokenizer, 1, WARMUP_TOKENS, skip=(repeats + 2) * prompt_tokens)
    sizes_prompt, prompts = prompts[-1], prompts[:-1]
    no_eos = attrs.evolve(loaded, eos_token_ids=frozenset())
    base = dict(model=str(loaded.path), dtype=loaded.dtype, max_batch=1)
    runs: dict[str, list[dict[str, Any]]] = {"cold": [], "ram": [], "cold_spilling": [],
                                             "ssd": []}
    async with open_engine(Config(**base), loaded=no_eos) as engine:       # A
        await _ttft(engine, warmup[0])
        for prompt in prompts:
            runs["cold"].append(await _ttft(engine, prompt))
            runs["ram"].append(await _ttft(engine, prompt))
    ssd_dir = workdir / "ssd"
    spilling = Config(**base, ram_cache_bytes=1, cache_dir=str(ssd_dir), ssd_flush="sync")
    async with open_engine(spilling, loaded=no_eos) as engine:             # B
        await _ttft(engine, warmup[0])
        for prompt in prompts:
            runs["cold_spilling"].append(await _ttft(engine, prompt))
        await _ttft(engine, warmup[0])  # the steps after the last release: its spill lands
    async with open_engine(spilling, loaded=no_eos) as engine:             # C: a restart
        await _ttft(engine, warmup[0])
        for prompt in prompts:
            runs["ssd"].append(await _ttft(engine, prompt))
    sizes = {}
    schemes: list[tuple[str, dict[str, Any]]] = [("plain", {}),
                                                 ("turboquant_k4v4", {"turboquant": "k4v4"})]
    for name, kv in schemes:
        directory = workdir / f"sizes-{name}"
        config = Config(**base, ram_cache_bytes=1, cache_dir=str(directory), **kv)
        async with open_engine(config, loaded=no_eos) as engine:
            await _ttft(engine, sizes_prompt)
            await _ttft(engine, warmup[0])  # the steps after the release: the spill lands
        sizes[name] = _snapshot_sizes(directory)
    cold_tokens = [r["tokens"] for r in runs["cold"]]
    ttft: dict[str, Any] = {}
    for name, rows in runs.items():
        values = [r["ttft"] for r in rows]
        tier = {"ram": "ram", "ssd": "ssd"}.get(name)
        ttft[name] = {
            "median_s": statistics.median(values), "runs_s": values,
            "cached_tokens": [r["cached"].get(tier, 0) if tier else 0 for r in rows],
            "same_tokens_as_cold": [r["tokens"] for r in rows] == cold_tokens,
        }
    cold = ttft["cold"]["median_s"]
    for name in ("ram", "ssd"):
        ttft[name]["speedup_vs_cold"] = cold / ttft[name]["median_s"]
    return {"ttft": ttft, "snapshot_bytes": sizes}


INDEX_SUFFIX = 64


def run_index_bench(entries: int, prompt_tokens: int) -> dict[str, Any]:
    """Publish and lookup latency of the sans-io PrefixIndex with `entries` donors."""
    from tqserve.engine.prefix import PrefixEntry, PrefixIndex, Tier, cache_namespace

    namespace = cache_namespace("bench", "plain:float32")
    system = tuple(range(100_000, 100_000 + prompt_tokens))
    index = PrefixIndex(1 << 62)

    def donor(i: int) -> PrefixEntry:
        suffix = tuple(range(i * INDEX_SUFFIX, (i + 1) * INDEX_SUFFIX))
        return PrefixEntry(key=f"e{i}", namespace=namespace, tokens=system + suffix,
                           minimum_reusable_offset=0, trimmable=True, num_bytes=1)

    for i in range(entries):
        index.publish(donor(i), Tier.RAM, i)
    publish, lookup = [], []
    for i in range(entries, 2 * entries):
        entry = donor(i)
        start = time.perf_counter_ns()
        index.publish(entry, Tier.RAM, i)
        publish.append(time.perf_counter_ns() - start)
    for i in range(entries):
        prompt = donor((i * 7919) % (2 * entries)).tokens[:prompt_tokens + INDEX_SUFFIX // 2]
        start = time.perf_counter_ns()
        match = index.lookup(namespace, prompt + (1,), 3 * entries + i)
        lookup.append(time.perf_counter_ns() - start)
        if match is None or match.length != len(prompt):
            raise RuntimeError(f"lookup {i} found {match}")

    def summary(values: list[int]) -> dict[str, float]:
        ordered = sorted(values)
        return {"p50_us": ordered[len(ordered) // 2] / 1000,
                "p99_us": ordered[min(len(ordered) - 1, len(ordered) * 99 // 100)] / 1000,
                "max_us": ordered[-1] / 1000}

    return {
        "machine": {"platform": platform.platform(), "python": platform.python_version(),
                    "cpu_count": os.cpu_count()},
        "settings": {"entries": entries, "system_prompt_tokens": prompt_tokens,
                     "suffix_tokens": INDEX_SUFFIX, "operations": entries},
        "index": {"publish": summary(publish), "lookup": summary(lookup),
                  "entries_at_end": index.statistics().ram_entries},
    }


def format_index_table(report: dict[str, Any]) -> str:
    s = report["settings"]
    lines = [f"PrefixIndex: {s['entries']} entries under one {s['system_prompt_tokens']}-token "
             f"system prompt, {s['operations']} operations each",
             f"{'':<10}{'p50 us':>10}{'p99 us':>10}{'max us':>10}"]
    for name in ("publish", "lookup"):
        fig = report["index"][name]
        lines.append(f"{name:<10}{fig['p50_us']:>10.1f}{fig['p99_us']:>10.1f}"
                     f"{fig['max_us']:>10.1f}")
    return "\n".join(lines)


def run_bench(model: str, dtype: str, blas: str, prompt_tokens: int, repeats: int) -> dict:
    import trio

    from tqserve.engine.model import load_model

    in_repo = REPO_ROOT / model
    loaded = load_model(in_repo if in_repo.exists() else model, dtype)
    with tempfile.TemporaryDirectory(prefix="bench-prefix-") as workdir:
        figures = trio.run(_measure, loaded, prompt_tokens, repeats, Path(workdir))
    return {
        "machine": machine(Settings(model=model, dtype=dtype, blas=blas)),
        "model": {"name": loaded.path.name, "dtype": loaded.dtype,
                  "fingerprint": loaded.fingerprint},
        "settings": {"prompt_tokens": prompt_tokens, "repeats": repeats, "new_tokens": 2,
                     "greedy": True, "statistic": "median"},
        **figures,
    }


def format_table(report: dict[str, Any]) -> str:
    m, s, t = report["machine"], report["settings"], report["ttft"]
    lines = [f"{report['model']['name']}, {m['dtype']}, BLAS {m['blas']}, {m['cpu_count']} CPUs, "
             f"{s['prompt_tokens']}-token prompt, median of {s['repeats']}",
             f"{'TTFT':<30}{'ms':>10}{'cached':>8}{'x cold':>9}  same tokens"]
    labels = {"cold": "cold (miss)", "ram": "RAM hit", "ssd": "SSD hit after restart",
              "cold_spilling": "cold, spilling to SSD (sync)"}
    for key in ("cold", "ram", "ssd", "cold_spilling"):
        fig = t[key]
        speedup = f"{fig['speedup_vs_cold']:.1f}" if "speedup_vs_cold" in fig else "-"
        lines.append(f"{labels[key]:<30}{fig['median_s'] * 1000:>10.1f}"
                     f"{max(fig['cached_tokens']):>8}{speedup:>9}  {fig['same_tokens_as_cold']}")
    lines.append(f"{'snapshot':<18}{'tokens':>7}{'RAM bytes':>12}{'disk bytes':>12}{'zstd':>7}")
    for name, size in report["snapshot_bytes"].items():
        lines.append(f"{name:<18}{size['tokens']:>7}{size['ram_bytes']:>12}"
                     f"{size['disk_bytes']:>12}{size['zstd_ratio']:>7.2f}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tqserve bench prefix", description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL, help="model dir (relative to the repo)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                   help="model dtype")
    p.add_argument("--prompt-tokens", type=int, default=2048, help="tokens of the prompt")
    p.add_argument("--repeats", type=int, default=3, help="runs per figure (median)")
    add_blas_flag(p)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON results file")
    p.add_argument("--quick", action="store_true", help="64-token prompts, 1 repeat (smoke)")
    p.add_argument("--index", action="store_true",
                   help="benchmark the PrefixIndex alone (no model): publish/lookup p50/p99")
    p.add_argument("--entries", type=int, default=10_000, help="entries for --index")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.prompt_tokens < 2 or args.repeats < 1:
        parser.error("--prompt-tokens must be >= 2 and --repeats >= 1")
    if args.entries < 1:
        parser.error("--entries must be >= 1")
    if args.index:
        report = run_index_bench(args.entries, args.prompt_tokens)
        out = args.out if args.out != DEFAULT_OUT else DEFAULT_OUT.with_name("bench_index.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2) + "\n")
        print(format_index_table(report))
        print(f"wrote {out}")
        return 0
    if args.quick:
        args.prompt_tokens, args.repeats = 64, 1
    blas = load_blas(args.blas)
    report = run_bench(args.model, args.dtype, blas, args.prompt_tokens, args.repeats)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(format_table(report))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
