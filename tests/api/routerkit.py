"""Test helpers for the router: N real replicas on loopback ports and a real router."""

from __future__ import annotations

from typing import Any

import httpx
import trio

from tests.conftest import server_config
from tqserve.api.router.app import serve_router
from tqserve.api.router.core import RoutingConfig
from tqserve.api.router.service import RouterConfig
from tqserve.api.server import serve
from tqserve.engine.model import LoadedModel


class Replica:
    """A real tqserve server that a test can kill (cancel) at any moment."""

    def __init__(self, url: str, scope: trio.CancelScope, stop: trio.Event) -> None:
        self.url = url
        self.scope = scope
        self.stop = stop  # set: a clean shutdown, as SIGTERM on `tqserve serve`

    def kill(self) -> None:
        self.scope.cancel()


async def start_replica(nursery: trio.Nursery, loaded: LoadedModel, **config: Any) -> Replica:
    scope = trio.CancelScope()
    stop = trio.Event()
    cfg = server_config(**config)

    async def run(task_status: trio.TaskStatus[str]) -> None:
        with scope:
            await serve(cfg, loaded=loaded, shutdown_trigger=stop, task_status=task_status)

    return Replica(await nursery.start(run), scope, stop)


class RouterUnderTest:
    def __init__(self, url: str, trigger: trio.Event) -> None:
        self.url = url
        self.ws_url = url.replace("http://", "ws://") + "/v1/stream"
        self.trigger = trigger

    async def stats(self) -> dict[str, Any]:
        async with httpx.AsyncClient() as client:
            return (await client.get(self.url + "/v1/stats")).json()


async def start_router(nursery: trio.Nursery, backends: list[str], *,
                       routing: dict[str, Any] | None = None, **config: Any) -> RouterUnderTest:
    trigger = trio.Event()
    cfg = RouterConfig(backends=tuple(backends), routing=RoutingConfig(**(routing or {})),
                       port=0, **config)
    url = await nursery.start(lambda task_status: serve_router(
        cfg, shutdown_trigger=trigger, task_status=task_status))
    return RouterUnderTest(url, trigger)
