"""The running router: route table + backend links + health checks + draining.

`Router.stream(fields)` is the one path every front end (WebSocket, OpenAI, Anthropic
HTTP) uses for a generation over the WebSocket protocol; `Router.attempts()` is the
fail-over loop both use: it yields routes until one works, marking a backend down when
its connection breaks under a request that has not started.

Health: `run_health_checks` polls every backend's /health every `health_interval`
seconds (each check under a `health_timeout` cancel scope); the first round completes
before the router reports ready, so it never starts with every backend UNKNOWN.

Draining (SIGTERM/SIGINT on `tqserve route`, or `drain()`): new requests are refused
with `shutting_down` (503), /health answers 503, in-flight requests finish;
`wait_idle()` returns when none is left.
"""

from __future__ import annotations

from typing import Any, Sequence

import attrs
import httpx
import trio

from tqserve.api.httpconn import HttpLimits
from tqserve.api.router.backends import BackendLink, LinkPool, PoolStatistics, check_health
from tqserve.api.router.core import (NoHealthyBackend, Route, RouterStatistics, RouteTable,
                                     RoutingConfig, prefix_keys)

HTTP_CONNECTIONS = 64  # pooled HTTP connections to the backends (proxied HTTP requests)


class ShuttingDown(Exception):
    """The router is draining: it admits no new request."""


@attrs.frozen(kw_only=True)
class RouterConfig:
    """`tqserve route`'s settings; the CLI maps its flags onto them 1:1."""

    backends: tuple[str, ...] = attrs.field(converter=tuple)
    routing: RoutingConfig = RoutingConfig()
    host: str = "127.0.0.1"
    port: int = attrs.field(default=8100, validator=[attrs.validators.ge(0),
                                                      attrs.validators.le(65535)])
    health_interval: float = attrs.field(default=1.0, validator=attrs.validators.gt(0))
    health_timeout: float = attrs.field(default=2.0, validator=attrs.validators.gt(0))
    max_attempts: int = attrs.field(default=3, validator=attrs.validators.ge(1))
    max_message_bytes: int = attrs.field(default=1 << 20, validator=attrs.validators.ge(1))
    max_streams_per_connection: int = attrs.field(default=16, validator=attrs.validators.ge(1))
    backend_streams: int = attrs.field(default=16, validator=attrs.validators.ge(1))
    api_key: str | None = None
    backend_api_key: str | None = None
    admin_key: str | None = None
    # browser origins allowed besides the router's own and loopback ones (api.auth; * = any)
    allowed_origins: tuple[str, ...] = attrs.field(
        default=(), converter=lambda v: tuple(o.strip().rstrip("/") for o in (
            v.split(",") if isinstance(v, str) else v) if o.strip()))
    shutdown_timeout: float = attrs.field(default=10.0, validator=attrs.validators.ge(0))
    http: HttpLimits = HttpLimits()  # client connections: timeouts, --max-connections
    # the backends' answers: seconds without a byte (then 504 / an error event), and the
    # bytes of a whole answer or of one SSE event the router holds (then 502)
    backend_read_timeout: float = attrs.field(default=600.0, validator=attrs.validators.gt(0))
    max_backend_bytes: int = attrs.field(default=64 << 20, validator=attrs.validators.ge(1))

    @backends.validator
    def _check_backends(self, _: Any, value: tuple[str, ...]) -> None:
        if not value:
            raise ValueError("--backend: give at least one backend URL")
        for url in value:
            if not url.startswith(("http://", "https://")) or url.endswith("/"):
                raise ValueError(f"--backend {url!r}: give http://host:port (no path)")


@attrs.frozen(kw_only=True)
class ServiceStatistics:
    routing: RouterStatistics
    links: PoolStatistics
    draining: bool
    rejections: dict[str, int]       # requests the router refused, by code
    prompt_tokens: dict[str, int]    # per backend, from WebSocket done frames
    cached_tokens: dict[str, int]


@attrs.define
class _Usage:
    prompt_tokens: int = 0
    cached_tokens: int = 0


class Router:
    """The router's shared state; built by `open_router`'s caller inside a nursery."""

    def __init__(self, config: RouterConfig, nursery: trio.Nursery,
                 http: httpx.AsyncClient) -> None:
        self.config = config
        self.table = RouteTable(config.backends, config.routing)
        self.pool = LinkPool(nursery, config.backend_streams, config.backend_api_key,
                             config.backend_read_timeout)
        self.http = http
        self.draining = False
        self.usage = {name: _Usage() for name in config.backends}
        self.rejections: dict[str, int] = {}
        self._idle = trio.Event()
        self._checked = trio.Event()

    def statistics(self) -> ServiceStatistics:
        return ServiceStatistics(
            routing=self.table.statistics(), links=self.pool.statistics(),
            draining=self.draining, rejections=dict(self.rejections),
            prompt_tokens={n: u.prompt_tokens for n, u in self.usage.items()},
            cached_tokens={n: u.cached_tokens for n, u in self.usage.items()})

    def keys(self, fields: dict[str, Any]) -> tuple[bytes, ...]:
        cfg = self.config.routing
        return prefix_keys(fields, block_tokens=cfg.block_tokens, block_chars=cfg.block_chars)

    def reject(self, code: str) -> None:
        self.rejections[code] = self.rejections.get(code, 0) + 1

    def drain(self) -> None:
        """Stop admitting; in-flight requests go on."""
        self.draining = True
        if self.table.num_in_flight() == 0:
            self._idle.set()

    async def wait_idle(self) -> None:
        """Wait until the router drains and no request is in flight."""
        await self._idle.wait()

    def begin(self, keys: Sequence[bytes], tried: Sequence[str] = ()) -> Route:
        """The backend for a request's next attempt (not one of `tried`), counted in
        flight until `end(route)`. Raises ShuttingDown, or NoHealthyBackend when none is
        left or `max_attempts` backends were tried."""
        if self.draining:
            raise ShuttingDown("the router is shutting down")
        if len(tried) >= self.config.max_attempts:
            raise NoHealthyBackend(f"{len(tried)} backends failed before the request started")
        route = self.table.choose(keys, exclude=tried)
        self.table.started(route, keys, retry=bool(tried))
        return route

    def end(self, route: Route) -> None:
        """The attempt on `route.backend` is over (in any way)."""
        self.table.finished(route.backend)
        if self.draining and self.table.num_in_flight() == 0:
            self._idle.set()

    def lost(self, route: Route) -> None:
        self.table.failed(route.backend)

    def note_done(self, backend: str, frame: dict[str, Any]) -> None:
        usage = frame.get("usage") or {}
        u = self.usage[backend]
        u.prompt_tokens += int(usage.get("prompt_tokens", 0))
        u.cached_tokens += int(usage.get("cached_tokens", 0))

    async def link(self, backend: str) -> BackendLink:
        return await self.pool.link(backend)

    async def check_all(self) -> None:
        """One round of health checks, all backends at once."""
        async def one(name: str) -> None:
            self.table.checked(name, await check_health(self.http, name,
                                                         self.config.health_timeout))

        async with trio.open_nursery() as nursery:
            for name in self.table.names:
                nursery.start_soon(one, name)

    async def run_health_checks(self, *, task_status: trio.TaskStatus[None]
                                = trio.TASK_STATUS_IGNORED) -> None:
        await self.check_all()
        task_status.started()
        while True:
            await trio.sleep(self.config.health_interval)
            await self.check_all()


__all__ = ["NoHealthyBackend", "Router", "RouterConfig", "ShuttingDown"]
