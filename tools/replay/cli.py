"""`tqserve replay TRACE`: replay a trace against a server or an embedded engine.

    tqserve replay ../shared/traces/mooncake_conversation_trace.jsonl --model models/pycoder-draft-4m \\
        --block-tokens 16 --max-requests 200 --time-scale 0.05 --max-output 32 --out replay-out

Targets: --url ws://host:port/v1/stream (a running server), --model PATH (an engine
embedded in this process) or --spawn (a `tqserve serve` child; with --model as its
model). Engine flags (--dtype, --turboquant, --cache-dir, ...) apply to --model/--spawn.
--verify compares a recording's outputs token by token; --ab-url / --ab-config runs the
same requests a second time on another server or config and prints B/A ratios.
Bad arguments print one line and exit with code 2.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any, NoReturn, Sequence

import trio

from tqserve.tools.replay import report
from tqserve.tools.replay.metrics import ideal_reuse, parse_goodput, summarize
from tqserve.tools.replay.recording import FORMAT, read_recording
from tqserve.tools.replay.run import measure_capacity, offered_load, replay
from tqserve.tools.replay.targets import EngineTarget, SpawnTarget, UrlTarget
from tqserve.tools.replay.traces import (TraceRequest, corpus_tokens, default_corpus_paths,
                                 from_recording, load_azure, load_mooncake, subsample_families)

DEFAULT_MODEL = str(Path(__file__).resolve().parents[2] / "models" / "pycoder-draft-4m")
_ENGINE_FLAGS = (("dtype", str), ("turboquant", str), ("cache_dir", str), ("max_batch", int),
                 ("prefill_chunk", int), ("ram_cache_bytes", int), ("quantized_kv_start", int),
                 ("max_queued_requests", int), ("max_queued_tokens", int))


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="tqserve replay", description=__doc__.split("\n\n")[0])
    p.add_argument("trace", help="Mooncake .jsonl, Azure .csv, or a tqserve recording")
    p.add_argument("--format", choices=("auto", "mooncake", "azure", "recording"),
                   default="auto")
    t = p.add_argument_group("target")
    t.add_argument("--url", help="WebSocket URL of a running server")
    t.add_argument("--model", help="embedded engine on this model (or the --spawn model)")
    t.add_argument("--spawn", action="store_true", help="spawn `tqserve serve` and replay on it")
    t.add_argument("--api-key", help="bearer token for --url")
    t.add_argument("--frames", choices=("msgpack", "json"), default="msgpack")
    t.add_argument("--streams-per-connection", type=int, default=16,
                   help="requests per WebSocket (<= the server's --max-streams-per-connection)")
    for name, kind in _ENGINE_FLAGS:
        t.add_argument("--" + name.replace("_", "-"), type=kind, default=None)
    t.add_argument("--no-prefix-cache", action="store_true")
    s = p.add_argument_group("requests")
    s.add_argument("--block-tokens", type=int, default=512,
                   help="tokens per Mooncake hash block (512 = the trace's own size)")
    s.add_argument("--length-scale", type=float, default=1.0, help="Azure prompt length scale")
    s.add_argument("--vocab-size", type=int, default=8192, help="ids of Mooncake block tokens")
    s.add_argument("--tokenizer", default=None, help="model dir whose tokenizer builds the "
                   "Azure corpus (default: --model or the bundled model)")
    s.add_argument("--corpus", nargs="*", default=None, help="text files for Azure prompts "
                   "(default: the installed mlx-lm's Python sources)")
    s.add_argument("--start", type=int, default=0, help="skip this many trace requests")
    s.add_argument("--max-requests", type=int, default=None)
    s.add_argument("--family-fraction", type=float, default=None,
                   help="keep this fraction of prefix families (whole families)")
    s.add_argument("--max-output", type=int, default=None, help="cap on each max_tokens")
    s.add_argument("--temperature", type=float, default=None)
    s.add_argument("--seed", type=int, default=None)
    r = p.add_argument_group("run")
    r.add_argument("--time-scale", type=float, default=1.0,
                   help="multiply trace arrival times (0.1 = ten times faster)")
    r.add_argument("--concurrency", type=int, default=None,
                   help="closed loop with this many requests in flight (ignores arrivals)")
    r.add_argument("--restart-at", type=int, default=None,
                   help="restart the --model/--spawn server after this many requests")
    r.add_argument("--verify", action="store_true",
                   help="compare outputs with the recording's, token by token")
    r.add_argument("--ab-url", help="B: a second server, same requests")
    r.add_argument("--ab-config", nargs="*", default=None, metavar="FLAG=VALUE",
                   help="B: the same --model/--spawn with these engine flags changed")
    r.add_argument("--goodput", nargs="*", default=None, metavar="METRIC:MS")
    r.add_argument("--no-load-check", action="store_true")
    r.add_argument("--out", default=None, help="directory for JSON, JSONL, plots")
    r.add_argument("--no-plots", action="store_true")
    r.add_argument("--no-progress", action="store_true")
    r.add_argument("--bin-s", type=float, default=None, help="time-series bin (seconds)")
    return p


def _detect(path: str, fmt: str) -> str:
    if fmt != "auto":
        return fmt
    with open(path, "rb") as f:
        head = f.read(64)
    if head.startswith(b"\x28\xb5\x2f\xfd"):  # zstd magic
        return "recording"
    if head.lstrip().startswith(b"{"):
        return "mooncake"
    return "azure"


def load_requests(args: argparse.Namespace) -> tuple[list[TraceRequest], dict[str, Any]]:
    """The trace's requests after --start/--max-requests/--family-fraction, plus header."""
    fmt = _detect(args.trace, args.format)
    header: dict[str, Any] = {"format": fmt}
    if fmt == "mooncake":
        reqs = load_mooncake(args.trace, block_tokens=args.block_tokens,
                             vocab_size=args.vocab_size, max_output=args.max_output)
    elif fmt == "azure":
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(args.tokenizer or args.model or DEFAULT_MODEL)
        paths = [Path(c) for c in args.corpus] if args.corpus else default_corpus_paths()
        reqs = load_azure(args.trace, corpus=corpus_tokens(tok, paths),
                          length_scale=args.length_scale, max_output=args.max_output)
    else:
        rec_header, records = read_recording(args.trace)
        header.update(recording=rec_header)
        reqs = from_recording(records)
    if args.family_fraction is not None:
        reqs = subsample_families(reqs, args.family_fraction)
    reqs = reqs[args.start:]
    if args.max_requests is not None:
        reqs = reqs[:args.max_requests]
    if args.temperature is not None or args.seed is not None:
        extra = {k: v for k, v in (("temperature", args.temperature), ("seed", args.seed))
                 if v is not None}
        reqs = [TraceRequest(**{**_fields(r), "params": {**r.params, **extra}}) for r in reqs]
    if not reqs:
        raise ValueError(f"{args.trace}: no requests left to replay")
    return reqs, header


