"""`tqserve route` against 3 real replicas of the bundled model: WebSocket and HTTP pass
through, prefix affinity, metrics, bad input."""

from __future__ import annotations

import json

import httpx
import pytest
import trio

from tests.api.routerkit import start_replica, start_router
from tqserve.client import Client, DoneEvent, TokenEvent

SYSTEM = "import os\nimport sys\n\n\ndef read_config(path):\n    " * 3  # ~150 chars


@pytest.fixture
async def cluster(nursery, draft_model):
    replicas = [await start_replica(nursery, draft_model) for _ in range(3)]
    router = await start_router(nursery, [r.url for r in replicas])
    return replicas, router


async def _run(client, **kw):
    events = [e async for e in client.generate(**kw)]
    return events


async def test_ws_affinity_same_tokens_and_cache_hits(cluster):
    replicas, router = cluster
    prompts = [SYSTEM + f"# variant {i}\n" for i in range(3)]
    async with Client.connect(replicas[0].url.replace("http", "ws") + "/v1/stream") as direct:
        want = [e.token_id for e in await _run(direct, prompt=prompts[0], max_tokens=8,
                                                 temperature=0) if isinstance(e, TokenEvent)]
    async with Client.connect(router.ws_url, binary=False) as client:
        first = await _run(client, prompt=prompts[0], max_tokens=8, temperature=0,
                           request_id="mine")
        assert [e.token_id for e in first if isinstance(e, TokenEvent)] == want
        assert {e.request_id for e in first} == {"mine"}
        assert isinstance(first[-1], DoneEvent) and first[-1].completion_tokens == 8
        # the same prompt with more after it: same backend, its prefix from the cache
        again = await _run(client, prompt=prompts[0] + "    return 1\n", max_tokens=4,
                           temperature=0)
        assert again[-1].cached_tokens > 0
    async with Client.connect(router.ws_url) as client:  # msgpack frames, concurrent
        async with trio.open_nursery() as nursery:
            for p in prompts * 2:
                nursery.start_soon(lambda p=p: _run(client, prompt=p, max_tokens=4))
    stats = await router.stats()
    routed = {b: s["num_routed"] for b, s in stats["backends"].items()}
    assert sum(r.get("affinity", 0) for r in routed.values()) >= 4
    assert sum(sum(r.values()) for r in routed.values()) == 8
    assert all(s["num_in_flight"] == 0 for s in stats["backends"].values())
    assert sum(stats["links"]["num_links"].values()) >= 1
    assert sum(stats["links"]["num_streams"].values()) == 0 and not stats["draining"]
    assert sum(stats["prompt_tokens"].values()) > sum(stats["cached_tokens"].values()) > 0
    # each prompt's 1 + 1 (or 2) requests ran on one replica: its cache saw the repeat
    async with httpx.AsyncClient() as http:
        totals = [(await http.get(r.url + "/v1/stats")).json()["requests_total"]
                  for r in replicas]
    assert sum(totals) == 8 + 1  # and the direct one


