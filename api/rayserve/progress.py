"""What the front tells its request router: which requests' prompts are computed.

A /v1/stream request's first token (api.rayserve.front_ws) means its prompt is computed and
in its replica's prefix cache: the router (api.rayserve.routing.PrefixRouter) stops
counting it as work there, and a request waiting for that prefix may go. The router runs
in the front's process, on Ray's own event loop thread: it reads the notes at each
decision, and a decision that waits sleeps until the next note (`wait_for_note`). The
notes are a deque (append and popleft are atomic across threads) of the last MAX_NOTES (a
note no router reads, e.g. a pow2 front's, is dropped in time); the sleepers are futures
of their own loops, woken through it. This module is imported by reference, unlike the
router's module, which Ray pickles by value, so both sides share its state.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque

MAX_NOTES = 4096  # far more than a front has in flight between two routing decisions
_FIRST_TOKENS: deque[tuple[str, float]] = deque(maxlen=MAX_NOTES)
_SLEEPERS: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []
_LOCK = threading.Lock()  # guards _SLEEPERS


def now() -> float:
    """The clock of the notes and the router's books (monotonic, seconds)."""
    return time.monotonic()


def note_first_token(request_id: str) -> None:
    """The front saw the first token of the request Ray knows as `request_id` (now):
    recorded, and every `wait_for_note` woken."""
    _FIRST_TOKENS.append((request_id, now()))
    with _LOCK:
        sleepers = _SLEEPERS[:]
        _SLEEPERS.clear()
    for loop, woken in sleepers:
        loop.call_soon_threadsafe(_wake, woken)


def take_first_tokens() -> list[tuple[str, float]]:
    """The notes since the last call, (request id, when), oldest first."""
    out = []
    while True:
        try:
            out.append(_FIRST_TOKENS.popleft())
        except IndexError:
            return out


async def wait_for_note(timeout: float) -> None:
    """Until the next note, or `timeout` seconds."""
    loop = asyncio.get_running_loop()
    woken: asyncio.Future[None] = loop.create_future()
    with _LOCK:
        _SLEEPERS.append((loop, woken))
    try:
        if not _FIRST_TOKENS:  # one noted since the caller last read them: go at once
            await asyncio.wait([woken], timeout=timeout)
    finally:
        with _LOCK:
            if (loop, woken) in _SLEEPERS:
                _SLEEPERS.remove((loop, woken))


def _wake(woken: asyncio.Future[None]) -> None:
    if not woken.done():
        woken.set_result(None)
