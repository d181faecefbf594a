"""The Ray Serve application: a front (the ingress) and the replicas, each one engine.

A replica starts trio as a guest in its asyncio loop (api.rayserve.guest), opens the engine
there and runs the same quart-trio app as `tqserve serve` (create_app: the OpenAI and
Anthropic HTTP APIs, WebSocket /v1/stream, /health, /v1/stats, /metrics). The front
(api.rayserve.front) is the application's ingress behind Ray Serve's HTTP proxy: it reads
each request, keys it by prompt and calls a replica through a handle (`http`, `ws`,
`cancel`: api.rayserve.relay), whose request router (api.rayserve.routing.PrefixRouter, or
Ray's power-of-two with `router="pow2"`, routing.Pow2Router) picks the replica.
Ray's graceful shutdown calls `__del__`: the engine's clean shutdown
(api.server.close_app), within graceful_shutdown_timeout_s.

Ray reads each replica's health from `check_health` (the guest run still going, the engine
admitting) and its load and KV events from `record_routing_stats` (rows and queue, and
the last KV_WINDOW batches of the prefix cache's KV events, every STATS_PERIOD seconds:
what the prefix router reads). Autoscaling is Ray's, on ongoing requests per replica (a
request running or queued in the engine counts, so `target_ongoing_requests` is a queue
depth), or with `autoscale_metric="queue"` on the engines' own rows running and queued
(`record_autoscaling_stats`, api.rayserve.autoscale's policy).
"""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING, Any

import attrs
import trio
from ray import serve
from ray.serve.config import AutoscalingConfig, AutoscalingPolicy

from tqserve.api.rayserve.autoscale import POLICY, QUEUE_METRIC
from tqserve.api.rayserve.guest import GuestEnded, GuestRun
from tqserve.api.rayserve.relay import (CancelCall, HttpCall, WsCall, WsRequests,
                                        response_id_prefix, serve_http)
from tqserve.engine.kvevents import BLOCK_TOKENS, BlockRemoved, BlockStored

if TYPE_CHECKING:
    from tqserve.api.config import ServerConfig

log = logging.getLogger("tqserve.rayserve")
KV_BLOCK_TOKENS = BLOCK_TOKENS  # the KV events' block: the routers' keys use it too
APP_NAME = "tqserve"
DEPLOYMENT_NAME = "TqserveReplica"
HEALTH_PERIOD = 2.0    # seconds between Ray's health checks of a replica
HEALTH_TIMEOUT = 10.0  # seconds a health check may take before the replica counts as dead
STATS_PERIOD = 1.0     # seconds between routing-stats reports (what routers know of KV)
KV_WINDOW = 256        # KV event batches each report carries (a router applies the new ones)
ROUTERS = ("prefix", "pow2")  # tqserve's prefix policy, or Ray's power-of-two default
# what autoscaling counts per replica: Ray's ongoing requests, or the engine's rows
AUTOSCALE_METRICS = ("ongoing", "queue")


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
    autoscale_metric: str = attrs.field(default="ongoing",
                                        validator=attrs.validators.in_(AUTOSCALE_METRICS))
    num_cpus: float = attrs.field(default=1.0, validator=_at_least(0, "--num-cpus"))
    num_gpus: float = attrs.field(default=0.0, validator=_at_least(0, "--num-gpus"))
    max_ongoing_requests: int = attrs.field(default=0,
                                            validator=_at_least(0, "--max-ongoing-requests"))
    route_prefix: str = "/"
    router: str = attrs.field(default="prefix", validator=attrs.validators.in_(ROUTERS))
    front_replicas: int = attrs.field(default=1, validator=_at_least(1, "--front-replicas"))
    # the prefix router's (api.router.cost): a replica this many requests busier than the
    # least loaded one is not a candidate, whatever it holds
    spill_threshold: int = attrs.field(default=8, validator=_at_least(1, "--spill-threshold"))

    def __attrs_post_init__(self) -> None:
        if self.max_replicas and self.max_replicas < self.num_replicas:
            raise ValueError(f"--max-replicas ({self.max_replicas}) is below --replicas "
                             f"({self.num_replicas})")
        if self.autoscale_metric != "ongoing" and self.max_replicas <= self.num_replicas:
            raise ValueError(f"--autoscale-metric {self.autoscale_metric} needs --max-replicas "
                             "above --replicas (it picks what autoscaling counts)")
        if not self.route_prefix.startswith("/"):
            raise ValueError(f"--route-prefix must start with '/', got {self.route_prefix!r}")


