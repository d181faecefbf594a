"""The Ray Serve deployment: each replica one tqserve engine and its app (api.app).

A replica starts trio as a guest in its asyncio loop (api.rayserve.guest), opens the engine
there and serves the same quart-trio app as `tqserve serve` (create_app: the OpenAI and
Anthropic HTTP APIs, WebSocket /v1/stream, /health, /v1/stats, /metrics), behind Ray
Serve's HTTP proxy. The lifespan protocol is answered here: shutdown is the engine's clean
shutdown (api.server.close_app), within Ray's graceful_shutdown_timeout_s.

Ray reads each replica's health from `check_health` (the guest run still going, the engine
admitting) and its load from `record_routing_stats` (rows and queue: what a request router
or an operator reads). Autoscaling is Ray's, on ongoing requests per replica: a request
running or queued in the engine counts, so `target_ongoing_requests` is a queue depth.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import attrs
import trio
from ray import serve
from ray.serve.config import AutoscalingConfig

from tqserve.api.rayserve.guest import GuestEnded, GuestRun, Message

log = logging.getLogger("tqserve.rayserve")
APP_NAME = "tqserve"
DEPLOYMENT_NAME = "TqserveReplica"
HEALTH_PERIOD = 2.0    # seconds between Ray's health checks of a replica
HEALTH_TIMEOUT = 10.0  # seconds a health check may take before the replica counts as dead


def _at_least(low: float, flag: str) -> Any:
    def check(_inst: Any, _attr: Any, value: float) -> None:
        if value < low:
            raise ValueError(f"{flag} must be >= {low:g}, got {value:g}")
    return check


@attrs.frozen(kw_only=True)
class RayServeConfig:
    """How many replicas, their resources and Ray Serve's limits (the CLI's flags 1:1)."""

    num_replicas: int = attrs.field(default=1, validator=_at_least(1, "--replicas"))
    # autoscaling between num_replicas and max_replicas when max_replicas > num_replicas
    max_replicas: int = attrs.field(default=0, validator=_at_least(0, "--max-replicas"))
    target_ongoing_requests: int = attrs.field(
        default=0, validator=_at_least(0, "--target-ongoing-requests"))
    num_cpus: float = attrs.field(default=1.0, validator=_at_least(0, "--num-cpus"))
    num_gpus: float = attrs.field(default=0.0, validator=_at_least(0, "--num-gpus"))
    max_ongoing_requests: int = attrs.field(default=0,
                                            validator=_at_least(0, "--max-ongoing-requests"))
    route_prefix: str = "/"

    def __attrs_post_init__(self) -> None:
        if self.max_replicas and self.max_replicas < self.num_replicas:
            raise ValueError(f"--max-replicas ({self.max_replicas}) is below --replicas "
                             f"({self.num_replicas})")
        if not self.route_prefix.startswith("/"):
            raise ValueError(f"--route-prefix must start with '/', got {self.route_prefix!r}")


async def _run_engine(config: Any, stop: trio.Event, *,
                      task_status: trio.TaskStatus[Any] = trio.TASK_STATUS_IGNORED) -> None:
    """Inside the guest: the engine and its app until `stop`, then a clean shutdown."""
    from tqserve.actors.engine import open_engine
    from tqserve.api.app import Connections, create_app
    from tqserve.api.server import close_app

    async with open_engine(config) as engine:
        connections = Connections()
        task_status.started((engine, create_app(engine, connections)))
        await stop.wait()
        report = await close_app(engine, connections, config.shutdown_timeout)
        log.warning("engine shut down: %d requests in flight, %d ended at the "
                    "--shutdown-timeout", report.num_in_flight, report.num_ended)


@serve.ingress()
class TqserveReplica:
    """One replica: a tqserve engine, its HTTP/WebSocket app, its health and load."""

    async def __init__(self, config: Any) -> None:
        self._config = config
        self._guest = GuestRun()
        self._engine, self._app = await self._guest.start(
            functools.partial(_run_engine, config))

    async def __serve_build_asgi_app__(self) -> Any:
        async def app(scope: Message, receive: Any, send: Any) -> None:
            await self._asgi(scope, receive, send)

        return app  # a plain coroutine function: uvicorn takes a bound method for ASGI 2

    async def _asgi(self, scope: Message, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        await self._guest.asgi(self._app, scope, receive, send)

    async def _lifespan(self, receive: Any, send: Any) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self._guest.stop()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def check_health(self) -> None:
        """Raise (Ray then replaces the replica) when the engine has stopped or failed."""
        if not self._guest.running:
            raise GuestEnded("the engine stopped")
        failed = await self._guest.call(lambda: self._engine.group_failed.error)
        if failed is not None:
            raise GuestEnded(f"the tensor-parallel group failed: {failed}")

    async def record_routing_stats(self) -> dict[str, Any]:
        """The replica's load, read by Ray Serve's request routers (and the tests)."""
        stats = await self._guest.call(self._engine.statistics)
        return {"rows_active": stats.rows_active, "rows_queued": stats.rows_queued,
                "kv_bytes": stats.kv_bytes, "streams_open": stats.streams_open,
                "requests_total": stats.requests_total}


def build_app(config: Any, ray_config: RayServeConfig) -> Any:
    """The bound Ray Serve application: `serve.run(build_app(...))`."""
    per_replica = config.max_batch + config.max_queued_requests  # what admission holds
    options: dict[str, Any] = {
        "name": DEPLOYMENT_NAME,
        "ray_actor_options": {"num_cpus": ray_config.num_cpus,
                              "num_gpus": ray_config.num_gpus},
        "max_ongoing_requests": ray_config.max_ongoing_requests or per_replica,
        "health_check_period_s": HEALTH_PERIOD,
        "health_check_timeout_s": HEALTH_TIMEOUT,
        "graceful_shutdown_timeout_s": config.shutdown_timeout + 5.0,
    }
    if ray_config.max_replicas > ray_config.num_replicas:
        options["autoscaling_config"] = AutoscalingConfig(
            min_replicas=ray_config.num_replicas, max_replicas=ray_config.max_replicas,
            initial_replicas=ray_config.num_replicas,
            target_ongoing_requests=ray_config.target_ongoing_requests or config.max_batch)
    else:
        options["num_replicas"] = ray_config.num_replicas
    return serve.deployment(TqserveReplica).options(**options).bind(config)
