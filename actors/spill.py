"""Spill actor: the SSD tier's only owner. Every file operation of the prefix cache is an
order in its mailbox: writes (sync, or queued), loads for SSD hits, removals; it also
reconciles with what the directory still holds and, under --distributed, drives the other
ranks' shards of each file (actors.shard_group). Recovery runs once before the actor graph
starts (`Spill.recover`, from open_engine); from then on only this task touches the tier.

Owns: the SsdTier, rank 0's ShardGroup, the queued writes (their bytes, until each write
ends: a PENDING index entry is restored from them), the disk queue, its counts.
Receives (the spill mailbox, from the scheduler's prefix cache): SpillWrite, SpillLoad,
SpillRemove. The reader takes each order at once (so the scheduler never waits long on
this mailbox): writes and removals go to the disk worker, one at a time in order, each on
a worker thread; each load runs in a task of its own (it never waits behind writes) and
rebuilds its snapshot on the runner thread (`restore`), between steps. The sender keeps
at most WRITE_QUEUE async writes in flight (actors.prefix_ssd drops the others).
Sends (reply edge spill_replies, read by the scheduler; send_nowait into a mailbox sized
for every order in flight, `reply_mailbox_size`, so it never fills and this actor never
blocks on the scheduler): one SpillWritten per write, one SpillLoaded per load. Removals
are not answered. Each reply names the file keys found gone (`gone`: evicted by the budget, or a
file that failed its load; `live`: every key still held, after an unexplained loss) so
the index forgets them.
Posts: SpillStatistics to the board after every order it takes and every one it ends.

Files are untrusted: a file that fails a check on read is quarantined (counted), never
served. Logging: "snapshot removed <key>" before every unlink, "snapshot acknowledged
<key>" once a write is durable (on every rank), so an acknowledged file that is gone after
a crash was always announced.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable, Collection, Mapping
from typing import TYPE_CHECKING, Any

import attrs
import trio

from tqserve.actors.board import Board
from tqserve.actors.mailbox import Inbox, Outbox
from tqserve.actors.messages import SpillLoad, SpillLoaded, SpillRemove, SpillWrite, SpillWritten
from tqserve.engine.snapshot_layout import PlaneLayout
from tqserve.engine.speculative.state import paired_minimum
from tqserve.storage import Plane, SnapshotError, SnapshotHeader, SsdTier
from tqserve.storage.tier import TierEntry

if TYPE_CHECKING:
    from tqserve.actors.shard_group import ShardGroup

log = logging.getLogger("tqserve.prefix")
WRITE_QUEUE = 8  # async writes in flight; the sender drops any beyond it (counted)
DISK_QUEUE = 64  # orders waiting for the disk worker: WRITE_QUEUE writes and removals
SPILL_MAILBOX = 64  # a step's orders; the reader takes each at once (module doc)


def reply_mailbox_size(max_queued_requests: int) -> int:
    """Answers that can wait for the scheduler: one per order in flight (WRITE_QUEUE
    async writes, one sync write, one load per held request: held requests are queued,
    at most --max-queued-requests)."""
    return WRITE_QUEUE + 1 + max_queued_requests

Found = tuple[SnapshotHeader, dict[str, Plane]]
# rebuild a snapshot in the runner: (key, layer kinds, offset, boundary, planes, state) -> bytes
Restore = Callable[[str, str, int, int, dict[str, tuple[bytes, tuple[int, ...], str]], str],
                   Awaitable[int]]


@attrs.frozen(kw_only=True)
class SpillStatistics:
    spills: int            # writes acknowledged (durable on every rank)
    writes_pending: int    # writes queued or running
    quarantined: int       # files that failed a check (every rank's)
    ssd_write_errors: int  # writes that failed (every rank's)
    ssd_errors: int        # errors of the cache dir's file system (storage.health)
    ssd_state: str         # "ok", "read_only", "cold" (storage.health)
    tier_entries: int      # files the tier holds
    bytes_read: int        # bytes the tier read (headers at start, whole files on loads)


class Evictions:
    """The tier's `on_evict`: logs "snapshot removed <key>" (before the unlink) and keeps
    the keys until the spill actor takes them for its next reply."""

    def __init__(self) -> None:
        self._keys: list[str] = []

    def __call__(self, key: str) -> None:
        log.info("snapshot removed %s", key)
        self._keys.append(key)

    def take(self) -> list[str]:
        keys, self._keys = self._keys, []
        return keys


class Spill:
    """The SSD tier's files and the other ranks' shards of them (see the module doc)."""

    def __init__(self, tier: SsdTier, *, evictions: Evictions | None = None,
                 group: ShardGroup | None = None) -> None:
        self.tier = tier
        self.evictions = evictions or Evictions()
        self.group = group
        self.num_quarantined = 0
        self.num_spills = 0
        self.pending: dict[str, SpillWrite] = {}  # RAM key -> async write queued or running
        self._num_writes = 0  # writes queued or running, sync ones included

    def take(self, job: SpillWrite) -> None:
        """A write enters the disk queue (an async one's bytes serve its PENDING entry)."""
        self._num_writes += 1
        if not job.sync:
            self.pending[job.ram_key] = job

    async def recover(self, namespace: str, ours: Collection[str]) -> list[TierEntry]:
        """Recover the directory (verify, quarantine, index) and return the entries of
        namespaces `ours`; with a group, only those every rank holds a file of."""
        if self.group is not None:
            await self.group.start_recovery(namespace)
        try:
            report = await self.tier.recover_async()
        except OSError as exc:  # the user's directory: say which and why, no traceback
            raise ValueError(f"--cache-dir {str(self.tier.directory)!r} cannot be used: "
                             f"{exc.strerror or exc}") from exc
        self.num_quarantined += report.num_quarantined
        self.evictions.take()  # what recovery evicted is not indexed yet
        if self.group is not None:
            await self.group.agree([e.key for e in self.tier.entries()
                                    if e.header.namespace in ours])
        return [e for e in self.tier.entries() if e.header.namespace in ours]

    async def read(self, key: str) -> Found | None:
        """File `key`'s header and planes, verified on every rank; None if it is gone or
        fails a check (then it is quarantined)."""
        if self.group is not None:
            await self.group.fetch(key)
        found: Found | None
        try:
            found = await self.tier.get_async(key)
        except SnapshotError as exc:
            log.warning("snapshot %s failed verification on read: %s", key, exc.reason)
            self.num_quarantined += 1
            found = None
        except OSError as exc:
            log.warning("snapshot %s unreadable: %s", key, exc)
            await self.quarantine(key, f"unreadable: {exc}")
            found = None
        if self.group is not None:  # every rank read its file of it, or no rank restores it
            found = await self.group.fetched(key, found)
        return found

    async def load(self, order: SpillLoad, restore: Restore) -> SpillLoaded:
        """One SSD hit rebuilt in the runner (module doc)."""
        if order.pending:
            return await self._load_pending(order, restore)
        before = self.tier.statistics().num_entries
        found = await self.read(order.key)
        if found is None:  # missing, unreadable or forged: the directory may have changed
            gone = await trio.to_thread.run_sync(self.tier.reconcile)
            if self.group is not None and gone:
                await self.group.remove(gone)
            return SpillLoaded(key=order.key, temporary=order.temporary,
                               gone=(order.key, *gone), live=self._live(before - len(gone)))
        header, planes = found
        rebuild = (restore if self.group is None
                   else functools.partial(self.group.restore, order.key))
        try:
            if reuse_bound(header) > order.bound:
                raise ValueError("its reuse bound is above the one it was indexed with")
            num_bytes = await rebuild(order.temporary, str(header.extra.get("layer_kinds", "")),
                                      header.offset, header.minimum_reusable_offset,
                                      {n: (p.data, p.shape, p.dtype) for n, p in planes.items()},
                                      order.state)
        except Exception as exc:  # a file that cannot be restored, whatever the reason
            log.warning("snapshot %s does not fit this engine: %s", order.key, exc,
                        exc_info=not isinstance(exc, ValueError))
            await self.quarantine(order.key, f"cannot be restored: {exc}")
            return SpillLoaded(key=order.key, temporary=order.temporary, gone=(order.key,))
        return SpillLoaded(key=order.key, temporary=order.temporary, num_bytes=int(num_bytes))

    async def _load_pending(self, order: SpillLoad, restore: Restore) -> SpillLoaded:
        """A PENDING entry rebuilt from its queued write's bytes (our own: a failure is our
        bug, logged; the request runs cold). None when the write ended meanwhile."""
        job = self.pending.get(order.key)
        if job is None:
            return SpillLoaded(key=order.key, temporary=order.temporary)
        header = job.header
        try:
            num_bytes = await restore(
                order.temporary, str(header["extra"]["layer_kinds"]), header["offset"],
                header["minimum_reusable_offset"],
                {name: (data, shape, dtype) for name, data, shape, dtype in job.planes},
                order.state)
        except Exception:
            log.exception("snapshot %s could not be restored from its pending write",
                          job.ram_key)
            return SpillLoaded(key=order.key, temporary=order.temporary)
        return SpillLoaded(key=order.key, temporary=order.temporary, num_bytes=int(num_bytes))

    async def write(self, job: SpillWrite) -> SpillWritten:
        """Write `job`'s file (temp, fsync, rename, directory fsync); with a group, wait
        until every rank's file is durable (module doc)."""
        before = self.tier.statistics().num_entries
        stored, problem, disk = None, None, False
        try:
            stored = await self.tier.put_async(job.key, job.header, job.planes)
        except (OSError, ValueError) as exc:
            problem, disk = str(exc), isinstance(exc, OSError)
        if self.group is not None:  # acknowledged once every rank's file is durable
            problem = await self.group.written(job.order, job.key, mine=stored is not None,
                                               keep=job.keep) or problem
        self.pending.pop(job.ram_key, None)
        self._num_writes -= 1
        evicted = self.evictions.take()
        if self.group is not None and evicted:
            await self.group.remove(evicted)
        live = self._live(before - len(evicted) + (stored is not None))
        if stored is None or problem is not None:
            # A disk error was logged once by the tier (storage.health), not per snapshot.
            log.log(logging.DEBUG if disk else logging.WARNING, "snapshot %s abandoned: %s",
                    job.key, problem)
            return SpillWritten(ram_key=job.ram_key, key=job.key, problem=problem,
                                disk_error=disk, gone=evicted, live=live)
        log.info("snapshot acknowledged %s", job.key)
        self.num_spills += 1
        return SpillWritten(ram_key=job.ram_key, key=job.key, num_bytes=stored.num_bytes,
                            gone=evicted, live=live)

    def _live(self, expected: int) -> tuple[str, ...] | None:
        """Every key the tier holds, if it holds fewer than `expected` (less one: a write
        may have replaced its own file): files vanished, or the tier went cold; None when
        nothing unexplained was lost."""
        if self.tier.statistics().num_entries >= expected - 1:
            return None
        return tuple(e.key for e in self.tier.entries())

    async def quarantine(self, key: str, reason: str) -> None:
        """Move file `key` aside (counted), e.g. one that does not fit this engine."""
        if await trio.to_thread.run_sync(self.tier.quarantine, key, reason):
            self.num_quarantined += 1

    async def remove(self, keys: Collection[str]) -> None:
        """Remove the files of `keys` (superseded, forgotten), on every rank."""
        for key in keys:
            # Logged before the unlink: a kill in between leaves a file that is merely
            # not required, never an acknowledged file gone without a word.
            log.info("snapshot removed %s", key)
            await trio.to_thread.run_sync(functools.partial(self.tier.remove, key))
        if self.group is not None and keys:
            await self.group.remove(keys)

    def statistics(self) -> SpillStatistics:
        tier, group = self.tier.statistics(), self.group
        return SpillStatistics(
            spills=self.num_spills, writes_pending=self._num_writes,
            quarantined=self.num_quarantined + (group.num_quarantined if group else 0),
            ssd_write_errors=tier.num_write_errors + (group.num_write_errors if group else 0),
            ssd_errors=tier.num_errors, ssd_state=tier.state,
            tier_entries=tier.num_entries, bytes_read=tier.num_bytes_read)


async def run_spill(spill: Spill, inbox: Inbox, replies: Outbox, board: Board,
                    restore: Restore,
                    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """The spill actor (module doc) until its mailbox closes and its disk queue drains.
    Shielded: a caller cancelling open_engine's scope still gets every queued write done
    (at most WRITE_QUEUE), so a restart finds every snapshot that was queued."""
    disk_send, disk_receive = trio.open_memory_channel[SpillWrite | SpillRemove](DISK_QUEUE)

    def post() -> None:
        board.post(spill=spill.statistics())

    async def disk() -> None:
        async with disk_receive:
            async for order in disk_receive:
                if isinstance(order, SpillWrite):
                    _reply(replies, await spill.write(order))
                else:
                    await spill.remove(order.keys)
                post()

    async def load(order: SpillLoad) -> None:
        _reply(replies, await spill.load(order, restore))
        post()

    post()
    task_status.started()
    with trio.CancelScope(shield=True):
        async with replies, trio.open_nursery() as nursery:
            nursery.start_soon(disk)
            async with disk_send:
                async for order in inbox:
                    match order:
                        case SpillWrite():
                            spill.take(order)
                            await disk_send.send(order)
                        case SpillRemove():
                            await disk_send.send(order)
                        case SpillLoad():
                            nursery.start_soon(load, order)
                        case _:
                            raise TypeError(f"spill got unexpected {type(order).__name__}")
                    post()


def _reply(replies: Outbox, message: SpillWritten | SpillLoaded) -> None:
    try:
        replies.send_nowait(message)
    except (trio.ClosedResourceError, trio.BrokenResourceError):
        pass  # the scheduler is gone (shutdown): nobody waits for this answer


def header_validator(namespace: str, layout: PlaneLayout | None,
                     paired: Mapping[str, Any] | None = None
                     ) -> Callable[[SnapshotHeader], None]:
    """The SSD tier's `validate_header`: a header of this engine's namespace must describe
    planes this model restores (engine.snapshot.PlaneLayout), one of a paired namespace
    (`paired`: namespace -> engine.speculative.state.PairedLayout) the target's planes and
    its proposer's; other namespaces are never served by this engine, so they are left
    alone."""
    layouts: dict[str, Any] = {namespace: layout, **(paired or {})}

    def validate(header: SnapshotHeader) -> None:
        if header.namespace not in layouts:
            return
        checker = layouts[header.namespace]
        if checker is None:
            raise SnapshotError("this model's caches cannot be restored from snapshots")
        try:
            checker.check_header(header)
        except ValueError as exc:
            raise SnapshotError(f"does not fit this model: {exc}") from None

    return validate


def reuse_bound(header: SnapshotHeader) -> int:
    """The shortest reuse of a file's snapshot: its KV's boundary and its paired state's."""
    return max(header.minimum_reusable_offset, paired_minimum(header.extra))
