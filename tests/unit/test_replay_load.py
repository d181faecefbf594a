"""tools/replay's start checks and report, sans-io, on hand-made requests with known answers:
reuse and bursts in the load check, the context check, the hit threshold, errors with
their messages, interrupted requests, the queue line of the plot, the table's notes."""

from __future__ import annotations

import pytest

from tqserve.tools.replay.load import (estimate_rejections, offered_load, over_context,
                                       peak_window, uncached_tokens)
from tqserve.tools.replay.metrics import INTERRUPTED, RequestResult, summarize, time_series
from tqserve.tools.replay.report import summary_table
from tqserve.tools.replay.traces import TraceRequest


def _req(i, t, prompt, out=10):
    return TraceRequest(index=i, arrival_s=t, prompt_tokens=tuple(prompt), max_tokens=out,
                        family=str(i), implied_input_tokens=len(prompt))


SHARED = list(range(2, 102))  # a 100-token shared prefix


def test_reuse_makes_the_offered_work_smaller():
    reqs = [_req(0, 0.0, SHARED + [7]), _req(1, 5.0, SHARED + [8, 9]), _req(2, 10.0, [5] * 50)]
    assert uncached_tokens(reqs) == [101, 2, 50]
    load = offered_load(reqs, time_scale=1.0)
    assert load["tokens"] == 101 + 102 + 50 + 30
    assert load["work_tokens"] == 101 + 2 + 50 + 30
    assert load["tokens_per_s"] == pytest.approx(283 / 10)
    assert load["work_per_s"] == pytest.approx(183 / 10)
    # the same prompt twice: only its last token runs again
    assert uncached_tokens([_req(0, 0, SHARED), _req(1, 0, SHARED)]) == [100, 1]


def test_peak_window_finds_the_burst():
    times = [0.0, 1.0, 30.0, 31.0, 32.0, 39.0, 41.0, 80.0]
    reqs = [_req(i, t, [i + 2] * 20, out=5) for i, t in enumerate(times)]
    peak = peak_window(reqs, time_scale=1.0, window_s=10.0)
    assert (peak["requests"], peak["start_s"]) == (4, 30.0)  # 30, 31, 32, 39
    assert peak["work_tokens"] == 4 * 25
    half = peak_window(reqs, time_scale=0.5, window_s=10.0)  # 15, 15.5, 16, 19.5, 20.5
    assert half["requests"] == 5


def test_estimated_rejections_count_bursts_not_averages():
    # 20 requests of 100 work tokens at once, then nothing for 1000 s: the average is
    # 2 tok/s against a capacity of 100, but the burst fills a queue of 4 behind 2 running
    burst = [_req(i, 0.0, [i + 2] * 90, out=10) for i in range(20)] + \
        [_req(20, 1000.0, [3] * 90, out=10)]
    kw = dict(capacity=100.0, max_batch=2, max_queued_requests=4, max_queued_tokens=10_000)
    assert offered_load(burst, 1.0)["work_per_s"] < 100
    assert estimate_rejections(burst, 1.0, **kw) == 20 - 2 - 4
    # spread out (one per 2 s, each done in 1 s): nothing waits, nothing is refused
    spread = [_req(i, 2.0 * i, [i + 2] * 90, out=10) for i in range(20)]
    assert estimate_rejections(spread, 1.0, **kw) == 0
    # the token bound: 3 queued prompts of 90 fit in 300 tokens, the 4th does not
    assert estimate_rejections(burst[:20], 1.0, **{**kw, "max_queued_tokens": 300}) == 20 - 2 - 3
    # high reuse: the same 90-token prefix costs one token after the first, so the queue
    # drains between arrivals that an average-rate check calls overload
    reuse = [_req(i, 1.0 + 0.1 * i if i else 0.0, SHARED[:90] + [i + 200], out=1)
             for i in range(30)]
    assert offered_load(reuse, 1.0)["tokens_per_s"] > 300
    assert estimate_rejections(reuse, 1.0, capacity=300.0, max_batch=1,
                               max_queued_requests=1, max_queued_tokens=10_000) == 0


def test_over_context_counts_prompt_plus_max_tokens():
    reqs = [_req(0, 0, [2] * 90, out=10), _req(1, 0, [2] * 91, out=10), _req(2, 0, [2] * 50)]
    assert [r.index for r in over_context(reqs, 100)] == [1]


