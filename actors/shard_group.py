"""Rank 0's side of the SSD tier under tensor parallelism (`serve --distributed --cache-dir`).

Every rank writes its own shard of each persisted snapshot to its own directory
(storage.shard); the other ranks do their file work on a disk thread (storage.shard_disk)
under rank 0's orders, which reach them through the runner (engine.distributed.LeaderRunner:
a broadcast, in one order with the plans; engine.follower on their side).

* write orders (`ShardOrders`, the scheduler's prefix cache, in its task): a snapshot
  queued for the disk (or written now, --ssd-flush sync) is ordered written on every rank
  (`order`, numbered; `send` before the next step, since the other ranks keep a step's
  payloads only until the next one). Its number rides the SpillWrite to the spill actor;
* the rest (`ShardGroup`, the spill actor, actors.spill, in its task): rank 0 writes its
  own file, then `written` waits for every rank's report: the snapshot is acknowledged
  only once every rank's file is durable; if any rank failed, no rank keeps a file of it;
* loads: `fetch` orders every rank to read and verify its file while rank 0 reads its
  own; `fetched` waits for their reports, and only when every read passed is the snapshot
  restored, on every rank in one operation (`restore`). Otherwise it is a miss on every
  rank (the request runs cold): the bad file is quarantined by the rank that found it and
  every other rank's file of it is removed (a rank whose disk queue was full only reads
  again: its file is fine);
* recovery: `start_recovery` has every rank recover its own directory while rank 0
  recovers its own; `agree` keeps the keys that every rank holds and removes every rank's
  files of the others;
* `remove(keys)`: eviction, supersession or a vanished file on rank 0 removes the other
  ranks' files of those keys.

Reports come back only when rank 0 asks (the other ranks never start a collective): a
waiter polls (`LeaderRunner.shard_poll`: one broadcast, one gather, on the runner thread
between steps) every POLL_SECONDS until every rank has answered its order; one poll at a
time collects the answers for every waiter.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Any

import trio

from tqserve.actors.spill import header_validator
from tqserve.actors.runner_thread import RunnerThread
from tqserve.engine.distributed import LeaderRunner, ShardRestoreError
from tqserve.engine.snapshot_layout import PlaneLayout
from tqserve.storage import Plane, SnapshotHeader, SsdTier
from tqserve.storage.shard import ShardId
from tqserve.storage.shard_disk import ShardDisk

log = logging.getLogger("tqserve.prefix")
POLL_SECONDS = 0.01  # between polls while another rank's disk work is awaited (an fsync: ms)
# Another rank's SSD budget, as a multiple of rank 0's: rank 0's budget decides what stays
# (it orders every eviction), and a shard file's size is rank 0's within compression noise.
FOLLOWER_BUDGET = 2

Found = tuple[SnapshotHeader, dict[str, Plane]]


def agreed(mine: Collection[str], others: Iterable[Collection[str]]) -> set[str]:
    """The keys every rank holds (rank 0's, intersected with each other rank's)."""
    return set(mine).intersection(*others)


class ShardOrders:
    """The write orders of rank 0's prefix cache (module doc), numbered from 1."""

    def __init__(self, runner: LeaderRunner, thread: RunnerThread) -> None:
        self._runner, self._thread = runner, thread
        self._ids = itertools.count(1)
        self._unsent: list[tuple[int, str, str, dict[str, Any]]] = []

    def order(self, ram_key: str, key: str, fields: Mapping[str, Any]) -> int:
        """Every rank is to write its payload of snapshot `ram_key` (this step's) as file
        `key` with these header fields (sent by `send`); returns the order's number."""
        order = next(self._ids)
        self._unsent.append((order, ram_key, key, dict(fields)))
        return order

    async def send(self) -> None:
        """Hand the step's write orders to the other ranks (before the next step)."""
        if self._unsent:
            orders, self._unsent = tuple(self._unsent), []
            await self._thread.call(self._runner.shard, "shard_persist", orders)


