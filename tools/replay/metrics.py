"""Replay metrics, sans-io: per-request timings in, vLLM-named figures out.

Nothing here reads a clock or a file; the driver records times (seconds since the run
began) and hands over `RequestResult`s. Names follow `vllm bench serve`: completed,
failed, request/output/total token throughput, TTFT, TPOT, ITL, E2EL (mean, median, p99 in
ms), request goodput under SLOs. Percentiles are numpy's (linear interpolation), as vLLM's.

* TTFT = first token - send; E2EL = done - send; TPOT = (E2EL - TTFT) / (output - 1) for
  requests with more than one output token (vLLM's formula); ITL pools every gap between a request's tokens.
* Cache outcome per request from `done`: ram or ssd (the tier the reused prefix came
  from) when at least `min_hit_tokens` prompt tokens were cached, else miss. The floor
  keeps chance matches out of the hits: on a trace without prefix information (Azure)
  unrelated prompts share 1-19 leading tokens, which cost nothing to recompute and made
  "hits" look slower than misses. The CLI's default is HIT_MIN_TOKENS, or one block where
  a Mooncake block is smaller; a request below it is a miss (its cached tokens still count
  in the achieved fraction) and is counted in `chance_matches`.
* Failed requests keep the server's code and message (`error`, `error_message`) and the
  time the error came (`end_s`); requests cut off by an interruption are `interrupted`,
  counted apart from the failures.
* Ideal reusable fraction (`ideal_reuse`): for each request, the longest prefix its prompt
  shares with an earlier donor's prompt, capped at prompt length - 1 (the last prompt token
  always runs, to give logits), over all prompt tokens. "infinite": every earlier-sent
  request is a donor (an infinite cache that publishes at send). "donor_finished": only
  requests that finished before this one was sent (a cache that publishes at finish, as
  the engine's does) — the figure the achieved fraction should match.
"""

from __future__ import annotations

from typing import Any, Sequence

import attrs
import numpy as np

OUTCOMES = ("miss", "ram", "ssd")
HIT_MIN_TOKENS = 32   # fewer cached tokens than this is a chance match, not a hit
INTERRUPTED = "interrupted"  # error code of a request the replay's interruption cut off


@attrs.frozen(kw_only=True)
class RequestResult:
    index: int
    send_s: float
    prompt_tokens: int                   # sent
    token_times: tuple[float, ...] = ()  # arrival of each token frame
    done_s: float | None = None          # None: failed
    completion_tokens: int = 0
    cached_tokens: int = 0
    cached_tier: str | None = None       # "ram" / "ssd" where cached_tokens > 0
    error: str | None = None             # error code, for failed requests
    error_message: str | None = None     # the server's reason, for failed requests
    end_s: float | None = None           # when a failed request ended (its error)
    output_tokens: tuple[int, ...] = ()
    finish_reason: str | None = None
    speculative: dict[str, Any] | None = None  # done's usage.speculative, where reported
    min_hit_tokens: int = 1              # cached tokens a hit needs (module docstring)

    @property
    def ok(self) -> bool:
        return self.error is None and self.done_s is not None

    @property
    def outcome(self) -> str:
        hit = self.cached_tokens >= max(1, self.min_hit_tokens)
        return self.cached_tier if hit and self.cached_tier else "miss"

    @property
    def chance_match(self) -> bool:
        """Some prompt tokens were cached, fewer than a hit needs."""
        return 0 < self.cached_tokens < self.min_hit_tokens

    @property
    def ttft_s(self) -> float | None:
        return self.token_times[0] - self.send_s if self.token_times else None

    @property
    def e2el_s(self) -> float | None:
        return self.done_s - self.send_s if self.done_s is not None else None

    @property
    def tpot_s(self) -> float | None:
        n = len(self.token_times)
        if not self.ok or n < 2 or self.done_s is None:
            return None
        return (self.done_s - self.token_times[0]) / (n - 1)

    def to_json(self) -> dict[str, Any]:
        out = attrs.asdict(self)
        out.pop("token_times")
        out.pop("min_hit_tokens")
        out.update(outcome=self.outcome, ttft_ms=_ms(self.ttft_s), tpot_ms=_ms(self.tpot_s),
                   e2el_ms=_ms(self.e2el_s), output_tokens=list(self.output_tokens))
        return out


