"""Prometheus metrics (GET /metrics) and the access log, one `Metrics` per app.

Each app owns its own `CollectorRegistry` (several servers may share one process).
Per-request figures come from `Metrics.track`, which every generation route (the
WebSocket, OpenAI, Anthropic) wraps around `Engine.generate`; engine-wide figures are
read from `Engine.statistics()` at scrape time, so they agree with /v1/stats.

Names follow vLLM where the meaning matches; the rest are `tqserve:`-prefixed. Every
series carries the label `model_name`.
"""

from __future__ import annotations

import logging
import time
from typing import Any, AsyncIterator, Iterator

import trio
from prometheus_client import (CollectorRegistry, Counter, Histogram, disable_created_metrics,
                               generate_latest)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tqserve.actors.facade import Engine
from tqserve.actors.messages import Done, Error, Event, Token
from tqserve.api.httpcommon import STATUS_BY_CODE

access_log = logging.getLogger("tqserve.access")
disable_created_metrics()  # no `_created` series next to each counter/histogram (as vLLM)

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                60.0, 120.0, 240.0, 480.0, 960.0)


class _EngineCollector(Collector):
    """Gauges and counters read from Engine.statistics() at scrape time."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    def collect(self) -> Iterator[Metric]:
        stats = self._engine.statistics()
        model = stats.model

        def gauge(name: str, doc: str, value: float, **labels: str) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, doc, labels=["model_name", *labels])
            family.add_metric([model, *labels.values()], value)
            return family

        def counter(name: str, doc: str, values: dict[str, float] | float,
                    label: str | None = None) -> CounterMetricFamily:
            family = CounterMetricFamily(name, doc,
                                         labels=["model_name"] + ([label] if label else []))
            if isinstance(values, dict):
                for key, value in values.items():
                    family.add_metric([model, key], value)
            else:
                family.add_metric([model], values)
            return family

        yield gauge("vllm:num_requests_running", "Requests holding a row (prefill or decode).",
                    stats.rows_active)
        yield gauge("vllm:num_requests_waiting", "Requests waiting for a row (preempted ones too).",
                    stats.rows_queued)
        yield gauge("vllm:kv_cache_usage_perc", "Fraction (0-1) of the KV budget charged.",
                    stats.kv_charged_bytes / max(1, stats.kv_budget_bytes))
        yield gauge("tqserve:kv_cache_bytes", "KV bytes allocated for all rows.", stats.kv_bytes)
        yield gauge("tqserve:kv_budget_bytes", "KV bytes the admitted rows may hold together.",
                    stats.kv_budget_bytes)
        yield gauge("tqserve:kv_charged_bytes", "KV bytes charged to the running rows.",
                    stats.kv_charged_bytes)
        yield counter("vllm:num_preemptions", "Rows preempted (KV).", stats.kv_preemptions)
        yield counter("tqserve:requests", "Requests that reached admission.", stats.requests_total)
        yield counter("tqserve:admission_rejections", "Requests refused at admission "
                      "(queue full: code overloaded, HTTP 429).", stats.requests_rejected)
        spec = stats.speculative
        if spec is not None:  # vLLM's spec-decode names
            yield counter("vllm:spec_decode_num_draft_tokens", "Speculative tokens proposed.",
                          spec.num_proposed)
            yield counter("vllm:spec_decode_num_accepted_tokens", "Speculative tokens the "
                          "target accepted.", spec.num_accepted)
            yield counter("vllm:spec_decode_num_drafts", "Verify steps of rows that proposed.",
                          spec.num_verify_steps)
        prefix = stats.prefix_cache
        if prefix is None:
            return
        yield counter("tqserve:prefix_cache_hits", "Prefix-cache lookups that reused KV, by tier.",
                      {"ram": prefix.hits_ram, "ssd": prefix.hits_ssd}, "tier")
        yield counter("tqserve:prefix_cache_misses", "Prefix-cache lookups that found nothing.",
                      prefix.misses)
        yield counter("tqserve:prefix_cache_spills", "Snapshots written to the SSD tier.",
                      prefix.spills)
        yield counter("tqserve:prefix_cache_dropped_writes", "Spills dropped because the async "
                      "write queue was full.", prefix.spills_dropped)
        yield counter("tqserve:prefix_cache_write_errors", "SSD snapshot writes that failed.",
                      prefix.ssd_write_errors)
        yield counter("tqserve:prefix_cache_quarantined_files", "SSD snapshot files that failed "
                      "verification and were moved to quarantine/.", prefix.quarantined)
        yield counter("tqserve:prefix_cache_ssd_errors", "Errors of the cache dir's file "
                      "system (the SSD tier then goes read-only or cold).", prefix.ssd_errors)
        for state in ("ok", "read_only", "cold"):
            yield gauge("tqserve:prefix_cache_ssd_state", "1 for the SSD tier's state: ok, "
                        "read_only (writes paused) or cold (entries dropped).",
                        int(prefix.ssd_state == state), state=state)
        for tier, nbytes, entries in (("ram", prefix.ram_bytes, prefix.ram_entries),
                                      ("ssd", prefix.ssd_bytes, prefix.ssd_entries)):
            yield gauge("tqserve:prefix_cache_bytes", "Snapshot bytes held, by tier.", nbytes,
                        tier=tier)
            yield gauge("tqserve:prefix_cache_entries", "Snapshots held, by tier.", entries,
                        tier=tier)


class Metrics:
    """The app's registry, its per-request instruments, and the access log."""

    def __init__(self, engine: Engine) -> None:
        self.registry = CollectorRegistry()
        self.model = engine.model.path.name
        labels = ["model_name"]

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            return Histogram(name, doc, labels, buckets=buckets,
                             registry=self.registry).labels(self.model)

        self.ttft = histogram("vllm:time_to_first_token_seconds",
                              "Time from submission to the first token.", _LATENCY_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds",
                             "Time between consecutive tokens of a request.", _LATENCY_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds",
                             "Time from submission to the end of the request.", _E2E_BUCKETS)
        self.queue = histogram("vllm:request_queue_time_seconds",
                               "Time a request waited in the queue for a row.", _E2E_BUCKETS)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of finished requests.",
                                     labels, registry=self.registry).labels(self.model)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generated tokens.", labels,
                                         registry=self.registry).labels(self.model)
        self.prefix_queries = Counter("vllm:prefix_cache_queries", "Prompt tokens looked up in "
                                      "the prefix cache.", labels,
                                      registry=self.registry).labels(self.model)
        self.prefix_hits = Counter("vllm:prefix_cache_hits", "Prompt tokens reused from the "
                                   "prefix cache.", labels, registry=self.registry).labels(self.model)
        self.success = Counter("vllm:request_success", "Finished requests, by finish reason "
                               "(stop, length, cancelled).", ["model_name", "finished_reason"],
                               registry=self.registry)
        self.registry.register(_EngineCollector(engine))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    async def track(self, events: AsyncIterator[Event], request_id: str,
                    route: str) -> AsyncIterator[Event]:
        """Pass `events` through, timing them; log one access line when they end."""
        start = trio.current_time()
        wall = time.perf_counter()
        first: float | None = None
        last = start
        tokens = 0
        end: Done | Error | None = None
        stream = aiter(events)  # the loop's own iterator: closing it cancels an unfinished request
        try:
            async for event in stream:
                now = trio.current_time()
                if isinstance(event, Token):
                    tokens += 1
                    if first is None:
                        first = now
                        self.ttft.observe(now - start)
                    else:
                        self.itl.observe(now - last)
                    last = now
                elif isinstance(event, (Done, Error)):
                    end = event
                yield event
        finally:
            with trio.CancelScope(shield=True):
                await stream.aclose()  # type: ignore[attr-defined]
            self.generation_tokens.inc(tokens)
            if isinstance(end, Done):
                self.e2e.observe(trio.current_time() - start)
                if end.queue_seconds is not None:  # the scheduler's stamp (Done.queue_seconds)
                    self.queue.observe(end.queue_seconds)
                self.prompt_tokens.inc(end.prompt_tokens)
                self.prefix_queries.inc(end.prompt_tokens)
                self.prefix_hits.inc(end.cached_tokens)
                self.success.labels(self.model, end.finish_reason).inc()
            self._log(request_id, route, end, tokens, first, start, wall)

    def _log(self, request_id: str, route: str, end: Done | Error | None, tokens: int,
             first: float | None, start: float, wall: float) -> None:
        if isinstance(end, Error) and tokens == 0:
            status, outcome = STATUS_BY_CODE.get(end.code, 500), end.code
        elif isinstance(end, Error):
            status, outcome = 200, end.code
        else:
            status, outcome = 200, end.finish_reason if end is not None else "disconnected"
        prompt = f"{end.prompt_tokens}" if isinstance(end, Done) else "-"
        cached = f"{end.cached_tokens}" if isinstance(end, Done) else "-"
        ttft = f"{(first - start) * 1000:.1f}" if first is not None else "-"
        access_log.info("id=%s route=%s status=%d outcome=%s prompt_tokens=%s "
                        "completion_tokens=%d cached_tokens=%s ttft_ms=%s total_ms=%.1f",
                        request_id, route, status, outcome, prompt, tokens, cached, ttft,
                        (time.perf_counter() - wall) * 1000)

    def log_plain(self, request_id: str, route: str, status: int, wall: float) -> None:
        """The access line of a request that generated nothing."""
        access_log.info("id=%s route=%s status=%d outcome=- prompt_tokens=- completion_tokens=0 "
                        "cached_tokens=- ttft_ms=- total_ms=%.1f", request_id, route, status,
                        (time.perf_counter() - wall) * 1000)
