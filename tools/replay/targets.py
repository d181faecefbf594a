"""Where a replay sends its requests: a running server, a spawned one, an embedded engine.

Every target yields `tqserve.client` events for a request, answers `stats()` (the
`/v1/stats` object: a server's or a router's) and `limits()` (the bounds it reports:
max_model_len, max_batch, max_queued_requests, max_queued_tokens; a router reports only its
backends' max_model_len, from /v1/models) and, where it owns the server, `restart()`s it on
the same cache dir.

* `UrlTarget`: a pool of WebSocket connections, each carrying at most
  `streams_per_connection` requests (the server's --max-streams-per-connection, 16 by
  default); a new connection opens whenever every open one is full, so any concurrency fits.
* `SpawnTarget`: a `tqserve serve --port 0` child process with the given engine flags,
  reached as a UrlTarget; restart = SIGINT, wait, start again with the same flags.
* `EngineTarget`: `open_engine(config)` in this process; restart = leave the engine's block
  (its RAM tier is gone) and open a new one on the same config (the SSD tier is recovered).
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import tempfile
import urllib.request
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any, AsyncIterator

import trio

from tqserve.tools.replay.traces import TraceRequest
from tqserve.client import Client, Event, parse_event

SPAWN_START_TIMEOUT = 300.0  # seconds a spawned server may take to load and listen
SPAWN_STOP_TIMEOUT = 60.0    # seconds it may take to drain and exit after SIGINT
_REPO = Path(__file__).resolve().parents[2]


def request_fields(req: TraceRequest) -> dict[str, Any]:
    """The protocol's generate fields for a trace request (temperature 0 unless given)."""
    fields: dict[str, Any] = {"temperature": 0.0, **req.params, "max_tokens": req.max_tokens}
    return {k: v for k, v in fields.items() if v is not None}


def _http_json(url: str, api_key: str | None = None) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=30) as resp:
        return json.loads(resp.read())


class UrlTarget:
    def __init__(self, ws_url: str, *, streams_per_connection: int = 16, binary: bool = True,
                 api_key: str | None = None) -> None:
        self.name = ws_url
        self.ws_url = ws_url
        self._limit = streams_per_connection
        self._binary = binary
        self._api_key = api_key
        self._stack = AsyncExitStack()
        self._clients: list[Client] = []
        self._open_lock = trio.Lock()

    async def __aenter__(self) -> "UrlTarget":
        await self._open_nursery()
        return self

    async def _open_nursery(self) -> None:
        # entered and left by the task that runs `async with target`; clients opened
        # from request tasks live in it
        self._nursery = await self._stack.enter_async_context(trio.open_nursery())

    async def __aexit__(self, *exc: object) -> None:
        await self._close_clients()
        self._nursery.cancel_scope.cancel()
        await self._stack.aclose()

    async def _close_clients(self) -> None:
        clients, self._clients = self._clients, []
        for c in clients:
            await c.aclose()

    @property
    def num_connections(self) -> int:
        return len(self._clients)

    async def _client(self) -> Client:
        async with self._open_lock:
            for c in self._clients:
                if c.num_active < self._limit:
                    return c
            client = Client(self._nursery, self.ws_url, binary=self._binary,
                            api_key=self._api_key)
            await client.open()
            self._clients.append(client)
            return client

    async def generate(self, req: TraceRequest, rid: str) -> AsyncIterator[Event]:
        client = await self._client()
        async for event in client.generate(prompt_tokens=list(req.prompt_tokens),
                                           request_id=rid, **request_fields(req)):
            yield event

    async def stats(self) -> dict[str, Any] | None:
        try:
            return await trio.to_thread.run_sync(_http_json, self._base() + "/v1/stats",
                                                 self._api_key)
        except (OSError, ValueError):
            return None

    async def limits(self) -> dict[str, int]:
        stats = await self.stats()
        if stats and stats.get("limits"):
            return dict(stats["limits"])
        try:  # a router (or an older server): the context from the model listing
            listing = await trio.to_thread.run_sync(_http_json, self._base() + "/v1/models",
                                                   self._api_key)
            n = listing["data"][0].get("max_model_len")
        except (OSError, ValueError, KeyError, IndexError, TypeError):
            return {}
        return {"max_model_len": int(n)} if isinstance(n, int) else {}

    def _base(self) -> str:
        base = self.ws_url.replace("ws://", "http://").replace("wss://", "https://")
        return base.rsplit("/v1/stream", 1)[0]

    async def restart(self) -> None:
        raise ValueError("--restart-at needs a server this tool owns (--model or --spawn)")