def _ms(v: float | None) -> float | None:
    return None if v is None else v * 1000.0


def _stats(name: str, values_s: Sequence[float]) -> dict[str, float]:
    a = np.asarray(values_s, dtype=np.float64) * 1000.0
    if not a.size:
        return {f"mean_{name}_ms": 0.0, f"median_{name}_ms": 0.0, f"p99_{name}_ms": 0.0}
    return {f"mean_{name}_ms": float(a.mean()), f"median_{name}_ms": float(np.median(a)),
            f"p99_{name}_ms": float(np.percentile(a, 99))}


def parse_goodput(items: Sequence[str]) -> dict[str, float]:
    """`ttft:500 tpot:50 e2el:2000` -> SLOs in ms; ValueError naming the bad item."""
    slos = {}
    for item in items:
        name, _, value = item.partition(":")
        if name not in ("ttft", "tpot", "e2el"):
            raise ValueError(f"--goodput: unknown metric {name!r} in {item!r} "
                             "(ttft, tpot or e2el)")
        try:
            slos[name] = float(value)
        except ValueError:
            raise ValueError(f"--goodput: {item!r} needs milliseconds, e.g. ttft:500") from None
        if slos[name] <= 0:
            raise ValueError(f"--goodput: {item!r} must be positive")
    return slos


def _meets(r: RequestResult, slos: dict[str, float]) -> bool:
    for name, limit in slos.items():
        value = {"ttft": r.ttft_s, "tpot": r.tpot_s, "e2el": r.e2el_s}[name]
        if value is not None and value * 1000.0 > limit:
            return False
        if value is None and name != "tpot":
            return False
    return True


def summarize(results: Sequence[RequestResult], *, goodput: dict[str, float] | None = None
              ) -> dict[str, Any]:
    """The headline figures with vLLM's names, plus the split by cache outcome."""
    ok = [r for r in results if r.ok]
    start = min((r.send_s for r in results), default=0.0)
    end = max((r.done_s for r in ok), default=start)
    duration = max(end - start, 1e-9)
    n_in = sum(r.prompt_tokens for r in ok)
    n_out = sum(r.completion_tokens for r in ok)
    cut = sum(1 for r in results if r.error == INTERRUPTED)
    out: dict[str, Any] = {
        "completed": len(ok), "failed": len(results) - len(ok) - cut, "interrupted": cut,
        "duration_s": duration,
        "total_input_tokens": n_in, "total_output_tokens": n_out,
        "request_throughput": len(ok) / duration, "output_throughput": n_out / duration,
        "total_token_throughput": (n_in + n_out) / duration}
    out.update(_stats("ttft", [r.ttft_s for r in ok if r.ttft_s is not None]))
    out.update(_stats("tpot", [r.tpot_s for r in ok if r.tpot_s is not None]))
    out.update(_stats("itl", [b - a for r in ok for a, b in
                              zip(r.token_times, r.token_times[1:])]))
    out.update(_stats("e2el", [r.e2el_s for r in ok if r.e2el_s is not None]))
    if goodput:
        good = sum(1 for r in ok if _meets(r, goodput))
        out["request_goodput"] = good / duration
        out["goodput_fraction"] = good / len(results) if results else 0.0
    cached = sum(r.cached_tokens for r in ok)
    out["cached_tokens"] = cached
    out["achieved_reuse_fraction"] = cached / n_in if n_in else 0.0
    out["min_hit_tokens"] = max((r.min_hit_tokens for r in results), default=1)
    out["chance_matches"] = sum(1 for r in ok if r.chance_match)
    out["by_outcome"] = {}
    for outcome in OUTCOMES:
        group = [r for r in ok if r.outcome == outcome]
        row: dict[str, Any] = {"requests": len(group),
                               "prompt_tokens": sum(r.prompt_tokens for r in group),
                               "cached_tokens": sum(r.cached_tokens for r in group)}
        row.update(_stats("ttft", [r.ttft_s for r in group if r.ttft_s is not None]))
        out["by_outcome"][outcome] = row
    errors: dict[str, int] = {}
    examples: dict[str, str] = {}
    for r in results:
        if not r.ok and r.error != INTERRUPTED:
            code = r.error or "unfinished"
            errors[code] = errors.get(code, 0) + 1
            examples.setdefault(code, r.error_message or "")
    out["errors"] = errors
    out["error_examples"] = examples  # code -> the first such request's message
    spec = [r.speculative for r in ok if r.speculative]
    if spec:
        proposed = sum(int(x.get("proposed", 0)) for x in spec)
        accepted = sum(int(x.get("accepted", 0)) for x in spec)
        out["speculative"] = {"requests": len(spec), "proposed": proposed,
                              "accepted": accepted,
                              "acceptance_rate": accepted / proposed if proposed else 0.0}
    return out