async def _run_engine(config: ServerConfig, replica: str, stop: trio.Event, *,
                      task_status: trio.TaskStatus[Any] = trio.TASK_STATUS_IGNORED) -> None:
    """Inside the guest: the engine and its app until `stop`, then a clean shutdown. The
    app's response ids carry the replica's name (the front pins follow-ups by it)."""
    from tqserve.actors.engine import open_engine
    from tqserve.api.app import Connections, create_app
    from tqserve.api.server import close_app

    async with open_engine(config.engine) as engine:
        connections = Connections()
        app = create_app(engine, config, connections,
                         response_id_prefix=response_id_prefix(replica))
        task_status.started((engine, app))
        await stop.wait()
        report = await close_app(engine, connections, config.shutdown_timeout)
        log.warning("engine shut down: %d requests in flight, %d ended at the "
                    "--shutdown-timeout", report.num_in_flight, report.num_ended)


class TqserveReplica:
    """One replica: a tqserve engine, its HTTP/WebSocket app, its health and load. The
    front (api.rayserve.front) calls it; Ray Serve's graceful shutdown calls `__del__`,
    which is the engine's clean shutdown."""

    async def __init__(self, config: ServerConfig) -> None:
        self._config = config
        self._guest = GuestRun()
        self._ws = WsRequests()
        replica = serve.get_replica_context().replica_id.unique_id
        self._engine, self._app = await self._guest.start(
            functools.partial(_run_engine, config, replica))
        self._metrics = RayMetrics(replica)

    async def __del__(self) -> None:
        await self._guest.stop()

    async def http(self, call: HttpCall) -> Any:
        """One HTTP request from the front: the app's ASGI messages (api.rayserve.relay)."""
        async for message in serve_http(self._guest, self._app, call):
            yield message

    async def ws(self, call: WsCall) -> Any:
        """One WebSocket generate request from the front: this replica's id, then frames."""
        yield {"replica": serve.get_replica_context().replica_id.unique_id}
        async for frame in self._ws.serve(self._guest, self._app, call):
            yield frame

    async def cancel(self, call: CancelCall) -> bool:
        """A client's cancel of a WebSocket request running here."""
        return self._ws.cancel(call)

    async def check_health(self) -> None:
        """Raise (Ray then replaces the replica) when the engine has stopped or failed."""
        if not self._guest.running:
            raise GuestEnded("the engine stopped")
        failed = await self._guest.call(lambda: self._engine.group_failed.error)
        if failed is not None:
            raise GuestEnded(f"the tensor-parallel group failed: {failed}")

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """The engine's rows running and queued: what `--autoscale-metric queue` scales on
        (api.rayserve.autoscale). Ray calls it only for an autoscaling deployment."""
        stats = await self._guest.call(self._engine.statistics)
        return {QUEUE_METRIC: float(stats.rows_active + stats.rows_queued)}

    async def record_routing_stats(self) -> dict[str, Any]:
        """The replica's load, read by Ray Serve's request routers (and the tests)."""
        stats, window = await self._guest.call(
            lambda: (self._engine.statistics(), kv_window(self._engine)))
        report = {"rows_active": stats.rows_active, "rows_queued": stats.rows_queued,
                  "kv_bytes": stats.kv_bytes, "streams_open": stats.streams_open,
                  "requests_total": stats.requests_total}
        self._metrics.set(report, window)
        return {**report, **window}


class RayMetrics:
    """The replica's load as Ray metrics, so Ray's own Prometheus export (every node's
    metrics agent) carries every replica at once, tagged `replica`. Names are vLLM's with
    `_` for `:` (Ray refuses colons; its exporter adds `ray_`): e.g.
    `ray_vllm_num_requests_running`. Set at each routing-stats report (STATS_PERIOD)."""

    GAUGES = {  # metric -> (description, the report's field)
        "vllm_num_requests_running": ("Requests in the running batch", "rows_active"),
        "vllm_num_requests_waiting": ("Requests waiting to run", "rows_queued"),
        "tqserve_kv_bytes": ("KV cache bytes the rows hold", "kv_bytes"),
        "tqserve_streams_open": ("Open client streams", "streams_open"),
        "tqserve_requests_total": ("Requests admitted since start", "requests_total"),
    }

    def __init__(self, replica: str) -> None:
        from ray.util.metrics import Gauge

        self._tags = {"replica": replica}
        self._gauges = {name: Gauge(name, description=text, tag_keys=("replica",))
                        for name, (text, _) in self.GAUGES.items()}
        self._blocks = Gauge("tqserve_prefix_blocks",
                             description="16-token blocks the prefix cache holds (KV events)",
                             tag_keys=("replica",))

    def set(self, report: dict[str, Any], window: dict[str, Any]) -> None:
        for name, (_, field) in self.GAUGES.items():
            self._gauges[name].set(float(report[field]), tags=self._tags)
        self._blocks.set(float(window.get("kv_blocks", 0)), tags=self._tags)


