"""The SSD tier: a directory of snapshot files and the in-memory index over them.

`SsdTier` does the file I/O and keeps the order of it; what it indexes and counts is its
books (storage.books), how it reads a file is its reader (storage.reader). It is plain sync
code; `put_async` / `get_async` / `recover_async` run it on a worker thread through
`trio.to_thread.run_sync`, so zstd, file I/O and fsync never block the event loop. A lock
guards the books and is never held across file I/O (so `statistics()` and `entries()` never
wait for a write's fsync); a second lock makes writes (with their evictions) run one at a
time; encoding and reads run in parallel.

Lifecycle: construct, `recover()` once (it builds the index from disk), then `put` / `get` /
`remove`. Every file is untrusted input: recovery (storage.recovery) checks headers only,
`get` the whole file (storage.reader). Files that fail any check are moved to `quarantine/` with a logged
reason, never served. `reconcile` drops entries whose files have vanished. Eviction is
oldest-written first (storage.books); indexed files never total more than `max_bytes`.

After `recover`, no error of the directory's file system escapes `get`, `reconcile` or
`remove` (storage.health): a directory that cannot be searched any more (EACCES, ENOTDIR:
replaced by a file, gone, EIO) makes the tier cold (every entry dropped, the call a miss);
a failed write or removal makes it read-only for a while (`put` raises OSError, counted in
`num_write_errors`). A write finding the directory removed creates it again (private, as
at start) and goes on.
"""

import contextlib
import functools
import logging
import os
import stat
import threading
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import trio

from tqserve.storage.books import SEQUENCE_FIELD, TierBooks
from tqserve.storage.books import TierEntry as TierEntry  # `as`: a re-export
from tqserve.storage.cachedir import (QUARANTINE_DIR as QUARANTINE_DIR, directory_problem,
    prepare_directory, quarantine_entry)  # `as`: a re-export
from tqserve.storage.health import RETRY_SECONDS, TierHealth
from tqserve.storage.reader import SnapshotReader
from tqserve.storage.recovery import RecoveryReport as RecoveryReport  # `as`: a re-export
from tqserve.storage.recovery import scan
from tqserve.storage.shard import ShardId
from tqserve.storage.snapshot import (Plane, SnapshotError, SnapshotHeader, decode_header,
                                      encode_snapshot)
from tqserve.storage.writer import (fsync_directory, snapshot_path, validate_key,
                                    write_snapshot_file)

logger = logging.getLogger(__name__)


@attrs.frozen(kw_only=True)
class TierStatistics:
    """Counters since construction, plus the index's current size."""

    num_entries: int
    num_bytes: int
    num_hits: int
    num_misses: int
    num_writes: int
    num_quarantined: int
    num_evicted: int
    num_write_errors: int
    num_bytes_read: int
    num_errors: int  # errors of the directory's file system (storage.health)
    state: str       # "ok", "read_only" or "cold" (storage.health.TierState)