class SpawnTarget(UrlTarget):
    def __init__(self, serve_args: list[str], **kwargs: Any) -> None:
        super().__init__("", **kwargs)
        self._args = serve_args
        self._proc: trio.Process | None = None

    async def __aenter__(self) -> "SpawnTarget":
        await self._open_nursery()
        try:
            await self._start()
        except BaseException:  # an interruption while it loads too: stop the child
            await self._stop()
            self._nursery.cancel_scope.cancel()
            await self._stack.aclose()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await super().__aexit__(*exc)
        await self._stop()

    async def _start(self) -> None:
        cmd = [sys.executable, "-m", "tqserve.api.cli", "serve", "--port", "0", *self._args]
        self._log = tempfile.TemporaryFile()  # the child's stderr: shown only if it fails
        # a session of its own: a Ctrl-C at the terminal reaches this tool only, which
        # then stops the child itself, after the partial results are in
        self._proc = await trio.lowlevel.open_process(cmd, cwd=_REPO, stdout=subprocess.PIPE,
                                                      stderr=self._log, start_new_session=True)
        buf = b""
        with trio.move_on_after(SPAWN_START_TIMEOUT):
            while not re.search(rb"on (http://\S+) ", buf):
                chunk = await self._proc.stdout.receive_some(4096)  # type: ignore[union-attr]
                if not chunk:
                    break
                buf += chunk
        m = re.search(rb"on (http://\S+) ", buf)
        if m is None:
            self._log.seek(0)
            lines = self._log.read().decode(errors="replace").strip().splitlines()
            tail = [x for x in lines if x.startswith("tqserve: error")][-1:] or lines[-1:]
            await self._stop()
            raise ValueError(f"spawned server did not start: {' '.join(tail) or 'no output'}")
        self.ws_url = m.group(1).decode().replace("http://", "ws://") + "/v1/stream"
        self.name = f"spawned {self.ws_url}"

    async def _stop(self) -> None:
        if self._proc is None:
            return
        proc, self._proc = self._proc, None
        with trio.CancelScope(shield=True):
            if proc.returncode is None:
                proc.send_signal(signal.SIGINT)
                with trio.move_on_after(SPAWN_STOP_TIMEOUT):
                    await proc.wait()
                if proc.returncode is None:
                    proc.kill()
                    await proc.wait()
            if proc.stdout is not None:
                await proc.stdout.aclose()
            self._log.close()

    async def restart(self) -> None:
        await self._close_clients()
        await self._stop()
        await self._start()


class EngineTarget:
    def __init__(self, config: Any) -> None:
        self.config = config
        self.name = f"embedded {Path(config.model).name}"
        self._stack = AsyncExitStack()
        self._engine: Any = None
        self._loaded: Any = None

    async def __aenter__(self) -> "EngineTarget":
        self._nursery = await self._stack.enter_async_context(trio.open_nursery())
        await self._open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._close()
        await self._stack.aclose()

    async def _open(self) -> None:
        # the engine lives in a task of the target's own nursery, so that a restart from
        # inside any cancel scope (a replay phase) leaves the scopes nested as trio needs
        self._stop, self._closed = trio.Event(), trio.Event()
        self._engine = await self._nursery.start(self._host, self._stop, self._closed)
        self._loaded = self._engine.model

    async def _host(self, stop: trio.Event, closed: trio.Event,
                    task_status: trio.TaskStatus[Any] = trio.TASK_STATUS_IGNORED) -> None:
        from tqserve.actors.engine import open_engine

        try:
            async with open_engine(self.config, loaded=self._loaded) as engine:
                task_status.started(engine)
                await stop.wait()
        finally:
            closed.set()

    async def _close(self) -> None:
        self._stop.set()
        with trio.CancelScope(shield=True):
            await self._closed.wait()

    async def generate(self, req: TraceRequest, rid: str) -> AsyncIterator[Event]:
        from tqserve.engine.request import GenerateRequest
        from tqserve.engine.sampling import SamplingParams

        fields = request_fields(req)
        try:
            request = GenerateRequest(prompt_tokens=req.prompt_tokens,
                                      params=SamplingParams(**fields))
        except (ValueError, TypeError) as exc:
            yield parse_event({"type": "error", "id": rid, "code": "invalid_request",
                               "message": str(exc)})
            return
        async for event in self._engine.generate(request, rid):
            yield parse_event(event.to_wire())

    async def stats(self) -> dict[str, Any] | None:
        import attrs

        return attrs.asdict(self._engine.statistics())

    async def limits(self) -> dict[str, int]:
        return dict(self._engine.statistics().limits)

    async def restart(self) -> None:
        await self._close()
        await self._open()
