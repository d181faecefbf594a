"""`tqserve replay TRACE`: replay a trace against a server or an embedded engine.

    tqserve replay ../shared/traces/mooncake_conversation_trace.jsonl --model models/pycoder-draft-4m \\
        --block-tokens 16 --max-requests 200 --time-scale 0.05 --max-output 32 --out replay-out

Targets: --url ws://host:port/v1/stream (a running server), --model PATH (an engine
embedded in this process) or --spawn (a `tqserve serve` child; with --model as its
model). Engine flags (--dtype, --turboquant, --cache-dir, ...) apply to --model/--spawn.
--verify compares a recording's outputs token by token; --ab-url / --ab-config runs the
same requests a second time on another server or config and prints B/A ratios.
Exit codes: 0 every request completed (and, with --verify, matched); 1 outputs diverged;
2 bad arguments (one line); 3 some requests failed (their errors are in the table and
requests.jsonl); 124 --timeout cut the run short; 130 SIGINT (Ctrl-C) and 143 SIGTERM.
An interrupted run still writes what it measured, marked partial.
"""

from __future__ import annotations

import argparse
import math
import signal
import sys
from pathlib import Path
from typing import Any, NoReturn, Sequence

import trio

from tqserve.api.signals import SIGNALS, SignalLatch
from tqserve.tools.replay import report
from tqserve.tools.replay.metrics import HIT_MIN_TOKENS
from tqserve.storage.recording import FORMAT, read_recording
from tqserve.tools.replay.session import Interrupt, run_one, say
from tqserve.tools.replay.targets import EngineTarget, SpawnTarget, UrlTarget
from tqserve.tools.replay.traces import (TraceRequest, corpus_tokens, default_corpus_paths,
                                 from_recording, load_azure, load_mooncake, subsample_families)

EXIT_FAILED = 3  # some requests failed
DEFAULT_MODEL = str(Path(__file__).resolve().parents[2] / "models" / "pycoder-draft-4m")
_ENGINE_FLAGS = (("dtype", str), ("turboquant", str), ("cache_dir", str), ("max_batch", int),
                 ("prefill_chunk", int), ("ram_cache_bytes", int), ("quantized_kv_start", int),
                 ("max_queued_requests", int), ("max_queued_tokens", int),
                 ("speculative", str), ("draft_model", str))


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
    r.add_argument("--skip-over-context", action="store_true",
                   help="leave out requests whose prompt + max_tokens exceed the context")
    r.add_argument("--timeout", type=float, default=None, metavar="S",
                   help="stop the replay after S seconds; writes the partial results")
    r.add_argument("--min-hit-tokens", type=int, default=None,
                   help=f"cached tokens a cache hit needs (default {HIT_MIN_TOKENS}, or one "
                        "Mooncake block where that is smaller)")
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
    for name, _ in _ENGINE_FLAGS:
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

    from tqserve.api import kvflag, specflag
    from tqserve.engine.config import Config

    out = []
    defaults = Config()
    changed = {f.name: getattr(config, f.name) for f in attrs.fields(Config)
               if getattr(config, f.name) != getattr(defaults, f.name)}
    kv = {n: getattr(config, n) for n in kvflag.FIELDS}
    spec = {n: changed.pop(n) for n in specflag.OLD_FLAGS if n in changed}
    for name, value in changed.items():
        if name == "prefix_cache":
            out.append("--no-prefix-cache")
        elif name not in kvflag.FIELDS:
            out += ["--" + name.replace("_", "-"), str(value)]
    if kvflag.spelling(kv) != "plain":
        out += ["--kv", kvflag.spelling(kv)]
    if spec:
        out += ["--speculative-config", specflag.spelling(spec)]
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


def _check_totals(summary: dict[str, Any]) -> None:
    trace = summary["trace"]
    sent, implied = trace["tokens_sent"], trace["tokens_implied"]
    if implied and abs(sent - implied) > max(0.01 * implied, len(str(trace["requests"]))):
        print(f"WARNING: sent {sent} input tokens but the trace implies {implied:.0f} at this "
              "scale: prompts are the wrong length (a block-size mismatch?)", file=sys.stderr)


