"""Replay output: the summary table, JSON, per-request JSONL, PNG plots, divergences."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Sequence

from tqserve.tools.replay.metrics import OUTCOMES, RequestResult, time_series
from tqserve.tools.replay.run import expected_fields
from tqserve.tools.replay.traces import TraceRequest

_ROWS = (("completed", "Successful requests", "{:d}"), ("failed", "Failed requests", "{:d}"),
         ("duration_s", "Benchmark duration (s)", "{:.2f}"),
         ("total_input_tokens", "Total input tokens", "{:d}"),
         ("total_output_tokens", "Total generated tokens", "{:d}"),
         ("request_throughput", "Request throughput (req/s)", "{:.2f}"),
         ("request_goodput", "Request goodput (req/s)", "{:.2f}"),
         ("output_throughput", "Output token throughput (tok/s)", "{:.1f}"),
         ("total_token_throughput", "Total token throughput (tok/s)", "{:.1f}"))


def summary_table(summary: dict[str, Any]) -> str:
    """vLLM-style text table of a summary, with the reuse and cache-outcome figures."""
    lines = []
    partial = summary.get("partial")
    if partial:
        lines.append(f"PARTIAL RUN: interrupted by {partial['reason']} at "
                     f"{partial['at_s']:.1f} s: {partial['ended']} requests ended, "
                     f"{partial['cut_off']} cut off in flight, {partial['not_sent']} not sent")
    for key, label, fmt in _ROWS:
        if key in summary:
            lines.append(f"{label:<40}{fmt.format(summary[key]):>14}")
    for m, label in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2EL")):
        for stat in ("mean", "median", "p99"):
            lines.append(f"{stat.capitalize() + ' ' + label + ' (ms)':<40}"
                         f"{summary[f'{stat}_{m}_ms']:>14.2f}")
    trace = summary.get("trace", {})
    if trace:
        lines.append(f"{'Input tokens sent / trace implies':<40}"
                     f"{trace['tokens_sent']:>7d} / {trace['tokens_implied']:.0f}")
    spec = summary.get("speculative")
    if spec:
        lines.append(f"{'Speculative: accepted / proposed':<40}"
                     f"{spec['accepted']:>7d} / {spec['proposed']} ({spec['acceptance_rate']:.2f})")
    lines += _reuse_lines(summary)
    lines += _outcome_lines(summary)
    lines += _stats_lines(summary)
    lines += _error_lines(summary)
    return "\n".join(lines)


def _reuse_lines(summary: dict[str, Any]) -> list[str]:
    reuse = summary.get("reuse", {})
    if not reuse:
        return []
    lines = [f"{'Reusable fraction: achieved':<40}{summary['achieved_reuse_fraction']:>14.3f}",
             f"{'  ideal, donor finished before send':<40}"
             f"{reuse['ideal_reuse_donor_finished']:>14.3f}",
             f"{'  ideal, infinite cache':<40}{reuse['ideal_reuse_infinite']:>14.3f}"]
    warm = summary.get("warm_entries", 0)
    if warm or summary["achieved_reuse_fraction"] > reuse["ideal_reuse_infinite"] + 1e-9:
        held = f"held {warm} entries" if warm else "held prefixes"
        lines.append(f"  (ideals count this run's prompts only: the target's cache {held} "
                     "before it, so achieved can exceed them)")
    return lines


def _outcome_lines(summary: dict[str, Any]) -> list[str]:
    lines = [f"{'cache outcome':<14}{'requests':>10}{'cached/prompt':>16}"
             f"{'mean TTFT':>12}{'p99 TTFT':>12}"]
    for outcome in OUTCOMES:
        row = summary["by_outcome"][outcome]
        frac = row["cached_tokens"] / row["prompt_tokens"] if row["prompt_tokens"] else 0.0
        lines.append(f"{outcome:<14}{row['requests']:>10d}{frac:>16.3f}"
                     f"{row['mean_ttft_ms']:>10.1f}ms{row['p99_ttft_ms']:>10.1f}ms")
    n = summary.get("min_hit_tokens", 1)
    lines.append(f"(a hit reuses >= {n} prompt tokens; "
                 f"{summary.get('chance_matches', 0)} requests with 1-{max(n - 1, 1)} cached "
                 "tokens count as misses)" if n > 1 else "(a hit reuses >= 1 prompt token)")
    return lines


def _delta(after: dict[str, Any], before: dict[str, Any], key: str) -> int | None:
    a, b = after.get(key), before.get(key)
    if isinstance(a, dict) and isinstance(b, dict):
        return sum(a.values()) - sum(b.values())
    return a - b if isinstance(a, int) and isinstance(b, int) else None


def _stats_lines(summary: dict[str, Any]) -> list[str]:
    """The target's own counters over the run: a server's /v1/stats, or a router's."""
    before, after = summary.get("stats_before"), summary.get("stats_after")
    if not (before and after):
        return [f"target stats: none ({summary.get('target', 'the target')} answered no "
                "/v1/stats)"]
    lines = []
    if summary.get("restarted"):  # counters began again at the restart
        before = {k: (0 if isinstance(v, int) else {kk: 0 for kk in v} if isinstance(v, dict)
                      else v) for k, v in after.items()}
        lines.append("(the server restarted: its counters below are since the restart)")
    if "backends" in after:  # a `tqserve route` router
        routed = {url: _delta(after["backends"][url], before.get("backends", {}).get(url, {}),
                              "num_routed") for url in after["backends"]}
        cached = _delta(after, before, "cached_tokens")
        prompt = _delta(after, before, "prompt_tokens")
        lines.append(f"router /v1/stats after - before: policy {after.get('policy')}, routed "
                     + ", ".join(f"{u} {v:+d}" for u, v in routed.items() if v is not None)
                     + f", retries {_delta(after, before, 'num_retries') or 0:+d}, rejections "
                     f"{_delta(after, before, 'rejections') or 0:+d}, cached/prompt tokens "
                     f"{cached}/{prompt} (each backend's engine counters: its /v1/stats)")
        return lines
    parts = [f"{k} {_delta(after, before, k):+d}" for k in ("requests_total", "requests_rejected")
             if _delta(after, before, k) is not None]
    if before.get("prefix_cache") and after.get("prefix_cache"):
        parts += [f"prefix {k} {_delta(after['prefix_cache'], before['prefix_cache'], k):+d}"
                  for k in ("hits_ram", "hits_ssd", "misses")]
    lines.append("server /v1/stats after - before: " + (", ".join(parts) or
                                                        "no counters it knows"))
    return lines