def lcp_in_trie(trie: dict, tokens: Sequence[int]) -> int:
    node, n = trie, 0
    for t in tokens:
        node = node.get(t)
        if node is None:
            break
        n += 1
    return n


def trie_insert(trie: dict, tokens: Sequence[int]) -> None:
    node = trie
    for t in tokens:
        node = node.setdefault(t, {})


def ideal_reuse(prompts: Sequence[Sequence[int]], send_s: Sequence[float],
                done_s: Sequence[float | None]) -> dict[str, float]:
    """Ideal reusable-token fractions of these prompts (see the module docstring)."""
    total = sum(len(p) for p in prompts)
    infinite_trie: dict = {}
    reused_inf = 0
    for i in sorted(range(len(prompts)), key=lambda i: (send_s[i], i)):
        p = prompts[i]
        reused_inf += min(lcp_in_trie(infinite_trie, p), len(p) - 1)
        trie_insert(infinite_trie, p)
    events = [(send_s[i], 0, i) for i in range(len(prompts))]
    events += [(d, 1, i) for i, d in enumerate(done_s) if d is not None]
    finished_trie: dict = {}
    reused_fin = 0
    for _, kind, i in sorted(events):
        if kind == 0:
            reused_fin += min(lcp_in_trie(finished_trie, prompts[i]), len(prompts[i]) - 1)
        else:
            trie_insert(finished_trie, prompts[i])
    return {"prompt_tokens": total,
            "ideal_reuse_infinite": reused_inf / total if total else 0.0,
            "ideal_reuse_donor_finished": reused_fin / total if total else 0.0}


def time_series(results: Sequence[RequestResult], bin_s: float) -> dict[str, list[float]]:
    """Per bin of `bin_s` seconds: output tokens/s, requests waiting for a first token
    (the queue, at the bin's end: a request that ended without one, rejected or failed,
    waits no longer), running requests, and the cached fraction of the prompts sent in
    that bin."""
    end = max([_end(r) or r.send_s for r in results] + [0.0])
    n = int(end // bin_s) + 1
    tokens = np.zeros(n)
    sent = np.zeros(n)
    cached = np.zeros(n)
    for r in results:
        for t in r.token_times:
            tokens[int(t // bin_s)] += 1
        if r.ok:
            b = int(r.send_s // bin_s)
            sent[b] += r.prompt_tokens
            cached[b] += r.cached_tokens
    edges = [(i + 1) * bin_s for i in range(n)]
    queued = [sum(1 for r in results if r.send_s <= e and (not r.token_times or
                                                          r.token_times[0] > e)
                  and (_end(r) is None or _end(r) > e)) for e in edges]  # type: ignore[operator]
    running = [sum(1 for r in results if r.token_times and r.token_times[0] <= e
                   and (_end(r) is None or _end(r) > e)) for e in edges]  # type: ignore[operator]
    frac = [float(c / s) if s else float("nan") for c, s in zip(cached, sent)]
    return {"t_s": edges, "output_tokens_per_s": list(tokens / bin_s),
            "queued": queued, "running": running, "cached_fraction": frac}


def _end(r: RequestResult) -> float | None:
    """When the request ended, done or failed (None: it never ended)."""
    return r.done_s if r.done_s is not None else r.end_s