def _compare(args: argparse.Namespace, tag: str, summary: dict[str, Any], results: list,
             reqs: list[TraceRequest], summaries: list, out: Path | None) -> int:
    """--verify (A against the recording) or B against A; 1 where --verify diverged."""
    if not (args.verify or tag == "B"):
        return 0
    div_dir = out / f"divergences-{tag}" if out else None
    if tag == "B":
        a_ok = {a.index: a for a in summaries[0][1] if a.ok}
        reqs_b = [TraceRequest(**{**_fields(q), "expected_tokens": a_ok[q.index].output_tokens,
                                  "expected_finish": a_ok[q.index].finish_reason})
                  for q in reqs if q.index in a_ok]
        summary["compare_with_A"] = report.compare_outputs(reqs_b, results, div_dir)
        return 0
    summary["verify"] = report.compare_outputs(reqs, results, div_dir)
    return 1 if summary["verify"]["divergent"] else 0


def _min_hit_tokens(args: argparse.Namespace, fmt: str) -> int:
    if args.min_hit_tokens is not None:
        return args.min_hit_tokens
    return min(args.block_tokens, HIT_MIN_TOKENS) if fmt == "mooncake" else HIT_MIN_TOKENS


async def _runs(args: argparse.Namespace, interrupt: Interrupt) -> int:
    reqs, header = load_requests(args)
    overrides = _overrides(args.ab_config)
    runs = [("A", _target(args, args.url, {}))]
    if args.ab_url or args.ab_config is not None:
        runs.append(("B", _target(args, args.ab_url, overrides)))
    out = Path(args.out) if args.out else None
    plots = out is not None and not args.no_plots
    if plots and (line := report.plots_available()) is not None:
        say(line)
        plots = False
    summaries = []
    status = 0
    for tag, target in runs:
        run = await run_one(args, target, reqs, tag, interrupt,
                            _min_hit_tokens(args, header["format"]))
        if run is None:
            say(f"tqserve replay: interrupted by {interrupt.reason} before {tag}'s replay "
                "began: nothing measured on it")
            return interrupt.code
        summary, results = run
        summary["trace"]["format"] = header["format"]
        _check_totals(summary)
        status = max(status, _compare(args, tag, summary, results, reqs, summaries, out))
        summaries.append((summary, results))
        mark = f" (PARTIAL: {interrupt.reason})" if interrupt.reason else ""
        print(f"============ {tag}: {target.name}{mark} ============")
        print(report.summary_table(summary), flush=True)
        for key in ("verify", "compare_with_A"):
            if key in summary:
                print(f"{key}: {summary[key]}")
        if out is not None:
            bin_s = args.bin_s or max(summary["duration_s"] / 60, 0.05)
            report.write_outputs(out / tag, summary, results, plots=plots, bin_s=bin_s)
        if interrupt.reason is not None:
            p = summary["partial"]
            where = f"partial results in {out / tag}" if out else "no --out: the table is all"
            say(f"tqserve replay: interrupted by {interrupt.reason} after {p['ended']} of "
                f"{summary['trace']['requests']} requests ended ({p['cut_off']} cut off in "
                f"flight, {p['not_sent']} not sent); {where}")
            return interrupt.code
        if summary["failed"]:
            codes = ", ".join(f"{k} {v}" for k, v in summary["errors"].items())
            say(f"tqserve replay: {summary['failed']} of {len(results)} requests failed on "
                f"{tag} ({codes}): see the errors in the table and requests.jsonl")
            status = max(status, EXIT_FAILED)
    if len(summaries) == 2:
        print(report.ratio_table(summaries[0][0], summaries[1][0],
                                 (summaries[0][0]["target"], summaries[1][0]["target"])))
    return status


async def _main(args: argparse.Namespace, latch: SignalLatch) -> int:
    """The runs, with SIGINT and SIGTERM taken by trio: each stops the run (Interrupt)."""
    interrupt = Interrupt()
    with trio.open_signal_receiver(*SIGNALS) as signals:
        if latch.signum is not None:  # came before trio ran
            interrupt.stop(latch.name, 128 + latch.signum)

        async def watch() -> None:
            async for signum in signals:
                latch.note(signum)
                interrupt.stop(signal.Signals(signum).name, 128 + signum)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch)
            status = await _runs(args, interrupt)
            nursery.cancel_scope.cancel()
    return status


def main(argv: Sequence[str] | None = None) -> int:
    with SignalLatch() as latch:  # a Ctrl-C before trio runs is noted, never a traceback
        return _checked_main(argv, latch)


def _checked_main(argv: Sequence[str] | None, latch: SignalLatch) -> int:
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
        if args.timeout is not None and not args.timeout > 0:
            raise ValueError("--timeout must be a positive number of seconds")
        if args.min_hit_tokens is not None and args.min_hit_tokens < 1:
            raise ValueError("--min-hit-tokens must be >= 1")
        if args.verify and _detect(args.trace, args.format) != "recording":
            raise ValueError(f"--verify needs a {FORMAT} file")
        return trio.run(_main, args, latch)
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
