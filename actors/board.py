"""The board: the engine's one statistics snapshot.

Each actor posts its own frozen statistics record here after it changes (admission after
each message, the cache owner after each message, the scheduler at each turn of its loop
with its core's and its prefix index's, the spill actor after each order it takes or ends,
the hub after each delivery, the speculation actor after each step it books). `snapshot` is the latest records of all of them, one immutable
`BoardSnapshot`; the facade (actors.facade) reads only that, never an actor's books, and
`wait_until` wakes a waiter when a post makes its condition true (e.g. `wait_idle`).

The prefix cache's KV event log (engine.kvevents) is published here too: an append-only
log that outside readers page through (`GET /v1/kv_events`, the Ray router's stats).

Posting is synchronous and never waits (same trio thread); a post replaces one record
and wakes the waiters. Nothing on the board is an order: actors still talk only through
their mailboxes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import attrs
import trio

if TYPE_CHECKING:
    from tqserve.actors.admission import AdmissionStatistics
    from tqserve.actors.cache_owner import CacheOwnerStatistics
    from tqserve.actors.hub import HubStatistics
    from tqserve.actors.prefix_cache import PrefixIndexStatistics
    from tqserve.actors.spill import SpillStatistics
    from tqserve.engine.kvevents import KvEventLog
    from tqserve.engine.scheduler import SchedulerStatistics
    from tqserve.engine.speculative.policy import SpeculationStatistics


@attrs.frozen(kw_only=True)
class BoardSnapshot:
    """The latest record of every actor (None until it first posts, or when the actor
    does not run: the prefix cache when off, speculation when off)."""

    admission: AdmissionStatistics | None = None
    scheduler: SchedulerStatistics | None = None
    cache_owner: CacheOwnerStatistics | None = None
    hub: HubStatistics | None = None
    prefix_cache: PrefixIndexStatistics | None = None
    spill: SpillStatistics | None = None
    speculation: SpeculationStatistics | None = None


class Board:
    """Where actors post their statistics and the facade reads them (module doc)."""

    def __init__(self) -> None:
        self.snapshot = BoardSnapshot()
        self.kv_events: KvEventLog | None = None  # the prefix cache's, when it is on
        self._changed = trio.Event()

    def post(self, **records: Any) -> None:
        """Replace the named actors' records (keyword: the BoardSnapshot field)."""
        self.snapshot = attrs.evolve(self.snapshot, **records)
        if self._changed.statistics().tasks_waiting:  # a fresh event only when one was used
            self._changed.set()
            self._changed = trio.Event()

    async def wait_until(self, condition: Callable[[BoardSnapshot], bool]) -> None:
        """Return once `condition(snapshot)` holds (checked now and after every post)."""
        while not condition(self.snapshot):
            await self._changed.wait()
