"""GET /metrics: Prometheus text that prometheus-client parses, agreeing with /v1/stats."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families
from trio_websocket import open_websocket_url

from tests.api.wsclient import LONG_PROMPT, Session, run_alone, wait_stats
from tests.conftest import start_server

VLLM_NAMES = ("vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
              "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds",
              "vllm:num_requests_running", "vllm:num_requests_waiting",
              "vllm:kv_cache_usage_perc", "vllm:prefix_cache_queries",
              "vllm:prefix_cache_hits", "vllm:prompt_tokens", "vllm:generation_tokens")


async def scrape(raw: httpx.AsyncClient, url: str) -> dict[str, dict[tuple, float]]:
    """name -> {sorted labels without model_name: value} for every sample."""
    response = await raw.get(url + "/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    out: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "model_name"))
            out.setdefault(sample.name, {})[labels] = sample.value
    return out


async def test_metrics_agree_with_stats_after_a_known_workload(nursery, draft_model):
    server = await start_server(nursery, draft_model, max_queued_requests=1, max_batch=1)
    async with httpx.AsyncClient(timeout=60) as raw:
        before = await scrape(raw, server.url)
        assert before["vllm:num_requests_running"][()] == 0
        assert before["vllm:generation_tokens_total"][()] == 0
        assert all(any(n == name or n.startswith(name + "_") for n in before)
                   for name in VLLM_NAMES), sorted(before)
        usages = []
        for prompt in ("def f(x):", "def f(x):", "class A:"):  # the second one hits RAM
            body = (await raw.post(server.url + "/v1/completions", json={
                "prompt": prompt, "max_tokens": 5, "temperature": 0})).json()
            usage = body["usage"]
            usages.append(dict(usage, cached_tokens=usage["prompt_tokens_details"]["cached_tokens"]))
        anth = (await raw.post(server.url + "/v1/messages", json={
            "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "user", "content": "x = 1"}]})).json()
        ws = await run_alone(server.ws_url, "w", prompt="import sys", max_tokens=3,
                             temperature=0)
        async with open_websocket_url(server.ws_url) as sock:
            session = Session(sock)
            await session.generate("r1", prompt=LONG_PROMPT, max_tokens=300, temperature=0)
            await session.first_token("r1")
            await session.generate("r2", prompt=LONG_PROMPT, max_tokens=300, temperature=0)
            await session.queued("r2")
            refused = await raw.post(server.url + "/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "x"}], "max_tokens": 2})
            assert refused.status_code == 429
            busy = await scrape(raw, server.url)
            assert busy["vllm:num_requests_running"][()] == 1
            assert busy["vllm:num_requests_waiting"][()] == 1
            # the running row's whole life, charged against the KV budget (engine.kv_budget)
            charged = busy["tqserve:kv_charged_bytes"][()]
            assert busy["vllm:kv_cache_usage_perc"][()] == charged / busy[
                "tqserve:kv_budget_bytes"][()] and 0 < charged
            assert 0 < busy["tqserve:kv_cache_bytes"][()] <= charged
            # r2 first, and only once it has ended r1: cancelling r1 first frees its row,
            # and r2 could start (and make a token) before its own cancel arrives
            await session.send({"type": "cancel", "id": "r2"})
            (r2,) = await session.wait("r2")
            await session.send({"type": "cancel", "id": "r1"})
            (r1,) = await session.wait("r1")
        stats = await wait_stats(raw, server.url, rows_active=0, rows_queued=0, streams_open=0)
        after = await scrape(raw, server.url)
    ws_usages = [r.end["usage"] for r in (ws, r1, r2)]
    prompt_tokens = (sum(u["prompt_tokens"] for u in usages + ws_usages)
                     + anth["usage"]["input_tokens"] + anth["usage"]["cache_read_input_tokens"])
    generated = (sum(u["completion_tokens"] for u in usages + ws_usages)
                 + anth["usage"]["output_tokens"])
    cached = (sum(u["cached_tokens"] for u in usages + ws_usages)
              + anth["usage"]["cache_read_input_tokens"])
    assert after["vllm:prompt_tokens_total"][()] == prompt_tokens
    assert after["vllm:prefix_cache_queries_total"][()] == prompt_tokens
    assert after["vllm:generation_tokens_total"][()] == generated
    assert after["vllm:prefix_cache_hits_total"][()] == cached > 0
    prefix = stats["prefix_cache"]
    assert after["tqserve:requests_total"][()] == stats["requests_total"] == 8
    assert after["tqserve:admission_rejections_total"][()] == stats["requests_rejected"] == 1
    for tier in ("ram", "ssd"):
        assert after["tqserve:prefix_cache_hits_total"][(("tier", tier),)] == prefix[f"hits_{tier}"]
        assert after["tqserve:prefix_cache_bytes"][(("tier", tier),)] == prefix[f"{tier}_bytes"]
    assert after["tqserve:prefix_cache_misses_total"][()] == prefix["misses"]
    assert after["tqserve:prefix_cache_spills_total"][()] == prefix["spills"]
    assert after["tqserve:prefix_cache_quarantined_files_total"][()] == prefix["quarantined"]
    assert after["tqserve:prefix_cache_dropped_writes_total"][()] == prefix["spills_dropped"]
    # one TTFT per request that produced a token (r2 was cancelled in the queue), one E2E per
    # request that ended with a done (six); queue waits were timed for the ones given a row
    started = 6
    assert after["vllm:time_to_first_token_seconds_count"][()] == started
    assert after["vllm:e2e_request_latency_seconds_count"][()] == 7
    assert after["vllm:request_queue_time_seconds_count"][()] >= started
    assert after["vllm:inter_token_latency_seconds_count"][()] == generated - started
    assert after["vllm:num_requests_running"][()] == 0
    finished = after["vllm:request_success_total"]
    assert finished == {(("finished_reason", "length"),): 5,
                        (("finished_reason", "cancelled"),): 2}, finished
    assert after["vllm:time_to_first_token_seconds_bucket"][(("le", "+Inf"),)] == started


async def test_two_servers_in_one_process_keep_their_own_metrics(nursery, draft_model):
    one = await start_server(nursery, draft_model)
    two = await start_server(nursery, draft_model)
    async with httpx.AsyncClient(timeout=60) as raw:
        await raw.post(one.url + "/v1/completions", json={"prompt": "a = 1", "max_tokens": 3,
                                                          "temperature": 0})
        first, second = await scrape(raw, one.url), await scrape(raw, two.url)
    assert first["vllm:generation_tokens_total"][()] == 3
    assert second["vllm:generation_tokens_total"][()] == 0