class SsdTier:
    """Snapshot files in one directory, bounded by `max_bytes`, verified on every read."""

    def __init__(
        self,
        directory: str | Path,
        max_bytes: int,
        zstd_level: int = 3,
        expected_fingerprints: Collection[str] | None = None,
        expected_namespaces: Collection[str] | None = None,
        on_evict: Callable[[str], None] | None = None,
        validate_header: Callable[[SnapshotHeader], None] | None = None,
        shard: ShardId | None = None,
        clock: Callable[[], float] = time.monotonic,
        retry_seconds: float = RETRY_SECONDS,
    ) -> None:
        """`on_evict(key)` runs before each evicted file is unlinked (during recover under
        the tier's lock, during put outside it; it must not call back into the tier).
        `validate_header(header)` raises SnapshotError for a header this tier must not index
        or serve (checked at recovery and every load; pure: no I/O, any thread).
        `shard`: this tier holds one rank's shard (storage.shard): its files say so, and
        files of another shard or of a single process are refused (None: a single process).
        `clock`, `retry_seconds`: the pause of writes after a failed one (storage.health)."""
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        self.directory = Path(directory)
        self.max_bytes = max_bytes
        self.zstd_level = zstd_level
        self._reader = SnapshotReader(
            expected_fingerprints=expected_fingerprints, expected_namespaces=expected_namespaces,
            validate_header=validate_header, shard=shard)
        self._on_evict = on_evict
        self._shard = shard
        self._lock = threading.Lock()  # the books; never held across file I/O
        self._write_lock = threading.Lock()  # serializes put()
        self._books = TierBooks()
        self._health = TierHealth(self.directory, clock, retry_seconds)

    def recover(self) -> RecoveryReport:
        """Rebuild the index from disk: delete temporaries; check headers, then index or
        quarantine (plane checksums wait for `get`).

        Then evict oldest-first down to `max_bytes` (the budget may have shrunk since).
        ValueError if the directory is not private (storage.cachedir); OSError if unusable.
        """
        prepare_directory(self.directory)
        with self._lock:
            found = scan(self.directory, self._reader, self._quarantine)
            self._books.install(found.index)
            num_evicted = self._evict_at_start(self.max_bytes)
            fsync_directory(self.directory)
            return RecoveryReport(
                num_loaded=self._books.num_entries, num_bytes=self._books.num_bytes,
                num_temporaries_removed=found.num_temporaries_removed, num_evicted=num_evicted,
                quarantined=found.quarantined)

    def put(
        self,
        key: str,
        header_fields: Mapping[str, Any],
        planes: Iterable[tuple[str, bytes, Sequence[int], str]],
    ) -> TierEntry:
        """Encode and durably write a snapshot under `key`, evicting the oldest to stay in budget.

        `header_fields` are `encode_snapshot`'s keyword arguments except planes and level.
        ValueError if the fields are invalid, the key is not `snapshot_key(namespace, token_ids)`,
        the identity is not one this tier expects, or the snapshot alone exceeds the budget.
        OSError from the write propagates: the snapshot is abandoned, no file is left under `key`
        (also while writes are paused after a failed one: storage.health).
        """
        validate_key(key)
        if not self._health.can_write():
            with self._lock:
                self._books.count("write_errors")
            raise OSError(f"writes to {self.directory} are paused after a failed one")
        with self._lock:
            sequence = self._books.take_sequence()
        data, header = self._encode(key, header_fields, planes, sequence)
        with self._write_lock:  # one write at a time; `_lock` only for the books
            with self._lock:
                replaced = self._books.get(key)
                replaced_bytes = 0 if replaced is None else replaced.num_bytes
                victims = self._books.evict(self.max_bytes - len(data) + replaced_bytes, keep=key)
            try:
                for victim in victims:  # files, outside the lock statistics() takes
                    if self._on_evict is not None:
                        self._on_evict(victim.key)
                    victim.path.unlink(missing_ok=True)
                path = self._write_file(key, data)
            except OSError as exc:
                # The write may have failed after the rename: leave no file of unknown content.
                with self._lock:
                    self._books.count("write_errors")
                    if replaced is not None:
                        self._books.drop(replaced)
                with contextlib.suppress(OSError):
                    snapshot_path(self.directory, key).unlink(missing_ok=True)
                self._health.failed("write", exc)
                raise
            self._health.wrote()
            entry = TierEntry(key=key, header=header, path=path, num_bytes=len(data),
                              sequence=sequence)
            with self._lock:
                self._books.add(entry)
                self._books.count("writes")
            return entry

    def _encode(
        self,
        key: str,
        header_fields: Mapping[str, Any],
        planes: Iterable[tuple[str, bytes, Sequence[int], str]],
        sequence: int,
    ) -> tuple[bytes, SnapshotHeader]:
        """`put`'s snapshot and its header: `sequence` (and the shard) in `extra`; ValueError
        if it alone exceeds the budget or is not of an identity this tier expects."""
        fields = dict(header_fields)
        fields["extra"] = {**(fields.get("extra") or {}), SEQUENCE_FIELD: sequence,
                           **(self._shard.fields() if self._shard is not None else {})}
        data = encode_snapshot(**fields, planes=planes, level=self.zstd_level)
        header = decode_header(data)
        if len(data) > self.max_bytes:
            raise ValueError(
                f"snapshot of {len(data)} bytes exceeds the tier budget {self.max_bytes}")
        try:
            self._reader.check_identity(key, header)
        except SnapshotError as exc:
            raise ValueError(f"cannot store under this tier: {exc.reason}") from None
        return data, header

    def _write_file(self, key: str, data: bytes) -> Path:
        """Durably write one snapshot file (temp, fsync, rename, directory fsync); if the
        directory was removed, the tier goes cold (its files went with it) and the
        directory is created again, private, for this write."""
        try:
            return write_snapshot_file(self.directory, key, data)
        except FileNotFoundError as exc:
            if os.path.lexists(self.directory):
                raise
            self._go_cold("write", exc)
        try:
            prepare_directory(self.directory)
        except ValueError as exc:  # e.g. the new parent is shared: not a directory to use
            raise OSError(str(exc)) from None
        logger.info("cache dir %s was removed: created it again", self.directory)
        return write_snapshot_file(self.directory, key, data)

    def get(self, key: str) -> tuple[SnapshotHeader, dict[str, Plane]] | None:
        """Read and fully verify the snapshot under `key`; None on a miss.

        A file that fails any check (checksums, sizes, identity, `validate_header`, a link or
        a non-regular file in its place) is quarantined and SnapshotError is raised; a
        vanished file leaves the index and is a miss.
        """
        validate_key(key)
        with self._lock:
            entry = self._books.get(key)
            if entry is None:
                self._books.count("misses")
                return None
        try:
            header, planes = self._reader.read_verified(key, entry.path, self.max_bytes)
        except SnapshotError as exc:
            with self._lock:
                self._books.count("misses")
                if self._books.drop(entry):
                    self._quarantine(entry.path, exc.reason)
            raise
        except OSError as exc:
            unusable = directory_problem(self.directory, entry.path)
            if unusable is not None:
                self._go_cold("read", unusable)
            elif not isinstance(exc, FileNotFoundError):
                raise  # this file's own error: the caller quarantines it
            with self._lock:
                self._books.drop(entry)
                self._books.count("misses")
            return None
        with self._lock:
            self._books.count("hits")
        return header, planes

    def quarantine(self, key: str, reason: str) -> bool:
        """Move the file under `key` to quarantine (it failed a check of the caller's, e.g.
        restoring it into the model); False if it was not indexed."""
        validate_key(key)
        with self._lock:
            entry = self._books.get(key)
            if entry is None or not self._books.drop(entry):
                return False
            self._quarantine(entry.path, reason)
            return True

    def reconcile(self) -> tuple[str, ...]:
        """Drop indexed entries whose files are gone (or are no longer regular files);
        returns their keys. One lstat per entry, outside the lock. A directory that cannot
        be searched, or is gone, makes the tier cold: every entry is dropped."""
        with self._lock:
            entries = self._books.entries()
        gone = []
        for entry in entries:
            try:
                if not stat.S_ISREG(os.lstat(entry.path).st_mode):
                    gone.append(entry)
            except FileNotFoundError:
                gone.append(entry)
            except OSError as exc:
                return self._go_cold("reconcile", exc)
        if gone:
            unusable = directory_problem(self.directory, gone[0].path)
            if unusable is not None:
                return self._go_cold("reconcile", unusable)
            logger.warning("%d indexed snapshot files vanished from %s; dropped from the index",
                           len(gone), self.directory)
        with self._lock:
            return tuple(entry.key for entry in gone if self._books.drop(entry))

    def _go_cold(self, operation: str, error: OSError) -> tuple[str, ...]:
        """The directory failed `operation`: drop every entry (in place), count and log it
        once (storage.health); returns the keys dropped."""
        with self._lock:
            keys = self._books.clear()
        self._health.failed(operation, error, cold=True)
        return keys

    def remove(self, key: str) -> bool:
        """Delete the snapshot under `key`; False if there was none."""
        validate_key(key)
        error = None
        with self._lock:
            entry = self._books.get(key)
            if entry is None or not self._books.drop(entry):
                return False
            try:
                entry.path.unlink(missing_ok=True)
            except OSError as exc:  # the file may stay: indexed again at the next start
                error = exc
        if error is not None:
            self._health.failed("remove", error)
        return True

    def entries(self) -> tuple[TierEntry, ...]:
        """Indexed snapshots, oldest first."""
        with self._lock:
            return tuple(self._books.oldest_first())

    def statistics(self) -> TierStatistics:
        """A frozen snapshot of the tier's counters."""
        with self._lock:
            return TierStatistics(
                num_entries=self._books.num_entries, num_bytes=self._books.num_bytes,
                num_bytes_read=self._reader.num_bytes_read,
                num_errors=self._health.num_errors, state=self._health.state.value,
                **{f"num_{name}": count for name, count in self._books.counters().items()})

    async def recover_async(self) -> RecoveryReport:
        """`recover` on a worker thread."""
        return await trio.to_thread.run_sync(self.recover)

    async def put_async(
        self,
        key: str,
        header_fields: Mapping[str, Any],
        planes: Iterable[tuple[str, bytes, Sequence[int], str]],
    ) -> TierEntry:
        """`put` on a worker thread; it finishes even if the caller is cancelled meanwhile."""
        put = functools.partial(self.put, key, header_fields, planes)
        return await trio.to_thread.run_sync(put)

    async def get_async(self, key: str) -> tuple[SnapshotHeader, dict[str, Plane]] | None:
        """`get` on a worker thread."""
        return await trio.to_thread.run_sync(self.get, key)

    def _quarantine(self, path: Path, reason: str) -> None:
        quarantine_entry(self.directory, path.name, reason)
        self._books.count("quarantined")

    def _evict_at_start(self, budget: int) -> int:
        """Under `_lock`, in `recover`: announce, delete and drop the oldest entries until
        `budget` holds; returns how many."""
        num_evicted = 0
        for entry in self._books.oldest_first():
            if self._books.num_bytes <= budget:
                break
            if self._on_evict is not None:
                self._on_evict(entry.key)
            entry.path.unlink(missing_ok=True)
            self._books.drop(entry)
            num_evicted += 1
        self._books.count("evicted", num_evicted)
        return num_evicted