class ShardGroup:
    """Rank 0's books of the other ranks' SSD work, driven by the spill actor (module
    doc). Read orders are numbered here, write orders by ShardOrders (their reports are
    told apart by kind)."""

    def __init__(self, runner: LeaderRunner, thread: RunnerThread, tier: SsdTier,
                 num_ranks: int) -> None:
        self._runner, self._thread, self._tier = runner, thread, tier
        self._others = num_ranks - 1
        self._ids = itertools.count(1)
        self._fetches: dict[str, int] = {}  # SSD key -> the order of its read
        self._reports: dict[tuple[str, int], dict[int, dict[str, Any]]] = {}
        self._polling = trio.Lock()
        self.num_quarantined = 0   # files the other ranks quarantined
        self.num_write_errors = 0  # writes that failed on another rank

    async def written(self, order: int, key: str, *, mine: bool, keep: bool) -> str | None:
        """Wait for every rank's write order `order`; None when all are durable (and rank
        0's, `mine`), else what failed. On a failure no rank keeps a file of `key`, unless
        `keep` (an earlier write of it was acknowledged)."""
        failed = {rank: report["reason"]
                  for rank, report in (await self._wait("write", order)).items()
                  if report["status"] != "ok"}
        self.num_write_errors += len(failed)
        if (failed or not mine) and not keep:
            await trio.to_thread.run_sync(self._tier.remove, key)
            await self.remove([key])
        return "; ".join(f"rank {rank}: {why}" for rank, why in sorted(failed.items())) or None

    async def fetch(self, key: str) -> None:
        """Every other rank starts reading its file `key` (one load of a key at a time)."""
        order = self._fetches[key] = next(self._ids)
        await self._thread.call(self._runner.shard, "shard_read", order, key)

    async def fetched(self, key: str, mine: Found | None) -> Found | None:
        """`mine` (rank 0's read) when every rank's read of `key` passed; else None, with
        every rank's file of `key` gone (quarantined where it was bad, removed elsewhere).
        A rank whose disk had no room for the read ("busy") reads it again (its queue
        drains: the file is fine)."""
        while True:
            reports = await self._wait("read", self._fetches[key])
            if mine is None or all(r["status"] != "busy" for r in reports.values()):
                break
            await self._thread.call(self._runner.shard, "shard_discard", self._fetches[key])
            await self.fetch(key)
        failed = {rank: report for rank, report in reports.items() if report["status"] != "ok"}
        for rank, report in sorted(failed.items()):
            log.warning("snapshot %s failed on rank %d (%s): %s", key, rank, report["status"],
                        report["reason"])
            self.num_quarantined += report["status"] == "quarantined"
        if mine is not None and not failed:
            return mine
        await self._thread.call(self._runner.shard, "shard_discard", self._fetches.pop(key))
        if await trio.to_thread.run_sync(self._tier.remove, key):
            log.info("snapshot removed %s", key)
        await self.remove([key])
        return None

    async def restore(self, ssd_key: str, key: str, kinds: str, offset: int, boundary: int,
                      planes: dict[str, tuple[bytes, tuple[int, ...], str]],
                      state: str = "") -> int:
        """Hold the fetched snapshot `ssd_key` under `key` on every rank; ValueError if any
        could not (no rank holds it then; the prefix cache quarantines rank 0's file if it
        was rank 0's fault: otherwise rank 0's file is removed here, the others' too)."""
        order = self._fetches.pop(ssd_key)
        try:
            return await self._thread.call(self._runner.restore_shards, key, ssd_key, order,
                                           kinds, offset, boundary, planes, state)
        except ShardRestoreError as exc:
            self.num_quarantined += len(set(exc.problems) - {0})
            if 0 not in exc.problems and await trio.to_thread.run_sync(self._tier.remove,
                                                                        ssd_key):
                log.info("snapshot removed %s", ssd_key)
            await self.remove([ssd_key])
            raise

    async def start_recovery(self, namespace: str) -> None:
        """Every other rank recovers its own directory (rank 0 then recovers its own)."""
        await self._thread.call(self._runner.shard, "shard_recover", namespace)

    async def agree(self, mine: Collection[str]) -> set[str]:
        """The keys every rank holds; every rank removes its files of the others. ValueError
        if another rank's directory cannot be used."""
        reports = await self._wait("recovered", 0)
        broken = [f"rank {rank}: {r['reason']}" for rank, r in sorted(reports.items())
                  if r["status"] != "ok"]
        if broken:
            raise ValueError(f"--cache-dir cannot be used: {'; '.join(broken)}")
        self.num_quarantined += sum(r["quarantined"] for r in reports.values())
        keys = agreed(mine, (r["keys"] for r in reports.values()))
        await self._thread.call(self._runner.shard, "shard_keep", tuple(sorted(keys)))
        for key in sorted(set(mine) - keys):
            log.info("snapshot removed %s: not held by every rank", key)
            await trio.to_thread.run_sync(self._tier.remove, key)
        return keys

    async def remove(self, keys: Iterable[str]) -> None:
        """The other ranks remove their files of `keys` (after their queued work)."""
        keys = tuple(keys)
        if keys:
            await self._thread.call(self._runner.shard, "shard_remove", keys)

    async def _wait(self, kind: str, order: int) -> dict[int, dict[str, Any]]:
        """Every other rank's report of order `order` of `kind`, by rank."""
        slot = (kind, order)
        while len(self._reports.get(slot, ())) < self._others:
            await trio.sleep(POLL_SECONDS)
            async with self._polling:
                if len(self._reports.get(slot, ())) < self._others:
                    polled = await self._thread.call(self._runner.shard_poll)
                    for rank, reports in enumerate(polled, start=1):
                        for report in reports:
                            self._reports.setdefault(
                                (report["kind"], report["order"]), {})[rank] = report
        return self._reports.pop(slot)


def follower_disk(config: Any, shard: ShardId) -> Callable[[str, str, PlaneLayout | None],
                                                            ShardDisk]:
    """The `open_disk(fingerprint, namespace, layout)` of a rank other than 0
    (engine.follower.run_follower): its shard of the cache dir, checked against its own
    model (fingerprint, plane layout) as rank 0's is."""

    def open_disk(fingerprint: str, namespace: str, layout: PlaneLayout | None) -> ShardDisk:
        tier = SsdTier(shard.directory(config.cache_dir),
                       FOLLOWER_BUDGET * config.ssd_cache_bytes,
                       expected_fingerprints=[fingerprint],
                       validate_header=header_validator(namespace, layout), shard=shard)
        return ShardDisk(tier, namespace)

    return open_disk
