"""The prefix cache's SSD side: the scheduler's end of the spill actor's edges, and the
index entries that a file or a queued write stands behind.

Owns: the writes in flight (RAM key -> what the SSD entry will say once its write is
durable), the loads in flight (temporary runner keys s<n>), the spill mailbox's send end
and the spill_replies receive end. The PrefixIndex is the PrefixCache's
(actors.prefix_cache), which owns this object; the index changes here only as the spill
actor reports: a write once durable publishes its SSD entry, a spilled entry is PENDING
while its write is queued, and entries are forgotten when a reply names their files gone.
Everything runs in the scheduler's task: the spill actor (actors.spill) does the file
work in its own and answers on the reply edge, which the scheduler drains between steps
and waits on when idle. Plane bytes pass through here on their way to the spill actor
(produced on the runner thread, out of band in the message, never copied).

Write modes (`--ssd-write`): "through" (default with a cache dir): every published
snapshot is also written to the SSD tier; RAM pressure then only drops RAM copies.
"back": a snapshot reaches the disk only when RAM pressure evicts it (a spill).
Flush (`--ssd-flush`): "async" (default): a write is sent without waiting, and dropped
(counted in `spills_dropped`) when WRITE_QUEUE async writes are in flight already, so a
step never waits for the disk. "sync": the step's absorb waits for the write's answer
and publishes only after the file is durable.

Pending: once an entry's RAM copy is gone while its async write is queued or running, it
is PENDING: a hit restores it from the write's bytes (the spill actor holds them: an SSD
hit without reading the disk) until the write ends (then the SSD entry serves it). With
--distributed the other ranks keep no bytes to restore from, so there an entry leaves the
index with its RAM copy and is matchable again once its write is acknowledged; the
write orders to the other ranks go out before the next step (`ShardOrders`).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import attrs
import trio

from tqserve.actors.mailbox import Inbox, Outbox
from tqserve.actors.messages import (SpillLoad, SpillLoaded, SpillRemove, SpillWrite,
                                     SpillWritten)
from tqserve.actors.spill import WRITE_QUEUE
from tqserve.engine.prefix import PrefixEntry, PrefixIndex, Tier
from tqserve.engine.step import SpillPayload
from tqserve.storage import snapshot_key

if TYPE_CHECKING:
    from tqserve.actors.shard_group import ShardOrders

log = logging.getLogger("tqserve.prefix")


@attrs.frozen(kw_only=True)
class SnapshotWrite:
    """A snapshot on its way to disk: its bytes and what the SSD entry will say."""

    ram_key: str
    namespace: str
    tokens: tuple[int, ...]
    minimum_reusable_offset: int
    payload: SpillPayload


@attrs.frozen(kw_only=True)
class _InFlight:
    """What a write's SSD entry will say once it is durable."""

    namespace: str
    tokens: tuple[int, ...]
    minimum_reusable_offset: int
    pending: bool  # its RAM copy may go while it is queued (single process, async)
    sync: bool     # the scheduler waits for its answer (write_now)


