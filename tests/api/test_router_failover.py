"""The router when a replica dies mid-run (no request lost) and when it drains."""

from __future__ import annotations

import httpx
import trio

from tests.api.routerkit import start_replica, start_router
from tqserve.client import Client, ConnectionLost, DoneEvent, ErrorEvent, TokenEvent

PROMPTS = [f"def handler_{i}(request):\n    " for i in range(9)]


async def test_replica_killed_mid_run_loses_no_request(nursery, draft_model):
    # one row per replica: each has one request decoding and two waiting when it dies
    replicas = [await start_replica(nursery, draft_model, max_batch=1) for _ in range(3)]
    router = await start_router(nursery, [r.url for r in replicas], health_interval=0.05)
    results: dict[int, list] = {}
    first_token = trio.Event()

    async def one(client, i):
        events = []
        async for event in client.generate(prompt=PROMPTS[i], max_tokens=24, temperature=0):
            events.append(event)
            if isinstance(event, TokenEvent):
                first_token.set()
        results[i] = events

    async with Client.connect(router.ws_url) as client:
        async with trio.open_nursery() as inner:
            for i in range(len(PROMPTS)):
                inner.start_soon(one, client, i)
            await first_token.wait()
            replicas[0].kill()
    assert len(results) == len(PROMPTS)
    lost = []
    for i, events in results.items():
        end = events[-1]
        tokens = [e for e in events if isinstance(e, TokenEvent)]
        if isinstance(end, ErrorEvent):  # only a request on the dead replica: streaming
            # (lost), or sent there before its first token (failed: it may be what the
            # backend died of, so the router never resends it; api/router)
            assert replicas[0].url in end.message, end
            assert (end.code == "backend_lost" and tokens) or (
                end.code == "backend_failed" and not tokens), (end.code, len(tokens))
            lost.append(i)
        else:
            assert isinstance(end, DoneEvent) and end.completion_tokens == len(tokens) > 0
            assert [e.index for e in tokens] == list(range(len(tokens)))  # no duplicate
    # at most the one request replica 0 was decoding had tokens (the kill comes at the
    # first token anywhere); its waiting ones had none
    assert len([i for i in lost if isinstance(results[i][-1], ErrorEvent)
                and results[i][-1].code == "backend_lost"]) <= 1
    stats = await router.stats()
    dead = stats["backends"][replicas[0].url]
    failed = [i for i in lost if results[i][-1].code == "backend_failed"]
    # replica 0's two waiting requests failed (it had them), or moved if never sent there
    assert stats["num_retries"] + len(failed) >= 2 and dead["num_failures"] >= 1
    assert dead["state"] == "unhealthy" and dead["num_owned_keys"] == 0
    assert all(b["num_in_flight"] == 0 for b in stats["backends"].values())
    async with httpx.AsyncClient() as http:
        health = (await http.get(router.url + "/health")).json()
        assert health["status"] == "ok" and health["backends"][replicas[0].url] == "unhealthy"
        metrics = (await http.get(router.url + "/metrics")).text
        served = [(await http.get(r.url + "/v1/stats")).json()["requests_total"]
                  for r in replicas[1:]]
    assert sum(served) == len(results) - len(lost)  # none of replica 0's was resent
    assert f'tqserve_router_backend_up{{backend="{replicas[0].url}"}} 0' in metrics
    assert "tqserve_router_retries_total " in metrics
    # with every replica gone: a clear error, never a hang
    for r in replicas[1:]:
        r.kill()
    async with Client.connect(router.ws_url) as client:
        events = [e async for e in client.generate(prompt="x", max_tokens=2)]
    assert isinstance(events[-1], ErrorEvent) and events[-1].code == "no_healthy_backend"
    async with httpx.AsyncClient() as http:
        r = await http.post(router.url + "/v1/completions", json={"prompt": "x"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_healthy_backend"
        assert (await http.get(router.url + "/health")).status_code == 503


async def test_router_drain_finishes_in_flight_and_refuses_new(nursery, draft_model):
    replicas = [await start_replica(nursery, draft_model) for _ in range(2)]
    router = await start_router(nursery, [r.url for r in replicas])
    results = {}
    streaming = trio.Event()

    async def one(client, i):
        events = []
        try:
            async for event in client.generate(prompt=PROMPTS[i], max_tokens=40,
                                               temperature=0):
                events.append(event)
                streaming.set()
        except ConnectionLost:
            events.append("lost")
        results[i] = events

    async with Client.connect(router.ws_url) as client:
        async with trio.open_nursery() as inner:
            for i in range(3):
                inner.start_soon(one, client, i)
            await streaming.wait()
            router.trigger.set()  # as SIGTERM does in `tqserve route`
            async with httpx.AsyncClient() as http:
                health = await http.get(router.url + "/health")
            assert health.status_code == 503 and health.json()["status"] == "shutting_down"
            late = [e async for e in client.generate(prompt="x", max_tokens=2)]
            assert isinstance(late[-1], ErrorEvent) and late[-1].code == "shutting_down"
    for events in results.values():
        assert isinstance(events[-1], DoneEvent), events[-1]
        assert events[-1].completion_tokens == sum(isinstance(e, TokenEvent) for e in events)


async def test_dead_replica_not_yet_noticed_is_skipped_over(nursery, draft_model):
    """A replica that died between health checks: HTTP and WebSocket requests routed to it
    are retried on the others (its connection refused), and it is marked down at once."""
    replicas = [await start_replica(nursery, draft_model) for _ in range(3)]
    router = await start_router(nursery, [r.url for r in replicas], health_interval=3600)
    replicas[0].kill()
    async with httpx.AsyncClient(base_url=router.url, timeout=60) as http:
        for i in range(3):  # least-loaded ties rotate: one of these picks replica 0
            r = await http.post("/v1/completions", json={"prompt": PROMPTS[i],
                                                         "max_tokens": 2})
            assert r.status_code == 200, r.text
    stats = await router.stats()
    assert stats["num_retries"] == 1
    assert stats["backends"][replicas[0].url]["state"] == "unhealthy"
    # the same over the WebSocket, with replica 1 now dead too
    replicas[1].kill()
    async with Client.connect(router.ws_url) as client:
        for i in range(2):
            events = [e async for e in client.generate(prompt=PROMPTS[i], max_tokens=2)]
            assert isinstance(events[-1], DoneEvent)
    stats = await router.stats()
    assert stats["num_retries"] == 2
    assert stats["backends"][replicas[1].url]["state"] == "unhealthy"


async def test_admin_drains_one_backend(nursery, draft_model):
    replicas = [await start_replica(nursery, draft_model) for _ in range(2)]
    router = await start_router(nursery, [r.url for r in replicas], admin_key="sesame",
                                health_interval=0.05)
    auth = {"Authorization": "Bearer sesame"}
    async with httpx.AsyncClient(base_url=router.url, timeout=60) as http, \
            Client.connect(router.ws_url) as client:
        r = await http.post("/admin/drain", json={"backend": replicas[0].url})
        assert r.status_code == 401
        r = await http.post("/admin/drain", json={"backend": "http://elsewhere:1"},
                            headers=auth)
        assert r.status_code == 400 and "backend must be one of" in r.json()["error"]["message"]
        long = client.generate(prompt=PROMPTS[0], max_tokens=40, temperature=0)
        first = [await long.__anext__()]
        while not isinstance(first[-1], TokenEvent):
            first.append(await long.__anext__())
        busy = next(u for u, b in (await router.stats())["backends"].items()
                    if b["num_in_flight"])
        r = await http.post("/admin/drain", json={"backend": busy}, headers=auth)
        assert r.json() == {"backend": busy, "state": "draining", "in_flight": 1}
        for i in range(1, 4):  # new requests all go to the other replica
            events = [e async for e in client.generate(prompt=PROMPTS[i], max_tokens=2)]
            assert isinstance(events[-1], DoneEvent)
        rest = [e async for e in long]
        assert isinstance(rest[-1], DoneEvent)  # the drained backend's request finished
        stats = (await router.stats())["backends"]
        assert sum(stats[busy]["num_routed"].values()) == 1
        assert stats[busy]["state"] == "draining"  # health checks leave it draining
        r = await http.post("/admin/drain", json={"backend": busy, "drain": False},
                            headers=auth)
        assert r.json()["state"] == "unknown"
        for _ in range(200):  # the next health check (every 0.05 s) brings it back
            if (await router.stats())["backends"][busy]["state"] == "healthy":
                break
            await trio.sleep(0.05)
        assert (await router.stats())["backends"][busy]["state"] == "healthy"


async def test_replica_shutting_down_is_retried_elsewhere(nursery, draft_model):
    """A replica in its clean shutdown (SIGTERM; it still finishes a request) answers
    new requests with 503 / shutting_down: the router moves them before any token."""
    replicas = [await start_replica(nursery, draft_model) for _ in range(2)]
    router = await start_router(nursery, [r.url for r in replicas], health_interval=3600)
    async with Client.connect(replicas[0].url.replace("http", "ws") + "/v1/stream") as direct:
        long = direct.generate(prompt=PROMPTS[0], max_tokens=4000, stop_token_ids=[])
        while not isinstance(await long.__anext__(), TokenEvent):
            pass
        replicas[0].stop.set()  # it drains: the long request holds it in shutdown
        async with httpx.AsyncClient() as http:
            for _ in range(200):  # bounded poll until the replica reports its shutdown
                if (await http.get(replicas[0].url + "/health")).status_code == 503:
                    break
                await trio.sleep(0.01)
            for i in range(2):  # ties rotate: one of the two picks replica 0
                r = await http.post(router.url + "/v1/completions",
                                    json={"prompt": PROMPTS[i], "max_tokens": 2})
                assert r.status_code == 200, r.text
        stats = await router.stats()
        assert stats["num_retries"] == 1
        assert stats["backends"][replicas[0].url]["state"] == "unhealthy"
        await long.aclose()