def kv_window(engine: Any) -> dict[str, Any]:
    """The last KV_WINDOW batches of the engine's KV events (engine.kvevents), compact:
    `kv_next` (the last batch's seq), `kv_batches` [(seq, stored block hashes, removed
    block hashes)] and `kv_blocks` (blocks held); nothing with the prefix cache off."""
    page = engine.kv_events(0)
    if page is None:
        return {}
    batches = []
    for batch in page.batches[-KV_WINDOW:]:
        stored = [h for e in batch.events if isinstance(e, BlockStored) for h in e.block_hashes]
        removed = [h for e in batch.events if isinstance(e, BlockRemoved)
                   for h in e.block_hashes]
        batches.append((batch.seq, stored, removed))
    return {"kv_next": page.next, "kv_batches": batches, "kv_blocks": page.num_blocks}


def _replica_options(config: ServerConfig, ray_config: RayServeConfig) -> dict[str, Any]:
    from ray.serve.config import RequestRouterConfig

    from tqserve.api.rayserve.routing import POW2_ROUTER_CLASS, ROUTER_CLASS

    engine = config.engine
    per_replica = engine.max_batch + engine.max_queued_requests  # what admission holds
    router: dict[str, Any] = {"request_routing_stats_period_s": STATS_PERIOD,
                              "request_routing_stats_timeout_s": HEALTH_TIMEOUT}
    if ray_config.router == "prefix":
        router.update(request_router_class=ROUTER_CLASS,
                      request_router_kwargs={
                          "block_tokens": KV_BLOCK_TOKENS,
                          "spill_threshold": ray_config.spill_threshold})
    else:  # Ray's default, honouring the front's pins (api.rayserve.routing)
        router.update(request_router_class=POW2_ROUTER_CLASS)
    options: dict[str, Any] = {
        "name": DEPLOYMENT_NAME,
        "ray_actor_options": {"num_cpus": ray_config.num_cpus,
                              "num_gpus": ray_config.num_gpus},
        "max_ongoing_requests": ray_config.max_ongoing_requests or per_replica,
        # beyond what the replicas hold, each front queues at most what one server would
        # (--max-queued-requests); more are refused 429 `overloaded`, never left to wait
        "max_queued_requests": engine.max_queued_requests,
        "health_check_period_s": HEALTH_PERIOD,
        "health_check_timeout_s": HEALTH_TIMEOUT,
        "graceful_shutdown_timeout_s": config.shutdown_timeout + 5.0,
        "request_router_config": RequestRouterConfig(**router),
    }
    if ray_config.max_replicas > ray_config.num_replicas:
        policy = ({"policy": AutoscalingPolicy(policy_function=POLICY)}
                  if ray_config.autoscale_metric == "queue" else {})
        options["autoscaling_config"] = AutoscalingConfig(
            min_replicas=ray_config.num_replicas, max_replicas=ray_config.max_replicas,
            initial_replicas=ray_config.num_replicas,
            target_ongoing_requests=ray_config.target_ongoing_requests or engine.max_batch,
            **policy)
    else:
        options["num_replicas"] = ray_config.num_replicas
    return options


def build_app(config: ServerConfig, ray_config: RayServeConfig) -> Any:
    """The bound Ray Serve application: `serve.run(build_app(...))`. Its ingress is the
    front (api.rayserve.front), which calls the replica deployment through a handle; each
    replica serves `config` (its engine: `config.engine`)."""
    from tqserve.api.rayserve.front import FRONT_NAME, TqserveFront
    from tqserve.api.rayserve.keys import FrontConfig

    replicas = serve.deployment(TqserveReplica).options(
        **_replica_options(config, ray_config)).bind(config)
    front = FrontConfig(block_tokens=KV_BLOCK_TOKENS, max_body_bytes=config.max_message_bytes,
                        max_message_bytes=config.max_message_bytes,
                        max_streams_per_connection=config.max_streams_per_connection,
                        api_key=config.api_key, allowed_origins=config.allowed_origins,
                        chat_template=_template(config.engine.chat_template))
    per_front = ray_config.num_replicas * (ray_config.max_ongoing_requests or (
        config.engine.max_batch + config.engine.max_queued_requests)) * 4
    return serve.deployment(TqserveFront).options(
        name=FRONT_NAME, num_replicas=ray_config.front_replicas,
        ray_actor_options={"num_cpus": 0}, max_ongoing_requests=max(256, per_front),
    ).bind(replicas, front, str(config.engine.model))


def _template(path: Any) -> str | None:
    if path is None:
        return None
    with open(path, encoding="utf-8") as f:
        return f.read()