OK = dict(token_times=(1.0, 1.1), done_s=1.1, completion_tokens=2)


def test_a_hit_needs_the_minimum_reuse():
    chance = RequestResult(index=0, send_s=0.0, prompt_tokens=400, cached_tokens=12,
                           cached_tier="ram", min_hit_tokens=32, **OK)
    hit = RequestResult(index=1, send_s=0.0, prompt_tokens=400, cached_tokens=300,
                        cached_tier="ram", min_hit_tokens=32, **OK)
    assert (chance.outcome, hit.outcome) == ("miss", "ram")
    s = summarize([chance, hit])
    assert s["by_outcome"]["miss"]["requests"] == 1 and s["by_outcome"]["ram"]["requests"] == 1
    assert s["by_outcome"]["miss"]["cached_tokens"] == 12  # still counted as reused
    assert s["achieved_reuse_fraction"] == pytest.approx(312 / 800)
    assert (s["min_hit_tokens"], s["chance_matches"]) == (32, 1)
    assert "a hit reuses >= 32 prompt tokens; 1 requests with 1-31 cached" in \
        summary_table(s)


def test_errors_keep_their_messages_and_interrupted_ones_count_apart():
    reason = "prompt_tokens holds 40160 ids, more than the model's context of 32768 tokens"
    results = [RequestResult(index=0, send_s=0.0, prompt_tokens=5, **OK),
               RequestResult(index=1, send_s=0.1, prompt_tokens=40160, error="invalid_request",
                             error_message=reason, end_s=0.2),
               RequestResult(index=2, send_s=0.2, prompt_tokens=9, error="overloaded",
                             error_message="queue full: 64 requests queued (max 64)",
                             end_s=0.3),
               RequestResult(index=3, send_s=0.3, prompt_tokens=9, error=INTERRUPTED,
                             end_s=2.0, token_times=(0.5,), output_tokens=(4,))]
    s = summarize(results)
    assert (s["completed"], s["failed"], s["interrupted"]) == (1, 2, 1)
    assert s["errors"] == {"invalid_request": 1, "overloaded": 1}
    assert s["error_examples"]["invalid_request"] == reason
    table = summary_table(s)
    assert f"invalid_request                  1  {reason}" in table
    assert results[1].to_json()["error_message"] == reason
    # the queue line: a refused request waits no longer once its error came
    ts = time_series(results, bin_s=0.5)
    # at 0.5 only request 0 waits (its first token comes at 1.0); 3 has its token at 0.5;
    # 1 and 2 were refused at 0.2 and 0.3 (before the fix they "waited" to the end)
    assert ts["queued"] == [1, 0, 0, 0, 0]


def test_table_notes_partial_runs_warm_caches_and_routers():
    s = summarize([RequestResult(index=0, send_s=0.0, prompt_tokens=10, cached_tokens=9,
                                 cached_tier="ssd", **OK)])
    s.update(reuse={"ideal_reuse_infinite": 0.0, "ideal_reuse_donor_finished": 0.0},
             warm_entries=7, target="ws://router",
             partial={"reason": "SIGINT", "at_s": 3.5, "ended": 1, "cut_off": 2,
                      "not_sent": 5})
    router = {"policy": "prefix", "num_retries": 0, "rejections": {},
              "prompt_tokens": {"a": 0}, "cached_tokens": {"a": 0},
              "backends": {"a": {"num_routed": {"load": 1}}}}
    after = {**router, "prompt_tokens": {"a": 10}, "cached_tokens": {"a": 9},
             "num_retries": 1, "backends": {"a": {"num_routed": {"load": 2, "prefix": 1}}}}
    s.update(stats_before=router, stats_after=after)
    table = summary_table(s)
    assert table.startswith("PARTIAL RUN: interrupted by SIGINT at 3.5 s: 1 requests ended, "
                            "2 cut off in flight, 5 not sent")
    assert "the target's cache held 7 entries before it" in table
    assert ("router /v1/stats after - before: policy prefix, routed a +2, retries +1, "
            "rejections +0, cached/prompt tokens 9/10") in table
    s.update(stats_before=None, stats_after=None)
    assert "target stats: none (ws://router answered no /v1/stats)" in summary_table(s)