async def test_http_apis_pass_through(cluster):
    replicas, router = cluster
    async with httpx.AsyncClient(base_url=router.url, timeout=60) as http:
        r = await http.post("/v1/completions", json={"prompt": SYSTEM, "max_tokens": 5,
                                                     "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
        async with http.stream("POST", "/v1/chat/completions", json={
                "messages": [{"role": "user", "content": SYSTEM}], "max_tokens": 4,
                "stream": True}) as s:
            assert s.headers["content-type"].startswith("text/event-stream")
            lines = [x async for x in s.aiter_lines() if x.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        assert json.loads(lines[0][6:])["choices"][0]["delta"]["role"] == "assistant"
        r = await http.post("/v1/messages", json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
        assert r.status_code == 200 and r.json()["type"] == "message"
        r = await http.get("/v1/models")
        assert r.status_code == 200 and r.json()["data"]
        # bad input: the backend's own 400 naming the field comes back
        r = await http.post("/v1/completions", json={"prompt": "x", "max_tokens": -1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
        r = await http.post("/v1/completions", content=b"{not json",
                            headers={"content-type": "application/json"})
        assert r.status_code == 400 and "error" in r.json()
        r = await http.post("/v1/messages", json={"messages": []})
        assert r.status_code == 400 and r.json()["type"] == "error"
        r = await http.post("/admin/drain", json={"backend": replicas[0].url})
        assert r.status_code == 404  # no --admin-key: no admin route
        r = await http.get("/v1/nowhere")
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
        r = await http.post("/v1/completions", content=b"x" * (2 << 20))
        assert r.status_code == 413
        health = await http.get("/health")
        assert health.status_code == 200
        assert set(health.json()["backends"].values()) == {"healthy"}
        metrics = (await http.get("/metrics")).text
    for rep in replicas:
        assert f'tqserve_router_backend_up{{backend="{rep.url}"}} 1' in metrics
    assert 'tqserve_router_requests_total{backend="' in metrics
    assert "tqserve_router_in_flight{" in metrics
    served = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                 if line.startswith("tqserve_router_requests_total{"))
    assert served == 6  # every proxied POST (the bad ones too) was routed once
    stats = await router.stats()  # the SSE stream released its backend when it ended
    assert all(b["num_in_flight"] == 0 for b in stats["backends"].values())


async def test_ws_bad_input_gets_error_frames_and_socket_goes_on(cluster):
    from trio_websocket import open_websocket_url

    _, router = cluster
    async with open_websocket_url(router.ws_url) as ws:
        async def ask(frame):
            await ws.send_message(frame)
            return json.loads(await ws.get_message())

        assert (await ask("{nope"))["code"] == "bad_frame"
        assert (await ask("[1]"))["code"] == "bad_frame"
        assert (await ask('{"type": "sing", "id": "a"}'))["code"] == "unknown_type"
        assert (await ask('{"type": "generate"}'))["code"] == "invalid_request"
        assert (await ask('{"type": "cancel", "id": "zz"}'))["code"] == "unknown_id"
        err = await ask(json.dumps({"type": "generate", "id": "b", "prompt": "x",
                                    "max_tokens": 0}))
        assert (err["id"], err["code"]) == ("b", "invalid_request") and "max_tokens" in err["message"]
        err = await ask(json.dumps({"type": "generate", "id": "c", "prompt": "x",
                                    "temprature": 1}))
        assert err["code"] == "invalid_request" and "temprature" in err["message"]
        big = await ask(json.dumps({"type": "generate", "id": "d", "prompt": "x" * (1 << 20)}))
        assert big["code"] == "message_too_large"
        # a valid request on the same socket still works, and a duplicate id is refused
        await ws.send_message(json.dumps({"type": "generate", "id": "e", "prompt": SYSTEM,
                                          "max_tokens": 30}))
        await ws.send_message(json.dumps({"type": "generate", "id": "e", "prompt": "x"}))
        seen = []
        while not seen or seen[-1]["type"] not in ("done",):
            seen.append(json.loads(await ws.get_message()))
        assert any(f["type"] == "error" and f["code"] == "duplicate_id" for f in seen)
        assert seen[-1]["id"] == "e" and seen[-1]["usage"]["completion_tokens"] <= 30


async def test_cancel_and_disconnect_reach_the_backend(cluster):
    from trio_websocket import open_websocket_url

    replicas, router = cluster
    async with open_websocket_url(router.ws_url) as ws:
        await ws.send_message(json.dumps({"type": "generate", "id": "k", "prompt": SYSTEM,
                                          "max_tokens": 200, "stop_token_ids": []}))
        frames = [json.loads(await ws.get_message())]
        while frames[-1]["type"] != "token":
            frames.append(json.loads(await ws.get_message()))
        await ws.send_message(json.dumps({"type": "cancel", "id": "k"}))
        while frames[-1]["type"] not in ("done", "error"):
            frames.append(json.loads(await ws.get_message()))
        assert frames[-1]["type"] == "done" and frames[-1]["finish_reason"] == "cancelled"
        assert frames[-1]["usage"]["completion_tokens"] < 200
        # a request left running when the client goes away is cancelled on its backend
        await ws.send_message(json.dumps({"type": "generate", "id": "g", "prompt": SYSTEM,
                                          "max_tokens": 200, "stop_token_ids": []}))
        while json.loads(await ws.get_message())["type"] != "token":
            pass
    async with httpx.AsyncClient() as http:
        for _ in range(200):  # bounded poll: the router sees the close, cancels, counts
            stats = await router.stats()
            if all(b["num_in_flight"] == 0 for b in stats["backends"].values()):
                break
            await trio.sleep(0.05)
        assert all(b["num_in_flight"] == 0 for b in stats["backends"].values())
        for _ in range(200):
            running = [(await http.get(r.url + "/v1/stats")).json() for r in replicas]
            if all(s["rows_active"] == 0 and s["streams_open"] == 0 for s in running):
                break
            await trio.sleep(0.05)
        assert all(s["rows_active"] == 0 and s["streams_open"] == 0 for s in running)
        metrics = "".join([(await http.get(r.url + "/metrics")).text for r in replicas])
    assert sum(s["requests_total"] for s in running) == 2
    cancelled = [line for line in metrics.splitlines() if "finished_reason=\"cancelled\"" in line
                 and not line.startswith("#")]
    assert sum(float(line.rsplit(" ", 1)[1]) for line in cancelled) == 2  # both, not run out


async def test_sse_stream_cut_after_its_first_token_ends_with_an_error_event(nursery,
                                                                          draft_model):
    replicas = [await start_replica(nursery, draft_model, max_batch=1) for _ in range(2)]
    router = await start_router(nursery, [r.url for r in replicas], health_interval=3600)
    by_url = {r.url: r for r in replicas}
    async with httpx.AsyncClient(base_url=router.url, timeout=60) as http:
        async with http.stream("POST", "/v1/chat/completions", json={
                "messages": [{"role": "user", "content": SYSTEM}], "max_tokens": 300,
                "stop_token_ids": [], "stream": True}) as s:
            lines = s.aiter_lines()
            first = await lines.__anext__()
            assert first.startswith("data: ") and "role" in first
            stats = await router.stats()
            busy = next(u for u, b in stats["backends"].items() if b["num_in_flight"])
            by_url[busy].kill()
            rest = [x async for x in lines if x.startswith("data: ")]
    last = json.loads(rest[-1][6:])
    assert last["error"]["code"] == "backend_lost" and busy in last["error"]["message"]
    assert "data: [DONE]" not in rest
    stats = await router.stats()
    assert all(b["num_in_flight"] == 0 for b in stats["backends"].values())
    assert stats["backends"][busy]["state"] == "unhealthy"


async def test_router_key_and_backend_key(nursery, draft_model):
    from trio_websocket import ConnectionRejected, open_websocket_url

    replicas = [await start_replica(nursery, draft_model, api_key="backend-key")
                for _ in range(2)]
    router = await start_router(nursery, [r.url for r in replicas], api_key="router-key",
                                backend_api_key="backend-key")
    async with httpx.AsyncClient(base_url=router.url, timeout=60) as http:
        assert (await http.get("/health")).status_code == 200  # open, as on the server
        r = await http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized"
        assert (await http.get("/v1/stats")).status_code == 401
        for headers in ({"Authorization": "Bearer router-key"}, {"x-api-key": "router-key"}):
            r = await http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2},
                                headers=headers)
            assert r.status_code == 200, r.text  # the router's key went to the backend
    with pytest.raises(ConnectionRejected) as refused:
        async with open_websocket_url(router.ws_url):
            pass
    assert refused.value.status_code == 401
    async with Client.connect(router.ws_url, api_key="router-key") as client:
        events = [e async for e in client.generate(prompt="x", max_tokens=2)]
    assert isinstance(events[-1], DoneEvent)


async def test_streams_per_connection_limit(cluster, nursery):
    from trio_websocket import open_websocket_url

    replicas, _ = cluster
    router = await start_router(nursery, [r.url for r in replicas],
                                max_streams_per_connection=1)
    async with open_websocket_url(router.ws_url) as ws:
        await ws.send_message(json.dumps({"type": "generate", "id": "a", "prompt": SYSTEM,
                                          "max_tokens": 20}))
        await ws.send_message(json.dumps({"type": "generate", "id": "b", "prompt": "x"}))
        frames = []
        while not frames or frames[-1]["type"] != "done":
            frames.append(json.loads(await ws.get_message()))
        refused = [f for f in frames if f["type"] == "error"]
        assert [(f["id"], f["code"]) for f in refused] == [("b", "too_many_streams")]
        assert frames[-1]["id"] == "a"
