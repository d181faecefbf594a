"""Serve the app on hypercorn inside the caller's nursery (or from the CLI).

Clean shutdown, when `shutdown_trigger` is set (the CLI sets it on SIGTERM or SIGINT):
the engine stops admitting (new requests get `shutting_down`, /health 503); in-flight
requests get `config.shutdown_timeout` seconds to finish, then end with
Done(finish_reason="shutdown"); every WebSocket sends what it still owes and closes with
1001; hypercorn stops; the engine closes (draining its SSD write queue); `serve` returns
the ShutdownReport.
"""

from __future__ import annotations

from hypercorn.config import Config as HypercornConfig
from hypercorn.config import Sockets
from hypercorn.trio.run import worker_serve
from hypercorn.utils import wrap_app
import trio

from actors.engine import ShutdownReport, open_engine
from api.app import Connections, create_app
from engine.config import Config
from engine.model import LoadedModel

# hypercorn's own hard cap; the app's --max-message-bytes check (an error frame)
# fires first, this only protects against absurd frames.
_HARD_FRAME_FACTOR = 4
CLOSE_GRACE = 5.0  # seconds the sockets get to flush their last frames and close (1001)


def listen(config: Config) -> tuple[HypercornConfig, Sockets]:
    """hypercorn's config and the bound, listening sockets; ValueError naming host:port
    when the address is taken or invalid (so callers can fail before loading a model)."""
    hc = HypercornConfig()
    hc.bind = [f"{config.host}:{config.port}"]
    hc.websocket_max_message_size = config.max_message_bytes * _HARD_FRAME_FACTOR
    hc.accesslog = None
    hc.loglevel = "WARNING"  # hypercorn's "Running on" lines: the CLI prints its own
    hc.graceful_timeout = 1.0
    try:
        sockets = hc.create_sockets()
        for sock in sockets.insecure_sockets:
            sock.listen(hc.backlog)
    except OSError as exc:
        raise ValueError(f"cannot listen on {config.host}:{config.port}: "
                         f"{exc.strerror or exc}") from exc
    return hc, sockets


async def serve(config: Config, *, loaded: LoadedModel | None = None,
                listening: tuple[HypercornConfig, Sockets] | None = None,
                shutdown_trigger: trio.Event | None = None,
                task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED
                ) -> ShutdownReport:
    """Start the engine and the server; report the bound URL through task_status; serve
    until `shutdown_trigger` is set (forever without one), then shut down cleanly.

    The listening socket is bound first, so a taken port is a ValueError naming it before
    the model loads."""
    hc, sockets = listening if listening is not None else listen(config)
    async with open_engine(config, loaded=loaded) as engine:
        connections = Connections()
        app = wrap_app(create_app(engine, connections), hc.wsgi_max_body_size, None)
        stop_http = trio.Event()

        async def started(*, task_status: trio.TaskStatus[list[str]]) -> None:
            await worker_serve(app, hc, sockets=sockets, shutdown_trigger=stop_http.wait,
                               task_status=task_status)

        async with trio.open_nursery() as nursery:
            binds = await nursery.start(started)
            task_status.started(binds[0])
            if shutdown_trigger is None:
                await trio.sleep_forever()
            else:
                await shutdown_trigger.wait()
            report = await engine.shutdown(config.shutdown_timeout)
            connections.close_all()
            with trio.move_on_after(CLOSE_GRACE):
                await connections.wait_closed()
            stop_http.set()
    return report