def _error_lines(summary: dict[str, Any]) -> list[str]:
    errors = summary.get("errors") or {}
    if not errors:
        return []
    lines = [f"{'errors by code':<24}{'requests':>10}  example message"]
    for code, n in sorted(errors.items(), key=lambda kv: -kv[1]):
        lines.append(f"{code:<24}{n:>10d}  {summary['error_examples'].get(code) or '-'}")
    return lines


def ratio_table(a: dict[str, Any], b: dict[str, Any], names: tuple[str, str]) -> str:
    """B / A for the headline figures of two runs on the same requests."""
    keys = ("completed", "request_throughput", "output_throughput", "total_token_throughput",
            "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "mean_itl_ms",
            "mean_e2el_ms", "achieved_reuse_fraction")
    lines = [f"{'metric':<28}{'A':>12}{'B':>12}{'B/A':>8}   A={names[0]}  B={names[1]}"]
    for k in keys:
        ratio = b[k] / a[k] if a[k] else math.nan
        lines.append(f"{k:<28}{a[k]:>12.2f}{b[k]:>12.2f}{ratio:>8.2f}")
    return "\n".join(lines)


def compare_outputs(reqs: Sequence[TraceRequest], got: Sequence[RequestResult],
                    out_dir: Path | None) -> dict[str, int]:
    """Token-by-token comparison against each request's expected output; one minimal
    reproduction JSON per divergence (prompt, params with max_tokens cut to the first
    divergent token, expected vs got, first divergent index)."""
    by_index = {r.index: r for r in got}
    counts = {"compared": 0, "identical": 0, "divergent": 0, "skipped": 0}
    for req in reqs:
        r = by_index.get(req.index)
        seeded = req.params.get("temperature", 0.0) == 0.0 or req.params.get("seed") is not None
        if (r is None or not r.ok or req.expected_tokens is None or not seeded
                or req.expected_finish == "cancelled"):
            counts["skipped"] += 1
            continue
        counts["compared"] += 1
        want, have = list(req.expected_tokens), list(r.output_tokens)
        if want == have:
            counts["identical"] += 1
            continue
        counts["divergent"] += 1
        first = next((i for i, (x, y) in enumerate(zip(want, have)) if x != y),
                     min(len(want), len(have)))
        if out_dir is not None:
            fields = expected_fields(req)
            fields["max_tokens"] = min(fields["max_tokens"], first + 1)
            repro = {"index": req.index, "request": fields, "first_divergent_index": first,
                     "expected": want[:first + 1], "got": have[:first + 1],
                     "expected_finish": req.expected_finish, "got_finish": r.finish_reason}
            out_dir.mkdir(parents=True, exist_ok=True)
            (out_dir / f"divergence-{req.index}.json").write_text(json.dumps(repro) + "\n")
    return counts


