"""What a trace asks of a target, before it runs: sans-io arithmetic for the start checks.

* `over_context`: requests whose prompt + max_tokens exceed the target's context (its
  `max_model_len`): the server refuses them (`invalid_request`).
* `offered_load`: tokens per second the trace offers at a time scale, as sent (prompt +
  max output) and as work: prefix-cached tokens are cheap, so each prompt counts only the
  tokens that no earlier-sent prompt shares (the infinite-cache ideal of metrics.py).
* `peak_window`: the busiest `window_s` seconds (replay time): requests and work tokens.
* `estimate_rejections`: a fluid model of the server's admission: up to `max_batch`
  requests run (FIFO) and share `capacity` tokens/s of work; the others wait in a queue
  bounded by `max_queued_requests` and `max_queued_tokens` (prompt tokens), and an arrival
  that finds it full is refused, as admission does. An average rate under capacity hides
  bursts; a queue that fills in a burst is what rejects requests.
Estimates, not predictions: the capacity is measured on a small probe, and decode is
cheaper per token in a large batch than the fluid model assumes.
"""

from __future__ import annotations

import math
from typing import Sequence

from tqserve.tools.replay.metrics import lcp_in_trie, trie_insert
from tqserve.tools.replay.traces import TraceRequest

BURST_WINDOW_S = 10.0  # seconds of replay time the burst check slides over


def over_context(reqs: Sequence[TraceRequest], max_model_len: int) -> list[TraceRequest]:
    """Requests the target must refuse: prompt + max_tokens > max_model_len."""
    return [r for r in reqs if len(r.prompt_tokens) + r.max_tokens > max_model_len]


def uncached_tokens(reqs: Sequence[TraceRequest]) -> list[int]:
    """Per request (in order), the prompt tokens no earlier request's prompt shares; the
    last prompt token always runs."""
    trie: dict = {}
    out = []
    for r in reqs:
        p = r.prompt_tokens
        out.append(len(p) - min(lcp_in_trie(trie, p), len(p) - 1))
        trie_insert(trie, p)
    return out


def offered_load(reqs: Sequence[TraceRequest], time_scale: float) -> dict[str, float]:
    """Tokens/s the trace offers: `tokens_per_s` as sent, `work_per_s` with reuse counted."""
    span = (reqs[-1].arrival_s - reqs[0].arrival_s) * time_scale if reqs else 0.0
    tokens = sum(len(r.prompt_tokens) + r.max_tokens for r in reqs)
    work = sum(u + r.max_tokens for u, r in zip(uncached_tokens(reqs), reqs))
    return {"span_s": span, "tokens": tokens, "work_tokens": work,
            "tokens_per_s": tokens / span if span > 0 else math.inf,
            "work_per_s": work / span if span > 0 else math.inf}


def peak_window(reqs: Sequence[TraceRequest], time_scale: float,
                window_s: float = BURST_WINDOW_S) -> dict[str, float]:
    """The `window_s` seconds with the most arrivals: requests, work tokens, start time."""
    times = [(r.arrival_s - reqs[0].arrival_s) * time_scale for r in reqs]
    work = [u + r.max_tokens for u, r in zip(uncached_tokens(reqs), reqs)]
    best = {"requests": 0, "work_tokens": 0, "start_s": 0.0, "window_s": window_s}
    lo, total = 0, 0
    for hi, t in enumerate(times):
        total += work[hi]
        while times[lo] < t - window_s:
            total -= work[lo]
            lo += 1
        if hi - lo + 1 > best["requests"]:
            best.update(requests=hi - lo + 1, work_tokens=total, start_s=times[lo])
    return best


def estimate_rejections(reqs: Sequence[TraceRequest], time_scale: float, *, capacity: float,
                        max_batch: int, max_queued_requests: int,
                        max_queued_tokens: int) -> int:
    """Requests the fluid admission model refuses (see the module docstring)."""
    if not reqs or capacity <= 0:
        return 0
    arrivals = [(r.arrival_s - reqs[0].arrival_s) * time_scale for r in reqs]
    work = [float(u + r.max_tokens) for u, r in zip(uncached_tokens(reqs), reqs)]
    running: list[float] = []          # remaining work of each running request
    queue: list[tuple[int, float]] = []  # (prompt tokens, work) of each queued request
    queued_tokens, rejected, now = 0, 0, 0.0
    for i, t in enumerate(arrivals):
        while running and now < t:   # run until the arrival, finishing requests on the way
            share = capacity / len(running)
            step = min(min(running) / share, t - now)
            running = [w - share * step for w in running]
            now += step
            running = [w for w in running if w > 1e-9]
            while queue and len(running) < max_batch:
                tokens, w = queue.pop(0)
                queued_tokens -= tokens
                running.append(w)
        now = t
        n = len(reqs[i].prompt_tokens)
        if len(queue) >= max_queued_requests or queued_tokens + n > max_queued_tokens:
            rejected += 1
        elif len(running) < max_batch:
            running.append(work[i])
        else:
            queue.append((n, work[i]))
            queued_tokens += n
    return rejected
