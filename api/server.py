"""Serve the app on hypercorn inside the caller's nursery (or from the CLI)."""

from __future__ import annotations

from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve as hypercorn_serve
import trio

from actors.engine import open_engine
from api.app import create_app
from engine.config import Config
from engine.model import LoadedModel

# hypercorn's own hard cap; the app's --max-message-bytes check (an error frame)
# fires first, this only protects against absurd frames.
_HARD_FRAME_FACTOR = 4


async def serve(config: Config, *, loaded: LoadedModel | None = None,
                shutdown_trigger: trio.Event | None = None,
                task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
    """Start the engine and the server; report the bound URL through task_status."""
    async with open_engine(config, loaded=loaded) as engine:
        hc = HypercornConfig()
        hc.bind = [f"{config.host}:{config.port}"]
        hc.websocket_max_message_size = config.max_message_bytes * _HARD_FRAME_FACTOR
        hc.accesslog = None
        hc.graceful_timeout = 1.0
        app = create_app(engine)

        async def started(*, task_status: trio.TaskStatus[list[str]]) -> None:
            trigger = shutdown_trigger.wait if shutdown_trigger is not None else None
            await hypercorn_serve(app, hc, shutdown_trigger=trigger, task_status=task_status)

        async with trio.open_nursery() as nursery:
            binds = await nursery.start(started)
            task_status.started(binds[0])
