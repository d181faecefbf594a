"""One replay run on one target: the start checks, the replay, an interruption, the summary.

Start checks (printed to stderr before the first request is sent):
* context: requests whose prompt + max_tokens exceed the target's `max_model_len` (its
  /v1/stats `limits`, or /v1/models) are counted and warned about, or left out with
  --skip-over-context;
* load (open loop only, --no-load-check turns it off): the offered tokens/s as sent and
  with prefix reuse counted, against a measured capacity; the busiest BURST_WINDOW_S; and
  an estimate of the requests the server's queue bounds will refuse (tools/replay/load.py).

`Interrupt` is how a run ends early: a signal (SIGINT, SIGTERM) or --timeout cancels the
current phase. Cut short during the replay, the run still returns its summary, marked
`partial`, with the requests in flight as `interrupted` results.
"""

from __future__ import annotations

import argparse
import math
import sys
from contextlib import contextmanager
from typing import Any, Iterator, Sequence

import attrs
import trio

from tqserve.tools.replay.load import (BURST_WINDOW_S, estimate_rejections, offered_load,
                                       over_context, peak_window)
from tqserve.tools.replay.metrics import RequestResult, ideal_reuse, parse_goodput, summarize
from tqserve.tools.replay.run import RunBooks, measure_capacity, replay
from tqserve.tools.replay.traces import TraceRequest

STATS_TIMEOUT = 10.0  # seconds the closing /v1/stats may take after an interruption


class Interrupt:
    """Why the run stops early (`reason`, exit `code`) and the phase that it cancels."""

    def __init__(self) -> None:
        self.reason: str | None = None
        self.code = 0
        self._scope: trio.CancelScope | None = None

    def stop(self, reason: str, code: int) -> None:
        """The first call wins; it cancels the phase running now (or the next one)."""
        if self.reason is None:
            self.reason, self.code = reason, code
        if self._scope is not None:
            self._scope.cancel()

    def watch(self, scope: trio.CancelScope | None) -> None:
        """From now on a stop cancels `scope` (None: nothing)."""
        self._scope = scope
        if scope is not None and self.reason is not None:
            scope.cancel()

    @contextmanager
    def phase(self) -> Iterator[None]:
        """A stretch of work that a stop cancels (opened and closed in one frame)."""
        scope = trio.CancelScope()
        self.watch(scope)
        try:
            with scope:
                yield
        finally:
            self.watch(None)


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def check_context(reqs: list[TraceRequest], limits: dict[str, int], skip: bool,
                  name: str) -> list[TraceRequest]:
    """Warn about (or leave out, with `skip`) requests over the target's context."""
    n = limits.get("max_model_len")
    if n is None:
        say(f"context check: {name} reports no max_model_len; prompts are not checked")
        return reqs
    over = over_context(reqs, n)
    if not over:
        return reqs
    if skip:
        say(f"context check: left out {len(over)} of {len(reqs)} requests whose prompt + "
            f"max_tokens exceed the context of {n} tokens (--skip-over-context)")
        cut = {r.index for r in over}
        return [r for r in reqs if r.index not in cut]
    say(f"WARNING: {len(over)} of {len(reqs)} requests have prompt + max_tokens over the "
        f"target's context of {n} tokens: it will refuse them (invalid_request); "
        "--skip-over-context leaves them out")
    return reqs


async def load_check(target: Any, reqs: Sequence[TraceRequest], limits: dict[str, int],
                     time_scale: float, vocab_size: int) -> dict[str, Any]:
    """Print the offered load, the busiest window and the estimated rejections."""
    load = offered_load(reqs, time_scale)
    capacity = await measure_capacity(target, vocab_size)
    peak = peak_window(reqs, time_scale)
    reused = 1 - load["work_tokens"] / load["tokens"] if load["tokens"] else 0.0
    say(f"load check: trace offers {load['tokens_per_s']:.0f} tok/s (prompt + max output) "
        f"over {load['span_s']:.3g} s, {load['work_per_s']:.0f} tok/s with prefix reuse "
        f"counted ({reused:.0%} of its tokens repeat an earlier prompt); {target.name} "
        f"measured ~{capacity:.0f} tok/s")
    say(f"load check: busiest {BURST_WINDOW_S:g} s: {peak['requests']} requests, "
        f"{peak['work_tokens']:.0f} tokens of work from {peak['start_s']:.3g} s (the target "
        f"does ~{capacity * BURST_WINDOW_S:.0f} in that time)")
    bounds = {k: limits.get(k) for k in ("max_batch", "max_queued_requests",
                                         "max_queued_tokens")}
    out: dict[str, Any] = {**load, "capacity_tokens_per_s": capacity, "peak": peak}
    if all(bounds.values()):
        out["estimated_rejections"] = n = estimate_rejections(
            reqs, time_scale, capacity=capacity, **bounds)  # type: ignore[arg-type]
        if n:
            say(f"WARNING: bursts: an estimated {n} of {len(reqs)} requests will be refused "
                f"(overloaded): the queue (max {bounds['max_queued_requests']} requests, "
                f"{bounds['max_queued_tokens']} prompt tokens, behind "
                f"{bounds['max_batch']} running) fills in the bursts")
    else:
        say(f"load check: {target.name} reports no queue bounds (a router?): bursts are "
            "compared with throughput only")
        if peak["work_tokens"] > capacity * BURST_WINDOW_S:
            say("WARNING: bursts: the busiest window asks for "
                f"{peak['work_tokens'] / (capacity * BURST_WINDOW_S):.1f}x the measured "
                "capacity; queues will grow and may refuse requests")
    if load["work_per_s"] > capacity:
        say(f"WARNING: overload run: {load['work_per_s'] / capacity:.1f}x the measured "
            "capacity (reuse counted); queues will grow and TTFT will measure them")
    return out


