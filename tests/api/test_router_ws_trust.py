"""The router's WebSocket links to backends that misbehave: one that accepts the socket and
never answers (the client gets `backend_timeout`, the link is dropped, nothing leaks), and
ones that break the socket once they have a request (`backend_failed`, never resent).

The hostile backends are real quart-trio apps on hypercorn, on loopback ports: /health
answers 200, so the router routes to them; /v1/stream accepts the WebSocket and then
misbehaves. The healthy backend is a real replica of the bundled model.
"""

from __future__ import annotations

from typing import Any

import httpx
import msgpack
import pytest
import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve as hypercorn_serve
from quart import websocket
from quart_trio import QuartTrio

from tests.api.routerkit import start_replica, start_router
from tqserve.client import Client, DoneEvent, ErrorEvent, QueuedEvent

PROMPTS = [f"def handler_{i}(request):\n    " for i in range(4)]
MODES = ("silent", "close", "queue_then_close", "going_away")


class HostileBackend:
    """A backend on loopback whose /v1/stream accepts the WebSocket, counts the frames it
    gets, and per `mode`: `silent` answers nothing; `close` closes the socket on the first
    generate; `queue_then_close` sends `queued` for it, then closes; `going_away` answers
    every generate with the error `shutting_down` (it never ran it)."""

    def __init__(self, mode: str) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}")
        self.mode = mode
        self.url = ""
        self.sockets = 0
        self.frames: dict[str, int] = {"generate": 0, "cancel": 0}

    async def start(self, nursery: trio.Nursery) -> str:
        config = HypercornConfig()
        config.bind = ["127.0.0.1:0"]
        app = self._app()
        binds = await nursery.start(lambda task_status: hypercorn_serve(
            app, config, task_status=task_status))  # type: ignore[arg-type]
        self.url = binds[0]
        return self.url

    def _app(self) -> QuartTrio:
        app = QuartTrio("hostile-backend")

        @app.get("/health")
        async def health() -> Any:
            return {"status": "ok"}

        @app.websocket("/v1/stream")
        async def stream() -> None:
            await websocket.accept()
            self.sockets += 1
            while True:
                frame = msgpack.unpackb(await websocket.receive(), raw=False)
                self.frames[frame["type"]] = self.frames.get(frame["type"], 0) + 1
                if frame["type"] != "generate" or self.mode == "silent":
                    continue
                if self.mode == "going_away":
                    await websocket.send(msgpack.packb({
                        "type": "error", "id": frame["id"], "code": "shutting_down",
                        "message": "the server is shutting down"}))
                    continue
                if self.mode == "queue_then_close":
                    await websocket.send(msgpack.packb({"type": "queued", "id": frame["id"]}))
                await websocket.close(1011, "died handling it")
                return

        return app


async def _ask(client: Client, prompt: str) -> list[Any]:
    with trio.fail_after(60):  # a hang guard, not a measurement
        return [e async for e in client.generate(prompt=prompt, max_tokens=2)]


async def _backend_requests(url: str) -> int:
    async with httpx.AsyncClient() as http:
        return (await http.get(url + "/v1/stats")).json()["requests_total"]


def _no_leak(stats: dict[str, Any]) -> None:
    assert all(b["num_in_flight"] == 0 for b in stats["backends"].values()), stats
    assert sum(stats["links"]["num_streams"].values()) == 0, stats["links"]


