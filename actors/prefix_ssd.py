"""The prefix cache's SSD side: the index entries that a file or a queued write stands
behind, and every call the prefix cache makes into actors.spill.

Owns: the pending writes (RAM key -> its queued or running async write, until it ends),
the restores in flight (temporary runner keys s<n>), the write counts. The PrefixIndex is
the PrefixCache's (actors.prefix_cache), which owns this object; here the index changes
only as the SSD tier reports: SSD entries are published (recovery; a write once durable),
a spilled entry is marked PENDING, and an entry is forgotten when its write ended with no
RAM copy left or its file is gone. Plane bytes pass through here on their way to disk
(produced on the runner thread, never tensors).

Tasks: everything runs in the scheduler's task, called by the PrefixCache, except `write`
with --ssd-flush async: spill's writer task takes each queued write from the bounded queue
(actors.spill.WRITE_QUEUE) and hands it to `write` here, which publishes it once durable
(same trio thread, no await in between), so there is no edge back and the graph stays a
DAG. Shutdown: the scheduler stops, then `close_writes` closes the queue; the writer
drains it.

Write modes (`--ssd-write`): "through" (default with a cache dir): every published
snapshot is also written to the SSD tier; RAM pressure then only drops RAM copies.
"back": a snapshot reaches the disk only when RAM pressure evicts it (a spill).
Flush (`--ssd-flush`): "async" (default): writes go through the bounded queue to the
writer task; `send_nowait`, and a full queue drops the write (counted in `spills_dropped`),
so a step never waits for the disk. "sync": the step's absorb awaits the write (on a
worker thread) and publishes only after the file is durable.

Pending: once an entry's RAM copy is gone while its async write is queued or running, it
is PENDING: a hit restores it from the write's bytes (as an SSD hit, without reading the
disk) until the write is acknowledged (then the SSD entry serves it) or abandoned. With
--distributed the other ranks keep no bytes to restore from, so there an entry leaves the
index with its RAM copy and is matchable again once its write is acknowledged.

Acknowledgement: a snapshot is acknowledged when its file is durable (actors.spill) on
every rank; then "snapshot acknowledged <key>" is logged on tqserve.prefix. Files dropped
later (superseded, evicted) log "snapshot removed <key>" before the unlink.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import attrs
import trio

from tqserve.actors.spill import Spill, SnapshotWrite, reuse_bound
from tqserve.engine.namespaces import CacheNamespaces
from tqserve.engine.prefix import PrefixEntry, PrefixIndex, Tier
from tqserve.engine.step import SpillPayload

if TYPE_CHECKING:
    from tqserve.actors.shard_group import ShardGroup

log = logging.getLogger("tqserve.prefix")


@attrs.frozen(kw_only=True)
class PrefixSsdStatistics:
    """The SSD side's part of PrefixCacheStatistics (same names; see there)."""

    spills: int
    spills_dropped: int
    quarantined: int
    ssd_write_errors: int
    ssd_errors: int
    ssd_state: str
    writes_pending: int