def _progress(total: int, desc: str, off: bool) -> Any:
    if off:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="req", file=sys.stderr)


async def run_one(args: argparse.Namespace, target: Any, reqs: list[TraceRequest], tag: str,
                  interrupt: Interrupt, min_hit_tokens: int
                  ) -> tuple[dict[str, Any], list[RequestResult]] | None:
    """Start `target`, check, replay, stop; None when interrupted before the replay."""
    startup = trio.CancelScope()  # a stop before the replay cancels the whole run
    extra: dict[str, Any] = {}
    interrupt.watch(startup)
    with startup:
        async with target:
            limits = await target.limits()
            extra["stats_at_start"] = await target.stats()  # before the probe's entries
            sent = check_context(reqs, limits, args.skip_over_context, target.name)
            if not args.no_load_check and args.concurrency is None and sent:
                extra["load_check"] = await load_check(target, sent, limits,
                                                       args.time_scale, args.vocab_size)
            before = await target.stats()
            interrupt.watch(None)
            books, now = await _replay(args, target, sent, tag, interrupt)
            cut = books.cut_off(now, interrupt.reason) if interrupt.reason else []
            results = sorted(books.results + cut, key=lambda r: r.index)
            with trio.CancelScope(shield=True), trio.move_on_after(STATS_TIMEOUT):
                extra["after"] = await target.stats()
    interrupt.watch(None)
    if startup.cancelled_caught:
        return None
    results = [attrs.evolve(r, min_hit_tokens=min_hit_tokens) for r in results]
    summary = _summary(args, sent, results, before, extra.pop("after", None), target.name)
    summary.update(extra, skipped_over_context=len(reqs) - len(sent),
                   warm_entries=_warm_entries(extra.get("stats_at_start")))
    if interrupt.reason is not None:
        summary["partial"] = {"reason": interrupt.reason, "at_s": now,
                              "ended": len(books.results), "cut_off": len(cut),
                              "not_sent": len(sent) - len(results)}
    return summary, results


async def _replay(args: argparse.Namespace, target: Any, sent: list[TraceRequest], tag: str,
                  interrupt: Interrupt) -> tuple[RunBooks, float]:
    """The replay phase: what it measured, and when it ended (seconds since it began)."""
    books = RunBooks()
    bar = _progress(len(sent), f"{tag} {target.name}", args.no_progress)
    t0 = trio.current_time()
    try:
        with interrupt.phase():
            with trio.move_on_after(args.timeout or math.inf) as timer:
                await replay(target, sent, time_scale=args.time_scale,
                             concurrency=args.concurrency, restart_at=args.restart_at,
                             on_done=lambda r: bar.update(1) if bar else None,
                             books=books, t0=t0)
            if timer.cancelled_caught:
                interrupt.stop(f"--timeout {args.timeout:g} s", 124)
    finally:
        if bar:
            bar.close()
    return books, trio.current_time() - t0


def _summary(args: argparse.Namespace, reqs: Sequence[TraceRequest],
             results: Sequence[RequestResult], before: Any, after: Any,
             name: str) -> dict[str, Any]:
    summary = summarize(results, goodput=parse_goodput(args.goodput or ()))
    sent = {r.index: r for r in results}
    prompts = [q for q in reqs if q.index in sent]
    done = [q for q in prompts if sent[q.index].ok]  # as the achieved fraction counts
    summary["reuse"] = ideal_reuse([q.prompt_tokens for q in done],
                                   [sent[q.index].send_s for q in done],
                                   [sent[q.index].done_s for q in done])
    summary["trace"] = {"requests": len(reqs),
                        "tokens_sent": sum(len(q.prompt_tokens) for q in prompts),
                        "tokens_implied": sum(q.implied_input_tokens for q in prompts)}
    summary["stats_before"], summary["stats_after"] = before, after
    summary["target"] = name
    summary["restarted"] = args.restart_at is not None and args.restart_at < len(reqs)
    return summary


def _warm_entries(stats: dict[str, Any] | None) -> int:
    """Prefix-cache entries the target held when the run began (earlier runs' prompts)."""
    prefix = (stats or {}).get("prefix_cache") or {}
    return int(prefix.get("ram_entries", 0) + prefix.get("ssd_entries", 0))
