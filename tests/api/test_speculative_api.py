"""Speculation over HTTP against a real server: the OpenAI and Anthropic bodies' extra
`speculative` field, `usage.speculative`, a 400 naming speculative.method, /v1/stats and
/metrics counters."""

from __future__ import annotations

import httpx

from tests.conftest import start_server

PROMPT = "def f(x):\n    return x\n\ndef f(x):\n"


async def test_speculation_over_http(nursery, draft_model):
    server = await start_server(nursery, draft_model, speculative="lookup",
                                speculative_time_policy=False)
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
        r = await client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 16,
                                                       "temperature": 0})
        assert r.status_code == 200, r.text
        spec = r.json()["usage"]["speculative"]
        assert 0 <= spec["accepted"] <= spec["proposed"] > 0
        plain = await client.post("/v1/completions", json={
            "prompt": PROMPT, "max_tokens": 16, "temperature": 0, "speculative": False})
        assert "speculative" not in plain.json()["usage"]
        assert plain.json()["choices"][0]["text"] == r.json()["choices"][0]["text"]
        bad = await client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            "speculative": {"method": "mtp"}})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "speculative"
        assert "not served" in bad.json()["error"]["message"]
        msg = await client.post("/v1/messages", json={
            "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 8,
            "speculative": {"method": "lookup", "num_tokens": 2}})
        assert msg.status_code == 200, msg.text
        stats = (await client.get("/v1/stats")).json()["speculative"]
        assert stats["num_proposed"] >= spec["proposed"]
        metrics = (await client.get("/metrics")).text
        assert "vllm:spec_decode_num_draft_tokens_total" in metrics