async def test_a_silent_backend_times_out_and_the_router_goes_on(nursery, draft_model):
    """Round-robin over a silent backend and a replica: the silent one's requests end with
    backend_timeout naming it and the timeout, each is cancelled there and its link
    dropped; the replica's are served; no request state is left."""
    hostile = HostileBackend("silent")
    replica = await start_replica(nursery, draft_model)
    router = await start_router(nursery, [await hostile.start(nursery), replica.url],
                                routing={"policy": "round-robin"}, health_interval=3600,
                                backend_read_timeout=3.0)
    async with Client.connect(router.ws_url) as client:
        ends = [(await _ask(client, p))[-1] for p in PROMPTS]
    timeouts = ends[0::2]  # round-robin: the hostile backend is first
    for end in timeouts:
        assert isinstance(end, ErrorEvent) and end.code == "backend_timeout", end
        assert hostile.url in end.message and "3 s" in end.message, end.message
        assert "--backend-read-timeout" in end.message
    assert all(isinstance(e, DoneEvent) and e.completion_tokens == 2 for e in ends[1::2])
    assert await _backend_requests(replica.url) == 2
    with trio.fail_after(10):  # the last cancel is on its way while the replica serves
        while hostile.frames["cancel"] < 2:
            await trio.sleep(0.01)
    assert hostile.frames == {"generate": 2, "cancel": 2}  # told to stop each
    assert hostile.sockets == 2  # the first link was dropped: the second request reopened
    stats = await router.stats()
    _no_leak(stats)
    assert stats["links"]["num_links"][hostile.url] == 0
    assert stats["rejections"] == {"backend_timeout": 2}
    assert stats["backends"][hostile.url]["num_failures"] == 0  # slow, not broken
    async with httpx.AsyncClient() as http:
        metrics = (await http.get(router.url + "/metrics")).text
    assert 'tqserve_router_rejections_total{code="backend_timeout"} 2' in metrics
    assert f'tqserve_router_in_flight{{backend="{hostile.url}"}} 0' in metrics


@pytest.mark.parametrize("mode", ["close", "queue_then_close"])
async def test_a_request_its_backend_failed_on_is_not_resent(nursery, draft_model, mode):
    """A backend that breaks its WebSocket once it has a generate (queued or not): the
    client gets backend_failed, the healthy replica never gets that request, and the
    failure is counted once."""
    hostile = HostileBackend(mode)
    replica = await start_replica(nursery, draft_model)
    router = await start_router(nursery, [await hostile.start(nursery), replica.url],
                                routing={"policy": "round-robin"}, health_interval=3600)
    async with Client.connect(router.ws_url) as client:
        failed = await _ask(client, PROMPTS[0])  # round-robin: to the hostile backend
        served = await _ask(client, PROMPTS[1])  # it is down now: to the replica
    end = failed[-1]
    assert isinstance(end, ErrorEvent) and end.code == "backend_failed", end
    assert hostile.url in end.message and "not retried" in end.message
    assert [type(e) for e in failed[:-1]] == ([QueuedEvent] if mode != "close" else [])
    assert isinstance(served[-1], DoneEvent)
    assert hostile.frames["generate"] == 1
    assert await _backend_requests(replica.url) == 1  # only the second request
    stats = await router.stats()
    _no_leak(stats)
    assert stats["rejections"] == {"backend_failed": 1}
    assert stats["num_retries"] == 0
    assert stats["backends"][hostile.url]["num_failures"] == 1
    assert stats["backends"][hostile.url]["state"] == "unhealthy"


async def test_a_request_its_backend_refused_while_stopping_moves(nursery, draft_model):
    """A backend that answers `shutting_down` never ran the request: it moves to the
    replica, which serves it; the client sees no error."""
    hostile = HostileBackend("going_away")
    replica = await start_replica(nursery, draft_model)
    router = await start_router(nursery, [await hostile.start(nursery), replica.url],
                                routing={"policy": "round-robin"}, health_interval=3600)
    async with Client.connect(router.ws_url) as client:
        events = await _ask(client, PROMPTS[0])
    assert isinstance(events[-1], DoneEvent) and events[-1].completion_tokens == 2
    assert not any(isinstance(e, ErrorEvent) for e in events)
    assert hostile.frames["generate"] == 1 and await _backend_requests(replica.url) == 1
    stats = await router.stats()
    _no_leak(stats)
    assert stats["num_retries"] == 1 and stats["rejections"] == {}