class PrefixSsd:
    """The index's SSD side, owned by a PrefixCache (see the module doc). `tick` is the
    cache's LRU clock; `acknowledged(ram_key)` tells the cache a write is durable."""

    def __init__(self, index: PrefixIndex, spill: Spill | None, *, flush: str,
                 namespaces: CacheNamespaces, runner_call: Callable[..., Any],
                 tick: Callable[[], int], acknowledged: Callable[[str], None]) -> None:
        self.index = index  # the PrefixCache's
        self.spill = spill  # the SSD tier's only owner; None without a cache dir
        self.flush = flush
        self.namespaces = namespaces
        self._runner_call = runner_call  # awaitable: run a function on the runner thread
        self._tick = tick
        self._acknowledged = acknowledged
        self._ids = itertools.count()  # temporary keys s<n> (engine.orders numbers r, p)
        self.restoring: set[str] = set()  # runner keys of restores in flight
        self._pending: dict[str, SnapshotWrite] = {}  # RAM key -> its async write, until it ends
        self._counts = {"spills": 0, "spills_dropped": 0}

    @property
    def group(self) -> ShardGroup | None:
        return self.spill.group if self.spill is not None else None

    def is_pending(self, key: str) -> bool:
        """Whether RAM key `key` has an async write queued or running (single process)."""
        return key in self._pending

    async def recover(self, namespace: str) -> None:
        """Index the SSD tier's verified files of `namespace` and its paired namespaces
        (after SsdTier.recover)."""
        if self.spill is None:
            return
        for entry in await self.spill.recover(namespace, self.namespaces.all()):
            header = entry.header
            if entry.key in self.index:
                continue
            superseded, _ = self.index.publish(PrefixEntry(
                key=entry.key, namespace=header.namespace, tokens=header.token_ids,
                minimum_reusable_offset=reuse_bound(header), trimmable=True,
                num_bytes=entry.num_bytes), Tier.SSD, self._tick())
            await self._remove_files(superseded)

    async def restore(self, key: str) -> tuple[str, int] | None:
        """SSD hit `key` rebuilt in the runner: (its temporary runner key, its bytes), from
        its pending write's bytes or else its file; None if it is gone since the lookup (its
        write ended) or cannot be restored (the request runs cold)."""
        job = self._pending.get(key) if self.index.tier(key) is Tier.PENDING else None
        if job is not None:
            return await self._restore_pending(job)
        if key in self.index and self.index.tier(key) is Tier.SSD:
            return await self._restore_file(key, self.index.entry(key))
        return None

    async def _restore_file(self, key: str, entry: PrefixEntry) -> tuple[str, int] | None:
        """The SSD entry `key` rebuilt in the runner (actors.spill); None if its file is gone
        or fails any check (such a file is quarantined)."""
        if self.spill is None:
            return None
        temporary = f"s{next(self._ids)}"
        self.restoring.add(temporary)
        try:
            num_bytes, gone = await self.spill.restore(
                key, temporary, entry.minimum_reusable_offset, self._runner_call,
                self.namespaces.state_of)
        finally:
            self.restoring.discard(temporary)
        if num_bytes is None:
            self.index.forget(key)
            if gone:  # a file was missing or unreadable: drop every entry whose file vanished
                await self._forget_gone(reconcile=True)
            return None
        return temporary, num_bytes

    async def _restore_pending(self, job: SnapshotWrite) -> tuple[str, int] | None:
        """A PENDING entry rebuilt in the runner from its write's bytes (our own: a failure
        is our bug, logged; the request runs cold)."""
        temporary = f"s{next(self._ids)}"
        header = job.payload.header
        planes = {name: (data, tuple(shape), dtype)
                  for name, data, shape, dtype in job.payload.planes}
        self.restoring.add(temporary)
        try:
            num_bytes = await self._runner_call(
                temporary, str(header["extra"]["layer_kinds"]), header["offset"],
                header["minimum_reusable_offset"], planes,
                self.namespaces.state_of(job.namespace) or "")
        except Exception:
            log.exception("snapshot %s could not be restored from its pending write",
                          job.ram_key)
            return None
        finally:
            self.restoring.discard(temporary)
        return temporary, int(num_bytes)

    async def _forget_gone(self, *, reconcile: bool = False) -> None:
        """Forget the SSD entries the tier no longer holds (evicted, vanished, cold: with
        `reconcile`, every one if the tier went cold: storage.health)."""
        if self.spill is None:
            return
        live = await self.spill.live_keys(reconcile=reconcile)
        gone = [k for k in self.index.keys(Tier.SSD) if k not in live]
        for key in gone:
            self.index.forget(key)
        if self.group is not None and gone:
            await self.group.remove(gone)

    def enqueue(self, job: SnapshotWrite) -> None:
        """Queue `job` for the writer task (a full queue drops it, counted); its entry is
        pending until the write ends (single process: see the module doc)."""
        try:
            if self.spill is None:
                raise trio.WouldBlock
            self.spill.enqueue_nowait(job)
        except trio.WouldBlock:
            self._counts["spills_dropped"] += 1
            return
        if self.group is None:
            self._pending[job.ram_key] = job
        self._order(job)

    def _order(self, job: SnapshotWrite) -> None:
        """--distributed: every other rank is to write its shard of `job` too."""
        if self.spill is not None:
            self.spill.order(job)

    async def write_now(self, job: SnapshotWrite) -> bool:
        """A sync flush: order the other ranks' writes, then `write`."""
        self._order(job)
        if self.spill is not None:
            await self.spill.send_orders()
        return await self.write(job)

    async def send_spill(self, payload: SpillPayload, tokens: tuple[int, ...] | None) -> None:
        """A write-back spill of the tokens `tokens` (None: the cache lost them): the RAM
        copy is gone; write it or drop it."""
        if self.spill is None or tokens is None or payload.key not in self.index:
            self.index.forget(payload.key)
            return
        entry = self.index.entry(payload.key)
        job = SnapshotWrite(ram_key=payload.key, namespace=entry.namespace, tokens=tokens,
                     payload=payload, minimum_reusable_offset=entry.minimum_reusable_offset)
        if self.flush == "sync":
            self.index.forget(payload.key)  # published on the SSD once durable
            await self.write_now(job)
            return
        self.enqueue(job)
        if payload.key in self._pending:
            self.index.pending(payload.key)  # matchable from its bytes until written
        else:
            self.index.forget(payload.key)

    async def write(self, job: SnapshotWrite) -> bool:
        """Write one snapshot to the SSD tier and index it there; False if it failed."""
        if self.spill is None:
            raise RuntimeError("write without an SSD tier")
        put = await self.spill.put(job, keep=lambda key: key in self.index)
        key, stored, problem = put.key, put.stored, put.problem
        if stored is None or problem is not None:
            self._end_pending(job)
            # A disk error was logged once by the tier (storage.health), not per snapshot.
            log.log(logging.DEBUG if put.disk_error else logging.WARNING,
                    "snapshot %s abandoned: %s", key, problem)
            await self._tier_shrank()  # a write may find the tier gone cold
            return False
        log.info("snapshot acknowledged %s", key)
        self._counts["spills"] += 1
        self._acknowledged(job.ram_key)
        superseded: list[str] = []
        if key not in self.index:
            superseded, _ = self.index.publish(PrefixEntry(
                key=key, namespace=job.namespace, tokens=job.tokens,
                minimum_reusable_offset=job.minimum_reusable_offset, trimmable=True,
                num_bytes=stored.num_bytes), Tier.SSD, self._tick())
        self._end_pending(job)  # with no await since the publish: always one matches
        await self._remove_files(superseded)
        await self._tier_shrank()  # the tier may have evicted files, or gone cold
        return True

    async def _tier_shrank(self) -> None:
        """After a write: the tier holds fewer entries than the index knows (it evicted
        some, or went cold): forget those."""
        if self.spill is not None and self.spill.num_entries < self.index.statistics().ssd_entries:
            await self._forget_gone()

    def _end_pending(self, job: SnapshotWrite) -> None:
        """`job`'s write ended: its PENDING entry (if its RAM copy went) leaves the index."""
        self._pending.pop(job.ram_key, None)
        if self.index.tier(job.ram_key) is Tier.PENDING:
            self.index.forget(job.ram_key)

    async def _remove_files(self, keys: list[str]) -> None:
        if self.spill is not None:
            await self.spill.remove(keys)

    def statistics(self) -> PrefixSsdStatistics:
        spill = self.spill
        errors = spill.error_counts() if spill is not None else {}
        return PrefixSsdStatistics(
            spills=self._counts["spills"], spills_dropped=self._counts["spills_dropped"],
            quarantined=errors.get("quarantined", 0), ssd_errors=errors.get("ssd_errors", 0),
            ssd_write_errors=errors.get("ssd_write_errors", 0),
            ssd_state=spill.tier.statistics().state if spill is not None else "off",
            writes_pending=spill.num_queued if spill is not None else 0)

    async def close_writes(self) -> None:
        """No more writes: the writer task writes what is queued, then returns."""
        if self.spill is not None:
            await self.spill.close_writes()
