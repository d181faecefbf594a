"""Spill: the SSD tier's only owner. Every file operation of the prefix cache goes through
one `Spill`: recovery at start, reads for SSD hits, writes (sync, or queued for the writer
task), removals, quarantine, and reconciling with what the directory still holds; under
--distributed also the other ranks' orders for their shards (actors.shard_group).

Owns: the SsdTier, rank 0's ShardGroup, the write queue (WRITE_QUEUE) and the writer task.
Used by: actors.prefix_cache, which owns the index: it calls in here (the scheduler's trio
task, sync calls or awaits of disk work on worker threads) and indexes what comes back;
the writer task (`run_writer`) hands each queued write back to the prefix cache's
`write`, which puts it here and then publishes it.
Sends: no messages; bulk plane bytes ride the write queue (not a msgpack mailbox).

Files are untrusted: a file that fails a check on read is quarantined (counted), never
served. Logging: "snapshot removed <key>" before every unlink, so an acknowledged file
that is gone after a crash was always announced (prefix_cache logs the acknowledgements).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Awaitable, Callable, Collection, Mapping
from typing import TYPE_CHECKING, Any

import attrs
import trio

from tqserve.engine.step import SpillPayload
from tqserve.engine.snapshot_layout import PlaneLayout
from tqserve.engine.speculative.state import paired_minimum
from tqserve.storage import Plane, SnapshotError, SnapshotHeader, SsdTier, snapshot_key
from tqserve.storage.tier import TierEntry

if TYPE_CHECKING:
    from tqserve.actors.shard_group import ShardGroup

log = logging.getLogger("tqserve.prefix")
WRITE_QUEUE = 8  # snapshots waiting for the disk in async mode; beyond it writes drop

Found = tuple[SnapshotHeader, dict[str, Plane]]


@attrs.frozen(kw_only=True)
class SnapshotWrite:
    """A snapshot on its way to disk: its bytes and what the SSD entry will say."""

    ram_key: str
    namespace: str
    tokens: tuple[int, ...]
    minimum_reusable_offset: int
    payload: SpillPayload


@attrs.frozen(kw_only=True)
class PutResult:
    """What a write came to: the file key, its entry once durable, else the problem."""

    key: str
    stored: TierEntry | None
    problem: str | None
    disk_error: bool  # an OSError: the tier logged it once (storage.health)


class Spill:
    """The SSD tier's files and the other ranks' shards of them (see the module doc)."""

    def __init__(self, tier: SsdTier, *, fingerprint: str,
                 group: ShardGroup | None = None) -> None:
        self.tier = tier
        self.fingerprint = fingerprint
        self.group = group
        self.num_quarantined = 0
        self._queue: trio.MemorySendChannel[SnapshotWrite] | None = None
        self._writer_done = trio.Event()

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

    async def restore(self, key: str, temporary: str, bound: int,
                      runner_call: Callable[..., Awaitable[int]],
                      state_of: Callable[[str], str | None]) -> tuple[int | None, bool]:
        """Read file `key` and rebuild it in the runner as snapshot `temporary` (on every
        rank, with a group): (its bytes, False), or (None, gone): gone when the file was
        missing or failed verification, else it did not fit this engine (quarantined)."""
        found = await self.read(key)
        if found is None:
            return None, True
        header, planes = found
        kinds = str(header.extra.get("layer_kinds", ""))
        arrays = {name: (p.data, p.shape, p.dtype) for name, p in planes.items()}
        rebuild = (runner_call if self.group is None
                   else functools.partial(self.group.restore, key))
        try:
            if reuse_bound(header) > bound:
                raise ValueError("its reuse bound is above the one it was indexed with")
            num_bytes = await rebuild(temporary, kinds, header.offset,
                                      header.minimum_reusable_offset, arrays,
                                      state_of(header.namespace) or "")
        except Exception as exc:  # a file that cannot be restored, whatever the reason
            log.warning("snapshot %s does not fit this engine: %s", key, exc,
                        exc_info=not isinstance(exc, ValueError))
            await self.quarantine(key, f"cannot be restored: {exc}")
            return None, False
        return int(num_bytes), False

    async def quarantine(self, key: str, reason: str) -> None:
        """Move file `key` aside (counted), e.g. one that does not fit this engine."""
        if await trio.to_thread.run_sync(self.tier.quarantine, key, reason):
            self.num_quarantined += 1

    def identity(self, job: SnapshotWrite) -> tuple[str, dict[str, Any]]:
        """The file key of `job` and the header fields every rank writes alike."""
        return snapshot_key(job.namespace, job.tokens), {
            "model_fingerprint": self.fingerprint, "namespace": job.namespace,
            "token_ids": job.tokens, "created_ns": time.time_ns()}

    def order(self, job: SnapshotWrite) -> None:
        """--distributed: every other rank is to write its shard of `job` too."""
        if self.group is not None:
            key, fields = self.identity(job)
            self.group.order(job.ram_key, key, fields)

    async def send_orders(self) -> None:
        """--distributed: hand the step's write orders to the other ranks."""
        if self.group is not None:
            await self.group.send_orders()

    async def put(self, job: SnapshotWrite, keep: Callable[[str], bool]) -> PutResult:
        """Write `job`'s file (temp, fsync, rename, directory fsync); with a group, wait
        until every rank's file is durable. `keep(key)`: whether the other ranks keep
        their files of it should this rank's write fail."""
        key, fields = self.identity(job)
        stored, problem, disk = None, None, False
        try:
            stored = await self.tier.put_async(key, {**job.payload.header, **fields},
                                               job.payload.planes)
        except (OSError, ValueError) as exc:
            problem, disk = str(exc), isinstance(exc, OSError)
        if self.group is not None:  # acknowledged once every rank's file is durable
            problem = await self.group.written(job.ram_key, key, mine=stored is not None,
                                               keep=keep(key)) or problem
        return PutResult(key=key, stored=stored, problem=problem, disk_error=disk)

    async def remove(self, keys: list[str]) -> None:
        """Remove the files of `keys` (superseded, evicted), on every rank."""
        for key in keys:
            # Logged before the unlink: a kill in between leaves a file that is merely
            # not required, never an acknowledged file gone without a word.
            log.info("snapshot removed %s", key)
            await trio.to_thread.run_sync(functools.partial(self.tier.remove, key))
        if self.group is not None:
            await self.group.remove(keys)

    async def live_keys(self, *, reconcile: bool) -> set[str]:
        """The keys whose files the tier holds; `reconcile` first re-reads the directory
        (a file was missing or unreadable; every key goes if the tier went cold)."""
        if reconcile:
            await trio.to_thread.run_sync(self.tier.reconcile)
        return {e.key for e in self.tier.entries()}

    @property
    def num_entries(self) -> int:
        return self.tier.statistics().num_entries

    def enqueue_nowait(self, job: SnapshotWrite) -> None:
        """Queue `job` for the writer task; trio.WouldBlock when full (or no writer)."""
        if self._queue is None:
            raise trio.WouldBlock
        self._queue.send_nowait(job)

    @property
    def num_queued(self) -> int:
        return self._queue.statistics().current_buffer_used if self._queue else 0

    def error_counts(self) -> dict[str, int]:
        """Quarantined files, failed writes and file-system errors, every rank's."""
        tier, group = self.tier.statistics(), self.group
        return {"quarantined": self.num_quarantined + (group.num_quarantined if group else 0),
                "ssd_write_errors": tier.num_write_errors
                + (group.num_write_errors if group else 0),
                "ssd_errors": tier.num_errors}

    async def close_writes(self) -> None:
        """No more writes: close the queue and wait until the writer wrote what it holds."""
        if self._queue is not None:
            self._queue.close()
            await self._writer_done.wait()


async def run_writer(spill: Spill, write: Callable[[SnapshotWrite], Awaitable[bool]],
                     task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """The async-flush writer task: hands queued snapshots to `write` one at a time, until
    the queue's send end is closed (`close_writes`) and everything queued is written."""
    send, receive = trio.open_memory_channel[SnapshotWrite](WRITE_QUEUE)
    spill._queue = send
    task_status.started()
    try:
        # Shielded: a caller cancelling open_engine's scope still gets the queue drained
        # (at most WRITE_QUEUE writes); the loop ends when close_writes closes the queue.
        with trio.CancelScope(shield=True):
            async with receive:
                async for job in receive:
                    await write(job)
    finally:
        spill._writer_done.set()


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