def write_outputs(out: Path, summary: dict[str, Any], results: Sequence[RequestResult],
                  *, plots: bool, bin_s: float) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")
    with open(out / "requests.jsonl", "w", encoding="utf-8") as f:
        for r in results:
            f.write(json.dumps(r.to_json()) + "\n")
    if plots:  # the CLI checked for matplotlib at start (`plots_available`)
        write_plots(out / "replay.png", results, bin_s)


def plots_available() -> str | None:
    """None where matplotlib imports, else the one line that says the PNG is skipped."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return ("plots off: matplotlib is not installed (pip install 'tqserve[replay]'); "
                "the JSON and JSONL are written")
    return None


def write_plots(path: Path, results: Sequence[RequestResult], bin_s: float) -> None:
    """One PNG: TTFT CDF by cache outcome; throughput and queue over time; cached
    fraction over time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = time_series(results, bin_s)
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    ax = axes[0]
    for outcome in OUTCOMES:  # each result carries the hit threshold (metrics.py)
        ttft = sorted(r.ttft_s * 1000 for r in results if r.ok and r.outcome == outcome
                      and r.ttft_s is not None)
        if ttft:
            ax.step(ttft, [(i + 1) / len(ttft) for i in range(len(ttft))], where="post",
                    label=f"{outcome} ({len(ttft)})")
    ax.set(xlabel="TTFT (ms)", ylabel="fraction of requests", title="TTFT CDF by cache outcome")
    ax.set_xscale("log")
    ax.legend()
    ax = axes[1]
    ax.plot(series["t_s"], series["output_tokens_per_s"], label="output tok/s")
    ax.set(xlabel="time (s)", ylabel="output tokens/s", title="throughput and queue")
    twin = ax.twinx()
    twin.plot(series["t_s"], series["queued"], color="tab:red", label="waiting for 1st token")
    twin.plot(series["t_s"], series["running"], color="tab:green", label="decoding")
    twin.set_ylabel("requests")
    twin.legend(loc="upper right", fontsize=7)
    ax = axes[2]
    ax.plot(series["t_s"], series["cached_fraction"], marker=".")
    ax.set(xlabel="time sent (s)", ylabel="cached / prompt tokens", ylim=(0, 1),
           title="cached fraction over time")
    fig.tight_layout()
    fig.savefig(path, dpi=70)
    plt.close(fig)