def _fields(r: TraceRequest) -> dict[str, Any]:
    import attrs

    return attrs.asdict(r, recurse=False)


def _engine_config(args: argparse.Namespace, overrides: dict[str, str]) -> Any:
    from tqserve.engine.config import Config

    fields: dict[str, Any] = {"model": args.model or DEFAULT_MODEL}
    for name, kind in _ENGINE_FLAGS:
        if getattr(args, name) is not None:
            fields[name] = getattr(args, name)
    if args.no_prefix_cache:
        fields["prefix_cache"] = False
    for key, value in overrides.items():
        kinds = dict(_ENGINE_FLAGS)
        if key == "prefix_cache":
            fields[key] = value.lower() in ("1", "true", "yes", "on")
        elif key in kinds:
            fields[key] = kinds[key](value)
        else:
            raise ValueError(f"--ab-config: unknown engine flag {key!r}")
    return Config(**fields)


def _serve_args(config: Any) -> list[str]:
    import attrs

    from tqserve.engine.config import Config

    out = []
    defaults = Config()
    for f in attrs.fields(Config):
        value = getattr(config, f.name)
        if f.name in ("host", "port") or value == getattr(defaults, f.name):
            continue
        if f.name == "prefix_cache":
            out.append("--no-prefix-cache")
        else:
            out += ["--" + f.name.replace("_", "-"), str(value)]
    return out


def _overrides(items: Sequence[str] | None) -> dict[str, str]:
    out = {}
    for item in items or ():
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--ab-config: {item!r} is not FLAG=VALUE")
        out[key.lstrip("-").replace("-", "_")] = value
    return out


def _target(args: argparse.Namespace, url: str | None, overrides: dict[str, str]) -> Any:
    binary = args.frames == "msgpack"
    if url is not None:
        return UrlTarget(url, streams_per_connection=args.streams_per_connection,
                         binary=binary, api_key=args.api_key)
    config = _engine_config(args, overrides)
    if args.spawn:
        return SpawnTarget(_serve_args(config), binary=binary,
                           streams_per_connection=args.streams_per_connection)
    return EngineTarget(config)


