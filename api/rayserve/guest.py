"""trio as a guest inside a running asyncio loop, and ASGI calls bridged into it.

Ray Serve runs a replica's code on an asyncio loop; tqserve's engine and its quart-trio
app are trio. `GuestRun.start` starts `trio.lowlevel.start_guest_run` on that loop: trio's
tasks then run on the loop's thread, between asyncio callbacks (trio's I/O wait alone is on
a thread of its own). `asgi(scope, receive, send)` is an ASGI 3 app for the asyncio side:
each call becomes one trio task in the guest's nursery that runs the trio app, whose
`receive`/`send` await the asyncio side's own callables on the caller's loop.

Failure stays per call: an exception in the app ends that call (re-raised on the asyncio
side, where Ray Serve answers 500), never the nursery; the asyncio caller being cancelled
(the client went away) cancels its trio task; the guest run ending (stop, or a crash)
fails every call still open. Imports no ray: the bridge is tested on plain asyncio.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from typing import Any, Awaitable, Callable

import outcome
import trio

log = logging.getLogger("tqserve.rayserve")

Message = dict[str, Any]
AsgiApp = Callable[[Message, Callable[[], Awaitable[Message]],
                    Callable[[Message], Awaitable[None]]], Awaitable[None]]


class GuestEnded(RuntimeError):
    """The trio guest run is over: the replica cannot serve any more."""


def _resolve(fut: asyncio.Future[Any], error: BaseException | None, value: Any = None) -> None:
    if fut.done():
        return
    if error is None:
        fut.set_result(value)
    else:
        fut.set_exception(error)


class GuestRun:
    """One trio run hosted by the current asyncio loop, with a nursery for calls."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._nursery: trio.Nursery | None = None
        self._stop: trio.Event | None = None
        self.ended: asyncio.Future[None] | None = None  # done when the run has returned

    @property
    def running(self) -> bool:
        return self.ended is not None and not self.ended.done()

    async def start(self, main: Callable[..., Awaitable[Any]]) -> Any:
        """Run `await main(stop, task_status=...)` as the guest; return what it reports to
        task_status once ready. `main` should return once `stop` (a trio.Event) is set."""
        loop = asyncio.get_running_loop()
        self._loop = loop
        ready: asyncio.Future[Any] = loop.create_future()
        self.ended = loop.create_future()

        async def guest() -> None:
            self._token = trio.lowlevel.current_trio_token()
            self._stop = trio.Event()
            async with trio.open_nursery() as nursery:
                self._nursery = nursery

                async def run_main(task_status: trio.TaskStatus[Any]) -> None:
                    await main(self._stop, task_status=task_status)
                    nursery.cancel_scope.cancel()  # the calls still open end with main

                value = await nursery.start(run_main)
                loop.call_soon_threadsafe(_resolve, ready, None, value)

        def done(result: outcome.Outcome) -> None:
            error = result.error if isinstance(result, outcome.Error) else None
            if error is not None:  # our bug: loud, with its traceback, not only in `ended`
                log.error("the engine's trio run failed", exc_info=error)
            ended = GuestEnded(f"the engine stopped: {error!r}" if error else
                               "the engine stopped")
            loop.call_soon_threadsafe(_resolve, ready, ended)
            loop.call_soon_threadsafe(_resolve, self.ended, error)

        trio.lowlevel.start_guest_run(guest, run_sync_soon_threadsafe=loop.call_soon_threadsafe,
                                      done_callback=done, host_uses_signal_set_wakeup_fd=False)
        return await ready

    async def stop(self) -> None:
        """Set `stop` inside the guest and wait until the run has returned."""
        if not self.running or self._token is None or self._stop is None:
            return
        self._run_soon(self._stop.set)
        await asyncio.shield(self.ended)  # type: ignore[arg-type]

    def _run_soon(self, fn: Callable[[], None]) -> None:
        if self._token is None:
            raise GuestEnded("the engine has not started")
        try:
            self._token.run_sync_soon(fn)
        except trio.RunFinishedError:
            raise GuestEnded("the engine stopped") from None

    async def call(self, fn: Callable[[], Any]) -> Any:
        """`fn()` run inside the guest (where trio state may be read); its result here."""
        fut = asyncio.get_running_loop().create_future()
        loop = fut.get_loop()

        def run() -> None:
            try:
                value, error = fn(), None
            except Exception as exc:
                value, error = None, exc
            loop.call_soon_threadsafe(_resolve, fut, error, value)

        self._run_soon(run)
        return await fut

    async def asgi(self, app: AsgiApp, scope: Message,
                   receive: Callable[[], Awaitable[Message]],
                   send: Callable[[Message], Awaitable[None]]) -> None:
        """Serve one ASGI call of the asyncio side with the trio app `app`."""
        loop = asyncio.get_running_loop()
        ctx = contextvars.copy_context()  # the caller's context, for its receive/send
        finished: asyncio.Future[None] = loop.create_future()
        box: dict[str, Any] = {}
        if self._nursery is None or not self.running:
            raise GuestEnded("the engine is not running")
        nursery = self._nursery

        def spawn() -> None:
            if box.get("abandoned"):
                loop.call_soon_threadsafe(_resolve, finished, asyncio.CancelledError())
                return
            nursery.start_soon(self._serve_call, app, scope, receive, send, loop, ctx,
                               finished, box)

        self._run_soon(spawn)
        try:
            await asyncio.shield(finished)
        except asyncio.CancelledError:
            box["abandoned"] = True
            if "cancel" in box and self.running:
                self._run_soon(box["cancel"])
            raise

    async def _serve_call(self, app: AsgiApp, scope: Message,
                          receive: Callable[[], Awaitable[Message]],
                          send: Callable[[Message], Awaitable[None]],
                          loop: asyncio.AbstractEventLoop, ctx: contextvars.Context,
                          finished: asyncio.Future[None], box: dict[str, Any]) -> None:
        error: BaseException | None = GuestEnded("the engine stopped during the request")
        try:
            with trio.CancelScope() as scope_:
                box["cancel"] = scope_.cancel
                await app(scope, lambda: self._host(loop, ctx, receive),
                          lambda message: self._host(loop, ctx, lambda: send(message)))
            error = asyncio.CancelledError() if scope_.cancelled_caught else None
        except Exception as exc:  # this call fails; the nursery (the engine) goes on
            error = exc
        except BaseExceptionGroup as group:  # e.g. a GeneratorExit wrapped by a nursery:
            log.error("a call failed", exc_info=group)  # still this call's failure alone
            error = RuntimeError(f"the call failed: {group!r}")
        finally:  # a caller that went away reads nothing: no error left unretrieved
            loop.call_soon_threadsafe(_resolve, finished, None if box.get("abandoned")
                                      else error)

    async def _host(self, loop: asyncio.AbstractEventLoop, ctx: contextvars.Context,
                    fn: Callable[[], Awaitable[Any]]) -> Any:
        """Await the asyncio coroutine `fn()` on `loop` from a trio task."""
        token = trio.lowlevel.current_trio_token()
        done = trio.Event()
        box: dict[str, Any] = {}

        def on_done(task: asyncio.Future[Any]) -> None:
            box["done"] = task
            try:
                token.run_sync_soon(done.set)
            except trio.RunFinishedError:
                pass

        def begin() -> None:
            task = loop.create_task(fn())  # type: ignore[arg-type]
            box["task"] = task
            task.add_done_callback(on_done)

        loop.call_soon_threadsafe(begin, context=ctx)
        try:
            await done.wait()
        except trio.Cancelled:
            loop.call_soon_threadsafe(lambda: box["task"].cancel() if "task" in box else None)
            raise
        task = box["done"]
        if task.cancelled():
            raise OSError("the connection was closed")
        return task.result()
