"""Worker threads with a large native stack for llguidance's compilers.

llguidance compiles a grammar or a JSON schema recursively in native code: on an 8 MiB
thread stack a chain of ~1,000 `$defs` linked by `$ref`, or ~3,000 Lark rules, overflows
it and the process dies with SIGSEGV (issue 20). formats.py bounds what a request may
send (rules, `$defs`, nesting) far below that; these threads give the compilers
GRAMMAR_STACK_BYTES on top (a 3,000-`$defs` chain compiles on 64 MiB), so one request can
never take the server down. The stack is reserved address space, touched only as used.
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Executor, Future
from typing import Any, Callable, TypeVar

T = TypeVar("T")
GRAMMAR_STACK_BYTES = 64 << 20
_STACK_LOCK = threading.Lock()  # threading.stack_size is process-wide: set, start, restore


class BigStackExecutor(Executor):
    """`num_threads` daemon threads with GRAMMAR_STACK_BYTES stacks, started now, serving
    one FIFO queue."""

    def __init__(self, num_threads: int, name: str) -> None:
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._threads = []
        with _STACK_LOCK:
            previous = threading.stack_size(GRAMMAR_STACK_BYTES)
            try:
                for i in range(num_threads):
                    thread = threading.Thread(target=self._loop, name=f"{name}-{i}",
                                              daemon=True)
                    thread.start()
                    self._threads.append(thread)
            finally:
                threading.stack_size(previous)

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            future, fn, args = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # delivered to whoever waits on the future
                future.set_exception(exc)

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        """Run `fn(*args)` on a worker thread (keyword arguments are not taken)."""
        if kwargs:
            raise TypeError("BigStackExecutor.submit takes positional arguments only")
        future: Future[T] = Future()
        self._jobs.put((future, fn, args))
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Stop the threads after the jobs queued so far."""
        for _ in self._threads:
            self._jobs.put(None)
        if wait:
            for thread in self._threads:
                thread.join()