async def _run_one(args: argparse.Namespace, target: Any, reqs: list[TraceRequest],
                   tag: str) -> tuple[dict[str, Any], list]:
    async with target:
        if not args.no_load_check:
            if args.concurrency is None:
                load = offered_load(reqs, args.time_scale)
                capacity = await measure_capacity(target, args.vocab_size)
                print(f"load check: trace offers {load['tokens_per_s']:.0f} tok/s (prompt + "
                      f"max output) over {load['span_s']:.1f} s; {target.name} measured "
                      f"~{capacity:.0f} tok/s", file=sys.stderr)
                if load["tokens_per_s"] > capacity:
                    print(f"WARNING: overload run: {load['tokens_per_s'] / capacity:.1f}x the "
                          "measured capacity; queues will grow and TTFT will measure them",
                          file=sys.stderr)
        before = await target.stats()
        bar = _progress(len(reqs), f"{tag} {target.name}", args.no_progress)
        results = await replay(target, reqs, time_scale=args.time_scale,
                               concurrency=args.concurrency, restart_at=args.restart_at,
                               on_done=lambda r: bar.update(1) if bar else None)
        if bar:
            bar.close()
        after = await target.stats()
    summary = summarize(results, goodput=parse_goodput(args.goodput or ()))
    by_index = {r.index: r for r in results}
    summary["reuse"] = ideal_reuse([r.prompt_tokens for r in reqs],
                                   [by_index[r.index].send_s for r in reqs],
                                   [by_index[r.index].done_s for r in reqs])
    summary["trace"] = {"requests": len(reqs),
                        "tokens_sent": sum(len(r.prompt_tokens) for r in reqs),
                        "tokens_implied": sum(r.implied_input_tokens for r in reqs)}
    summary["stats_before"], summary["stats_after"] = before, after
    summary["target"] = target.name
    summary["restarted"] = args.restart_at is not None and args.restart_at < len(reqs)
    return summary, results


def _progress(total: int, desc: str, off: bool) -> Any:
    if off:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="req", file=sys.stderr)


def _check_totals(summary: dict[str, Any]) -> None:
    trace = summary["trace"]
    sent, implied = trace["tokens_sent"], trace["tokens_implied"]
    if implied and abs(sent - implied) > max(0.01 * implied, len(str(trace["requests"]))):
        print(f"WARNING: sent {sent} input tokens but the trace implies {implied:.0f} at this "
              "scale: prompts are the wrong length (a block-size mismatch?)", file=sys.stderr)


async def _main(args: argparse.Namespace) -> int:
    reqs, header = load_requests(args)
    overrides = _overrides(args.ab_config)
    runs = [("A", _target(args, args.url, {}))]
    if args.ab_url or args.ab_config is not None:
        runs.append(("B", _target(args, args.ab_url, overrides)))
    out = Path(args.out) if args.out else None
    summaries = []
    status = 0
    for tag, target in runs:
        summary, results = await _run_one(args, target, reqs, tag)
        summary["trace"]["format"] = header["format"]
        _check_totals(summary)
        if args.verify or tag == "B":
            div_dir = out / f"divergences-{tag}" if out else None
            if tag == "B":
                a_results = summaries[0][1]
                reqs_b = [TraceRequest(**{**_fields(q), "expected_tokens": a.output_tokens,
                                          "expected_finish": a.finish_reason})
                          for q, a in zip(reqs, a_results) if a.ok]
                summary["compare_with_A"] = report.compare_outputs(reqs_b, results, div_dir)
            else:
                summary["verify"] = report.compare_outputs(reqs, results, div_dir)
                status = 1 if summary["verify"]["divergent"] else 0
        summaries.append((summary, results))
        print(f"============ {tag}: {target.name} ============")
        print(report.summary_table(summary))
        for key in ("verify", "compare_with_A"):
            if key in summary:
                print(f"{key}: {summary[key]}")
        if out is not None:
            bin_s = args.bin_s or max(summary["duration_s"] / 60, 0.05)
            report.write_outputs(out / tag, summary, results, plots=not args.no_plots,
                                 bin_s=bin_s)
    if len(summaries) == 2:
        print(report.ratio_table(summaries[0][0], summaries[1][0],
                                 (summaries[0][0]["target"], summaries[1][0]["target"])))
    return status


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if sum(x is not None and x is not False for x in (args.url, args.spawn or None)) > 1:
            raise ValueError("give one of --url or --spawn")
        if args.url and args.restart_at is not None:
            raise ValueError("--restart-at needs a server this tool owns (--model or --spawn)")
        if args.concurrency is not None and args.concurrency < 1:
            raise ValueError("--concurrency must be >= 1")
        if not args.time_scale > 0 or math.isinf(args.time_scale):
            raise ValueError("--time-scale must be a positive number")
        if args.verify and _detect(args.trace, args.format) != "recording":
            raise ValueError(f"--verify needs a {FORMAT} file")
        return trio.run(_main, args)
    except (ValueError, OSError) as exc:
        print(f"tqserve replay: error: {exc}", file=sys.stderr)
        return 2
    except BaseExceptionGroup as group:
        leaves = list(group.exceptions)
        while leaves and isinstance(leaves[0], BaseExceptionGroup):
            leaves = list(leaves[0].exceptions)
        if leaves and isinstance(leaves[0], (ValueError, OSError)):
            print(f"tqserve replay: error: {leaves[0]}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    raise SystemExit(main())