class PrefixSsd:
    """The index's SSD side, owned by a PrefixCache (see the module doc). `tick` is the
    cache's LRU clock; `acknowledged(ram_key)` tells the cache a write is durable."""

    def __init__(self, index: PrefixIndex, *, fingerprint: str, flush: str,
                 outbox: Outbox | None, replies: Inbox | None, orders: ShardOrders | None,
                 tick: Callable[[], int], acknowledged: Callable[[str], None]) -> None:
        self.index = index  # the PrefixCache's
        self.fingerprint = fingerprint
        self.flush = flush
        self.outbox = outbox    # the spill actor's mailbox; None without a cache dir
        self.replies = replies  # its reply edge
        self.orders = orders    # --distributed: the other ranks' write orders
        self._tick = tick
        self._acknowledged = acknowledged
        self._ids = itertools.count()  # temporary keys s<n> (engine.orders numbers r, p)
        self.restoring: dict[str, str] = {}  # temporary runner key -> the SSD key it loads
        self._writes: dict[str, _InFlight] = {}  # RAM key -> its write, until answered
        self._sync_durable: dict[str, bool] = {}  # sync writes answered: durable or not
        self._loaded: list[SpillLoaded] = []  # loads answered, for the PrefixCache
        self.num_dropped = 0  # async writes dropped: WRITE_QUEUE were in flight

    @property
    def on(self) -> bool:
        """Whether there is an SSD tier (a cache dir)."""
        return self.outbox is not None

    def is_pending(self, key: str) -> bool:
        """Whether RAM key `key`'s async write is queued or running (single process)."""
        write = self._writes.get(key)
        return write is not None and write.pending

    def recovered(self, entries: list[tuple[str, str, tuple[int, ...], int, int]]) -> list[str]:
        """Index the recovered files (key, namespace, tokens, reuse bound, bytes), before
        the actors start; returns the keys their supersession leaves to remove."""
        removed: list[str] = []
        for key, namespace, tokens, bound, num_bytes in entries:
            if key in self.index:
                continue
            superseded, _ = self.index.publish(PrefixEntry(
                key=key, namespace=namespace, tokens=tokens, minimum_reusable_offset=bound,
                trimmable=True, num_bytes=num_bytes), Tier.SSD, self._tick())
            removed += superseded
        return removed

    async def load(self, key: str, state: str) -> str:
        """Ask the spill actor to rebuild SSD hit `key` (PENDING: from its write's bytes);
        returns the temporary runner key it will be held under."""
        assert self.outbox is not None
        temporary = f"s{next(self._ids)}"
        self.restoring[temporary] = key
        pending = self.index.tier(key) is Tier.PENDING
        entry = self.index.entry(key)
        await self.outbox.send(SpillLoad(key=key, temporary=temporary, pending=pending,
                                         bound=entry.minimum_reusable_offset, state=state))
        return temporary

    def write(self, job: SnapshotWrite, *, sync: bool = False) -> None:
        """Send `job` to the spill actor (never waits: past WRITE_QUEUE async writes in
        flight, or with its mailbox full, it is dropped and counted); its entry is pending
        until the answer (single process, async)."""
        if not sync and self._num_async >= WRITE_QUEUE:
            self.num_dropped += 1
            return
        key = snapshot_key(job.namespace, job.tokens)
        fields = {"model_fingerprint": self.fingerprint, "namespace": job.namespace,
                  "token_ids": job.tokens, "created_ns": time.time_ns()}
        order = self.orders.order(job.ram_key, key, fields) if self.orders is not None else 0
        message = SpillWrite(ram_key=job.ram_key, key=key, header={**job.payload.header,
                                                                   **fields},
                             planes=job.payload.planes, sync=sync, order=order,
                             keep=key in self.index)
        try:
            assert self.outbox is not None
            self.outbox.send_nowait(message)
        except trio.WouldBlock:
            log.warning("snapshot %s dropped: the spill mailbox is full", job.ram_key)
            self.num_dropped += 1
            return
        self._writes[job.ram_key] = _InFlight(
            namespace=job.namespace, tokens=job.tokens,
            minimum_reusable_offset=job.minimum_reusable_offset,
            pending=not sync and self.orders is None, sync=sync)

    async def write_now(self, job: SnapshotWrite) -> bool:
        """A sync flush: send the write, then wait for its answer (applying every other
        answer meanwhile); whether the file is durable."""
        self.write(job, sync=True)
        if self.orders is not None:
            await self.orders.send()
        assert self.replies is not None
        while job.ram_key in self._writes:
            await self.apply(await self.replies.receive())
        return self._sync_durable.pop(job.ram_key, False)

    async def send_spill(self, payload: SpillPayload, tokens: tuple[int, ...] | None) -> None:
        """A write-back spill of the tokens `tokens` (None: the cache lost them): the RAM
        copy is gone; write it or drop it."""
        if self.outbox is None or tokens is None or payload.key not in self.index:
            self.index.forget(payload.key)
            return
        entry = self.index.entry(payload.key)
        job = SnapshotWrite(ram_key=payload.key, namespace=entry.namespace, tokens=tokens,
                            payload=payload, minimum_reusable_offset=entry.minimum_reusable_offset)
        if self.flush == "sync":
            self.index.forget(payload.key)  # published on the SSD once durable
            await self.write_now(job)
            return
        self.write(job)
        if self.is_pending(payload.key):
            self.index.pending(payload.key)  # matchable from its bytes until written
        else:
            self.index.forget(payload.key)

    async def remove(self, keys: list[str]) -> None:
        """Have the spill actor remove the files of `keys`."""
        if self.outbox is not None and keys:
            await self.outbox.send(SpillRemove(keys=tuple(keys)))

    def take_replies(self) -> list[SpillWritten | SpillLoaded]:
        """Every answer waiting on the reply edge, without waiting."""
        out = []
        while self.replies is not None:
            try:
                out.append(self.replies.receive_nowait())
            except (trio.WouldBlock, trio.EndOfChannel):
                break
        return out

    async def apply(self, reply: SpillWritten | SpillLoaded) -> None:
        """Book one answer of the spill actor: a write's outcome, or a load's (kept for
        the PrefixCache: `take_loaded`)."""
        self._forget_gone(reply.gone, reply.live)
        match reply:
            case SpillWritten():
                await self._written(reply)
            case SpillLoaded():
                self.restoring.pop(reply.temporary, None)
                self._loaded.append(reply)
            case _:
                raise TypeError(f"scheduler got unexpected {type(reply).__name__}")

    def take_loaded(self) -> list[SpillLoaded]:
        loaded, self._loaded = self._loaded, []
        return loaded

    async def _written(self, reply: SpillWritten) -> None:
        write = self._writes.pop(reply.ram_key, None)
        if write is None:
            raise RuntimeError(f"an answer for write {reply.ram_key}, which was not sent")
        superseded: list[str] = []
        if write.sync:
            self._sync_durable[reply.ram_key] = reply.num_bytes is not None
        if reply.num_bytes is not None:
            self._acknowledged(reply.ram_key)
            if reply.key not in self.index:
                superseded, _ = self.index.publish(PrefixEntry(
                    key=reply.key, namespace=write.namespace, tokens=write.tokens,
                    minimum_reusable_offset=write.minimum_reusable_offset, trimmable=True,
                    num_bytes=reply.num_bytes), Tier.SSD, self._tick())
        if self.index.tier(reply.ram_key) is Tier.PENDING:  # its RAM copy went meanwhile
            self.index.forget(reply.ram_key)
        await self.remove(superseded)

    def _forget_gone(self, gone: tuple[str, ...], live: tuple[str, ...] | None) -> None:
        """Forget the SSD entries whose files a reply says are gone (`live`: every file
        left, when the tier lost some it could not name)."""
        for key in gone:
            if key in self.index and self.index.tier(key) is Tier.SSD:
                self.index.forget(key)
        if live is not None:
            kept = set(live)
            for key in self.index.keys(Tier.SSD):
                if key not in kept:
                    self.index.forget(key)

    @property
    def _num_async(self) -> int:
        """Async writes sent and not yet answered."""
        return sum(not w.sync for w in self._writes.values())
