"""The one thread that runs MLX. Actors await `call(fn, ...)`; the loop never blocks.

All MLX work (prefill, decode, sampling, cache surgery) runs here, in order, as in
mlx-lm's server. The waiting side is shielded: once a step started it completes,
so the runner's state is never left half-updated by a cancellation.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable, TypeVar

import trio

T = TypeVar("T")


class RunnerThread:
    """A dedicated worker thread with a job queue; results return to trio."""

    def __init__(self, name: str = "tqserve-runner") -> None:
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fn, args, token, deliver = job
            try:
                result: tuple[bool, Any] = (True, fn(*args))
            except BaseException as exc:  # delivered to the awaiting actor, re-raised there
                result = (False, exc)
            try:
                token.run_sync_soon(deliver, result)
            except trio.RunFinishedError:
                pass

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run `fn(*args)` on the runner thread and return its result."""
        done = trio.Event()
        box: list[tuple[bool, Any]] = []

        def deliver(result: tuple[bool, Any]) -> None:
            box.append(result)
            done.set()

        self._jobs.put((fn, args, trio.lowlevel.current_trio_token(), deliver))
        with trio.CancelScope(shield=True):
            await done.wait()
        ok, value = box[0]
        if not ok:
            raise value
        return value

    async def aclose(self) -> None:
        """Let the thread finish the jobs already queued, then wait for it to exit."""
        self._jobs.put(None)
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(self._thread.join)
