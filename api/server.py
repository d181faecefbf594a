"""Serve the app on hypercorn inside the caller's nursery (or from the CLI).

Clean shutdown, when `shutdown_trigger` is set (the CLI sets it on SIGTERM or SIGINT):
the engine stops admitting (new requests get `shutting_down`, /health 503); in-flight
requests get `config.shutdown_timeout` seconds to finish, then end with
Done(finish_reason="shutdown"); every WebSocket sends what it still owes and closes with
1001; hypercorn stops; the engine closes (draining its SSD write queue); `serve` returns
the ShutdownReport. With --distributed, a failed tensor-parallel group (engine.distributed)
starts the same shutdown, and `serve` then raises its GroupFailure.
"""

from __future__ import annotations

from contextlib import AsyncExitStack

import attrs
from hypercorn.config import Config as HypercornConfig
from hypercorn.config import Sockets
from hypercorn.trio.run import worker_serve
from hypercorn.utils import wrap_app
import trio

from tqserve.actors.engine import open_engine
from tqserve.actors.facade import Engine, ShutdownReport
from tqserve.api.app import Connections, create_app
from tqserve.api.handover import serve_handed_over
from tqserve.api.hardening import listen_hardened
from tqserve.api.overload import OverloadGate
from tqserve.api.httpconn import HttpLimits
from tqserve.api.config import ServerConfig
from tqserve.api.recorder import open_recorder
from tqserve.engine.model import LoadedModel

# hypercorn's own hard cap: twice --max-message-bytes (at least 64 KiB over it). The app's
# check (an error frame, the socket goes on) fires first; over this the socket closes, 1009.
_HARD_FRAME_FACTOR = 2
_HARD_FRAME_MARGIN = 64 << 10
# WebSocket messages hypercorn queues for the app (its default is 10): with quart-trio's own
# queue of 10, a connection holds at most (APP_QUEUE + 11) * the hard cap of received data.
APP_QUEUE = 1


def hard_message_bytes(config: ServerConfig) -> int:
    """Bytes of one WebSocket message over which the socket is closed with 1009."""
    return max(config.max_message_bytes * _HARD_FRAME_FACTOR,
               config.max_message_bytes + _HARD_FRAME_MARGIN)
CLOSE_GRACE = 5.0  # seconds the sockets get to flush their last frames and close (1001)


def overload_gate(engine: Engine, api_key: str | None) -> OverloadGate:
    """The gate that refuses generation requests while admission is full (api.overload)."""
    def reason() -> str | None:
        refusal = engine.overloaded("")
        return refusal.message if refusal is not None and refusal.code == "overloaded" else None

    return OverloadGate(reason, lambda: engine.note_rejection("overloaded"), api_key,
                        room=engine.admission_room)


def listen(config: ServerConfig) -> tuple[HypercornConfig, Sockets]:
    """hypercorn's config and the bound, listening sockets; ValueError naming host:port
    when the address is taken or invalid (so callers can fail before loading a model)."""
    limits = HttpLimits(http_idle_timeout=config.http_idle_timeout,
                        http_header_timeout=config.http_header_timeout,
                        http_body_timeout=config.http_body_timeout,
                        max_connections=config.max_connections)
    return listen_hardened(config.host, config.port,
                           hard_message_bytes=hard_message_bytes(config), limits=limits,
                           ws_message_timeout=config.ws_message_timeout, app_queue=APP_QUEUE)


async def close_app(engine: Engine, connections: Connections, timeout: float
                    ) -> ShutdownReport:
    """The app's clean shutdown (also api.rayserve's): stop admitting, give in-flight
    requests `timeout` seconds, then have every WebSocket flush and close with 1001."""
    report = await engine.shutdown(timeout)
    connections.close_all()
    with trio.move_on_after(CLOSE_GRACE):
        await connections.wait_closed()
    return report


async def serve(config: ServerConfig, *, loaded: LoadedModel | None = None,
                listening: tuple[HypercornConfig, Sockets] | None = None,
                shutdown_trigger: trio.Event | None = None, record: str | None = None,
                task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED
                ) -> ShutdownReport:
    """Start the engine (`config.engine`) and the server; report the bound URL through
    task_status; serve until `shutdown_trigger` is set (forever without one), then shut
    down cleanly.

    The listening socket is bound first, so a taken port is a ValueError naming it before
    the model loads. `record`: write every admitted request to this file (api.recorder;
    `tqserve replay` reads it)."""
    if not isinstance(config, ServerConfig):
        raise TypeError(f"serve takes a ServerConfig(engine=Config(...), ...), got "
                        f"{type(config).__name__}")
    hc, sockets = listening if listening is not None else listen(config)
    async with AsyncExitStack() as stack:
        recorder = None
        if record is not None:
            recorder, _ = await stack.enter_async_context(open_recorder(
                record, {"model": config.engine.model, "config": attrs.asdict(config.engine)}))
        engine = await stack.enter_async_context(
            open_engine(config.engine, loaded=loaded, recorder=recorder))
        connections = Connections()
        hc.connection_cap.on_refused = lambda: engine.note_rejection("too_many_connections")
        gate = hc.overload_gate = overload_gate(engine, config.api_key)
        app = wrap_app(create_app(engine, config, connections), hc.wsgi_max_body_size, None)
        stop_http = trio.Event()
        handed_over = config.acceptor == "process" and not (
            sockets.secure_sockets or sockets.quic_sockets)

        async def started(*, task_status: trio.TaskStatus[list[str]]) -> None:
            if handed_over:
                await serve_handed_over(app, hc, sockets, gate, shutdown_trigger=stop_http.wait,
                                        task_status=task_status)
            else:
                await worker_serve(app, hc, sockets=sockets, shutdown_trigger=stop_http.wait,
                                   task_status=task_status)

        async with trio.open_nursery() as nursery:
            binds = await nursery.start(started)
            task_status.started(binds[0])
            async with trio.open_nursery() as until:  # a trigger, or the group failed
                async def stop_on(event: trio.Event) -> None:
                    await event.wait()
                    until.cancel_scope.cancel()

                until.start_soon(stop_on, engine.group_failed.event)
                if shutdown_trigger is not None:
                    until.start_soon(stop_on, shutdown_trigger)
            report = await close_app(engine, connections, config.shutdown_timeout)
            stop_http.set()
    if engine.group_failed.error is not None:
        raise engine.group_failed.error  # after a clean shutdown: the CLI exits 1
    return report
