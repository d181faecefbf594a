"""One request's event stream for the embedded API: what `Engine.generate` returns.

    async for event in engine.generate(request, "my-id"):   # Queued, Token..., Done | Error
        ...

* Ids: the caller's id (or a fresh one) is only a label. Inside the engine each call runs
  under an internal id that is never reused, so a caller may reuse its id as soon as the
  previous stream has ended and never receives the earlier request's events. Every event
  yielded carries the caller's id. An id whose stream is still open is refused
  (`invalid_request`).
* Leaving early cancels at once. `__aiter__` hands the `async for` loop a fresh
  `EventStream` that only the loop holds, so `break` (or an exception) drops it and its
  `__del__` sends the Cancel synchronously — the row is freed at the next engine step
  even while the caller still holds the `Generation`. Cancelling the caller's scope does
  the same from inside `__anext__`. `aclose()` ends a stream explicitly.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import attrs
import trio

from tqserve.actors.messages import Done, Error, Event, Submit
from tqserve.engine.request import GenerateRequest
from tqserve.ids import id_problem

if TYPE_CHECKING:
    from tqserve.actors.facade import Engine

log = logging.getLogger("tqserve.engine")


class Generation:
    """An async iterable of one request's events; iterate it once."""

    def __init__(self, engine: Engine, request: GenerateRequest, request_id: str) -> None:
        self._engine = engine
        self._request = request
        self.request_id = request_id
        self._used = False

    def __aiter__(self) -> EventStream:
        if self._used:
            raise RuntimeError(f"request {self.request_id!r}: a Generation is iterated once")
        self._used = True
        return EventStream(self._engine, self._request, self.request_id)


class EventStream:
    """The iterator one `async for` loop holds; dropping it early cancels the request."""

    def __init__(self, engine: Engine, request: GenerateRequest, request_id: str) -> None:
        self._engine = engine
        self._request = request
        self._caller_id = request_id
        self._internal: str | None = None
        self._receive: trio.MemoryReceiveChannel[Event] | None = None
        self._ended = False

    def __aiter__(self) -> EventStream:
        return self

    async def __anext__(self) -> Event:
        if self._ended:
            raise StopAsyncIteration
        if self._receive is None:
            first = await self._open()
            if first is not None:
                return first
        assert self._receive is not None and self._internal is not None  # set by _open
        try:
            event = await self._receive.receive()
        except trio.EndOfChannel:
            event = self._engine.stream_cut_off(self._internal)
        except BaseException:  # the caller's scope was cancelled (or the loop failed)
            self._end(cancel=True)
            raise
        if isinstance(event, (Done, Error)):
            self._end(cancel=False)
        if event.request_id == self._caller_id:  # Token events: labelled by the hub
            return event
        return attrs.evolve(event, request_id=self._caller_id)

    async def _open(self) -> Event | None:
        """Validate (a long prompt is tokenized on a worker thread) and submit; an event to
        yield at once (an Error, counted as a refusal) or None."""
        engine = self._engine
        rid = self._caller_id
        try:
            problem = id_problem(rid)
            if problem is not None:
                raise ValueError(f"request {problem}")
            early = engine.overloaded(rid)
            if early is not None:  # answered before any tokenizing or compiling
                self._ended = True
                engine.note_rejection(early.code)
                return early
            tokens = await engine.validate(self._request)
            constraint = await engine.compile_constraint(self._request)
        except (ValueError, UnicodeError) as exc:
            self._ended = True
            engine.note_rejection("invalid_request")
            return Error(request_id=rid if id_problem(rid) is None else None,
                         code="invalid_request", message=str(exc))
        refusal = engine.refusal(rid)
        if refusal is not None:
            self._ended = True
            engine.note_rejection(refusal.code)
            return refusal
        self._internal, self._receive = engine.open_internal(rid, self._request.params.stop)
        try:
            engine.submit_nowait(Submit(request_id=self._internal, prompt_tokens=tokens,
                                        params=self._request.params,
                                        response_format=constraint,
                                        speculative=self._request.speculative))
        except trio.WouldBlock:
            self._end(cancel=False)
            engine.note_rejection("overloaded")
            return Error(request_id=rid, code="overloaded", message="admission mailbox full")
        except (OverflowError, TypeError, ValueError) as exc:  # our bug: validation missed it
            log.exception("request %s cannot be encoded", self._internal)
            self._end(cancel=False)
            engine.note_rejection("internal_error")
            return Error(request_id=rid, code="internal_error",
                         message=f"request cannot be encoded: {type(exc).__name__}: {exc}")
        return None

    def _end(self, *, cancel: bool) -> None:
        if self._ended:
            return
        self._ended = True
        if self._internal is not None:
            self._engine.close_internal(self._caller_id, self._internal, cancel=cancel)

    async def aclose(self) -> None:
        """End the stream now; a request still running is cancelled."""
        self._end(cancel=True)

    def __del__(self) -> None:
        try:
            self._end(cancel=True)
        except Exception:  # the run is over (interpreter exit): nothing left to cancel
            pass
