"""A follower rank's disk work for the SSD tier (`serve --distributed --cache-dir`).

A rank other than 0 runs no trio: its step loop (engine.follower) receives rank 0's orders
and hands every file operation to a `ShardDisk`, whose one thread runs them in order (a
removal queued after a write of the same key runs after it), so the step loop never waits
for the disk. What each order came to is kept as a result record (a dict of plain values)
until the step loop takes them for rank 0, which polls for them: it acknowledges a
snapshot only once every rank's file is durable, and restores one only when every rank
read its file.

Orders (called on the step loop's thread; none blocks):
  * `recover()`: rebuild this shard's index (SsdTier.recover: temporaries deleted,
    headers checked, bad files quarantined); result kind "recovered" with the keys of
    this namespace that passed and the number quarantined;
  * `keep(keys)`: remove every file of this namespace not in `keys` (the keys every rank
    holds: the others can never be restored together);
  * `write(order, key, fields, planes)`: SsdTier.put (temp file, fsync, rename, directory
    fsync); result kind "write";
  * `read(order, key)`: SsdTier.get (every checksum; a bad file is quarantined here, on
    the rank that found it); the planes wait for `take_read(order)` or `discard(order)`;
    result kind "read" with status "ok", "missing", "quarantined" or "busy";
  * `remove(keys)`, `quarantine(key, reason)`.

Bounds: at most `max_jobs` writes and reads are queued, running or holding planes; beyond
that an order fails at once with status "busy" (rank 0 abandons that write, or orders that
read again). Removals, quarantines and the recovery are never dropped: each concerns
files this rank holds. `close()` runs what is queued, then stops the thread.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Any

from tqserve.storage.snapshot import Plane, SnapshotError, SnapshotHeader
from tqserve.storage.tier import SsdTier

logger = logging.getLogger("tqserve.storage.shard")
MAX_JOBS = 16  # writes and reads in flight: rank 0's write queue (8) plus a few loads

Result = dict[str, Any]


def _result(kind: str, order: int, status: str, reason: str = "", **more: Any) -> Result:
    return {"kind": kind, "order": order, "status": status, "reason": reason, **more}


class ShardDisk:
    """One rank's SsdTier, worked by one thread in order (see the module doc)."""

    def __init__(self, tier: SsdTier, namespace: str, max_jobs: int = MAX_JOBS) -> None:
        self.tier = tier
        self.namespace = namespace
        self.max_jobs = max_jobs
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()  # results, held planes, the job count
        self._results: list[Result] = []
        self._held: dict[int, tuple[SnapshotHeader, dict[str, Plane]]] = {}
        self._reading: set[int] = set()    # reads queued or running
        self._discarded: set[int] = set()  # of those, the ones let go of already
        self._num_jobs = 0  # writes and reads queued, running or holding planes
        self._thread = threading.Thread(target=self._run, name="tqserve-shard-disk",
                                        daemon=True)
        self._thread.start()

    def recover(self) -> None:
        self._jobs.put(self._reporting("recovered", 0, self._recover, bounded=False))

    def keep(self, keys: Collection[str]) -> None:
        self._jobs.put(lambda: self._keep(frozenset(keys)))

    def write(self, order: int, key: str, fields: Mapping[str, Any],
              planes: Sequence[tuple[str, bytes, Sequence[int], str]]) -> None:
        if self._admit("write", order):
            self._jobs.put(self._reporting("write", order,
                                           lambda: self._write(order, key, fields, planes)))

    def fail_write(self, order: int, reason: str) -> None:
        """An order this rank cannot even queue (e.g. its snapshot is not staged)."""
        self._report(_result("write", order, "error", reason))

    def read(self, order: int, key: str) -> None:
        if self._admit("read", order):
            with self._lock:
                self._reading.add(order)
            self._jobs.put(self._reporting("read", order, lambda: self._read(order, key)))

    def take_read(self, order: int) -> tuple[SnapshotHeader, dict[str, Plane]] | None:
        """The planes read for `order` (once); None if its read did not pass."""
        with self._lock:
            found = self._held.pop(order, None)
            if found is not None:
                self._num_jobs -= 1
            return found

    def discard(self, order: int) -> None:
        """Let go of the planes of `order`, now or, if its read still runs, when it ends."""
        with self._lock:
            if order in self._held:
                del self._held[order]
                self._num_jobs -= 1
            elif order in self._reading:
                self._discarded.add(order)

    def remove(self, keys: Iterable[str]) -> None:
        keys = tuple(keys)
        self._jobs.put(lambda: self._remove(keys))

    def quarantine(self, key: str, reason: str) -> None:
        self._jobs.put(lambda: self._quarantine(key, reason))

    def take_results(self) -> list[Result]:
        """Results since the last call, in the order their jobs finished."""
        with self._lock:
            results, self._results = self._results, []
            return results

    def close(self) -> None:
        """Run every queued job, then stop the thread."""
        self._jobs.put(None)
        self._thread.join()

    def _admit(self, kind: str, order: int) -> bool:
        with self._lock:
            if self._num_jobs >= self.max_jobs:
                self._results.append(_result(kind, order, "busy",
                                             f"{self.max_jobs} disk jobs in flight"))
                return False
            self._num_jobs += 1
            return True

    def _reporting(self, kind: str, order: int, job: Callable[[], None],
                   bounded: bool = True) -> Callable[[], None]:
        """`job`, which reports its result; if it raises (our bug: logged), an "error"
        result instead, so rank 0 never waits for a result that cannot come."""

        def run() -> None:
            try:
                job()
            except Exception as exc:
                logger.exception("shard disk job %s %d failed", kind, order)
                self._report(_result(kind, order, "error", f"{type(exc).__name__}: {exc}",
                                     keys=(), quarantined=0), release=bounded)

        return run

    def _report(self, result: Result, release: bool = False) -> None:
        with self._lock:
            self._results.append(result)
            if release:
                self._num_jobs -= 1
            if result["kind"] == "read":
                self._reading.discard(result["order"])
                self._discarded.discard(result["order"])

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                job()
            except Exception:  # our bug: logged; the thread serves the next order
                logger.exception("shard disk job failed")

    def _recover(self) -> None:
        try:
            report = self.tier.recover()
        except (OSError, ValueError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            self._report(_result("recovered", 0, "error", f"{self.tier.directory}: {reason}",
                                 keys=(), quarantined=0))
            return
        keys = tuple(e.key for e in self.tier.entries() if e.header.namespace == self.namespace)
        self._report(_result("recovered", 0, "ok", keys=keys,
                             quarantined=report.num_quarantined))

    def _keep(self, keys: frozenset[str]) -> None:
        for entry in self.tier.entries():
            if entry.header.namespace == self.namespace and entry.key not in keys:
                logger.info("snapshot removed %s: not held by every rank", entry.key)
                self.tier.remove(entry.key)

    def _write(self, order: int, key: str, fields: Mapping[str, Any],
               planes: Sequence[tuple[str, bytes, Sequence[int], str]]) -> None:
        try:
            self.tier.put(key, fields, planes)
        except (OSError, ValueError) as exc:
            logger.warning("snapshot %s abandoned: %s", key, exc)
            self._report(_result("write", order, "error", str(exc)), release=True)
            return
        self._report(_result("write", order, "ok"), release=True)

    def _read(self, order: int, key: str) -> None:
        try:
            found = self.tier.get(key)
        except SnapshotError as exc:  # get quarantined it
            self._report(_result("read", order, "quarantined", exc.reason), release=True)
            return
        except OSError as exc:
            moved = self.tier.quarantine(key, f"unreadable: {exc}")
            self._report(_result("read", order, "quarantined" if moved else "missing",
                                 f"unreadable: {exc}"), release=True)
            return
        if found is None:
            self.tier.reconcile()
            self._report(_result("read", order, "missing", "no such file"), release=True)
            return
        with self._lock:
            self._results.append(_result("read", order, "ok"))
            self._reading.discard(order)
            if order in self._discarded:
                self._discarded.remove(order)
                self._num_jobs -= 1
            else:
                self._held[order] = found

    def _remove(self, keys: tuple[str, ...]) -> None:
        for key in keys:
            self.tier.remove(key)

    def _quarantine(self, key: str, reason: str) -> None:
        self.tier.quarantine(key, reason)
