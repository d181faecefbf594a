"""The SSD tier: a directory of snapshot files and the in-memory index over them.

`SsdTier` is plain sync code; `put_async` / `get_async` / `recover_async` run it on a worker
thread through `trio.to_thread.run_sync`, so zstd, file I/O and fsync never block the event
loop. A lock guards the index and counters and is never held across file I/O (so
`statistics()` and `entries()` never wait for a write's fsync); a second lock makes writes
(with their evictions) run one at a time; encoding and reads run in parallel.

Lifecycle: construct, `recover()` once (it builds the index from disk), then `put` / `get` /
`remove`. Files that fail any check are moved to `quarantine/` with a logged reason, never
served. Every file is untrusted input (storage.cachedir): recovery reads headers only —
magic, version, fields, header checksum, identity, declared sizes against the real file
size, and the caller's `validate_header` (the engine checks planes against its model) — so
start-up costs the same whatever the planes hold; plane checksums are verified by `get`,
when a file is loaded for a hit, and a failure there quarantines the file too. Links and
non-regular entries are never opened through. `reconcile` drops entries whose files have
vanished. Eviction is oldest-written first, by a sequence number stored in each header's
`extra` so the order survives restarts; indexed files never total more than `max_bytes`.

After `recover`, no error of the directory's file system escapes `get`, `reconcile` or
`remove` (storage.health): a directory that cannot be searched any more (EACCES, ENOTDIR:
replaced by a file, gone, EIO) makes the tier cold (every entry dropped, the call a miss);
a failed write or removal makes it read-only for a while (`put` raises OSError, counted in
`num_write_errors`). A write finding the directory removed creates it again (private, as
at start) and goes on. A temporary leftover of an unfinished write is removed at start
whatever it is (a link itself, never its target), except a directory.
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

from tqserve.storage.cachedir import (QUARANTINE_DIR as QUARANTINE_DIR, directory_problem,
    open_regular, prepare_directory, quarantine_entry, remove_leftover)  # `as`: a re-export
from tqserve.storage.health import RETRY_SECONDS, TierHealth
from tqserve.storage.shard import ShardId, check_shard
from tqserve.storage.snapshot import (Plane, SnapshotError, SnapshotHeader, check_sizes, decode_header,
                              decode_snapshot, encode_snapshot, read_header)
from tqserve.storage.writer import (SNAPSHOT_SUFFIX, fsync_directory, is_temporary_name, snapshot_key,
                            snapshot_path, validate_key, write_snapshot_file)

logger = logging.getLogger(__name__)

SEQUENCE_FIELD = "tier_sequence"


@attrs.frozen(kw_only=True)
class TierEntry:
    """One indexed snapshot file."""

    key: str
    header: SnapshotHeader
    path: Path
    num_bytes: int
    sequence: int


@attrs.frozen(kw_only=True)
class RecoveryReport:
    """What `recover()` found: loaded entries, removed leftovers, quarantined files and why."""

    num_loaded: int
    num_bytes: int
    num_temporaries_removed: int
    num_evicted: int
    quarantined: tuple[tuple[str, str], ...]

    @property
    def num_quarantined(self) -> int:
        """How many files were moved to quarantine."""
        return len(self.quarantined)


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
        self._expected_fingerprints = _optional_set(expected_fingerprints)
        self._expected_namespaces = _optional_set(expected_namespaces)
        self._on_evict = on_evict
        self._validate_header = validate_header
        self._shard = shard
        self._lock = threading.Lock()  # the index and counters; never held across file I/O
        self._write_lock = threading.Lock()  # serializes put()
        self._index: dict[str, TierEntry] | None = None
        self._num_bytes = 0
        self._next_sequence = 0
        self._counts = dict.fromkeys(("hits", "misses", "writes", "quarantined", "evicted",
                                      "write_errors", "bytes_read"), 0)
        self._health = TierHealth(self.directory, clock, retry_seconds)

    def recover(self) -> RecoveryReport:
        """Rebuild the index from disk: delete temporaries; check headers, then index or
        quarantine (plane checksums wait for `get`).

        Then evict oldest-first down to `max_bytes` (the budget may have shrunk since).
        ValueError if the directory is not private (storage.cachedir); OSError if unusable.
        """
        prepare_directory(self.directory)
        num_temporaries = 0
        quarantined: list[tuple[str, str]] = []
        index: dict[str, TierEntry] = {}
        with self._lock:
            for name in sorted(os.listdir(self.directory)):
                path = self.directory / name
                if is_temporary_name(name):
                    num_temporaries += remove_leftover(path)
                elif name.endswith(SNAPSHOT_SUFFIX):
                    try:
                        entry = self._verified_entry(name[: -len(SNAPSHOT_SUFFIX)], path)
                    except FileNotFoundError:
                        continue  # gone since the listing
                    except (SnapshotError, OSError) as exc:  # one file never stops start-up
                        reason = (exc.reason if isinstance(exc, SnapshotError)
                                  else f"unreadable: {exc.strerror or exc}")
                        self._quarantine(path, reason)
                        quarantined.append((name, reason))
                        continue
                    index[entry.key] = entry
            self._index = index
            self._num_bytes = sum(entry.num_bytes for entry in index.values())
            self._next_sequence = 1 + max((entry.sequence for entry in index.values()), default=0)
            num_evicted = self._evict_until(self.max_bytes)
            fsync_directory(self.directory)
            return RecoveryReport(num_loaded=len(index), num_bytes=self._num_bytes,
                                  num_temporaries_removed=num_temporaries, num_evicted=num_evicted,
                                  quarantined=tuple(quarantined))

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
                self._counts["write_errors"] += 1
            raise OSError(f"writes to {self.directory} are paused after a failed one")
        with self._lock:
            self._require_recovered()
            sequence = self._next_sequence
            self._next_sequence += 1
        fields = dict(header_fields)
        fields["extra"] = {**(fields.get("extra") or {}), SEQUENCE_FIELD: sequence,
                           **(self._shard.fields() if self._shard is not None else {})}
        data = encode_snapshot(**fields, planes=planes, level=self.zstd_level)
        header = decode_header(data)
        if len(data) > self.max_bytes:
            raise ValueError(
                f"snapshot of {len(data)} bytes exceeds the tier budget {self.max_bytes}")
        try:
            self._check_identity(key, header)
        except SnapshotError as exc:
            raise ValueError(f"cannot store under this tier: {exc.reason}") from None
        with self._write_lock:  # one write at a time; `_lock` only for the books
            with self._lock:
                index = self._require_recovered()
                replaced = index.get(key)
                replaced_bytes = 0 if replaced is None else replaced.num_bytes
                victims = self._evict_books(self.max_bytes - len(data) + replaced_bytes,
                                            keep=key)
            try:
                for victim in victims:  # files, outside the lock statistics() takes
                    if self._on_evict is not None:
                        self._on_evict(victim.key)
                    victim.path.unlink(missing_ok=True)
                path = self._write_file(key, data)
            except OSError as exc:
                # The write may have failed after the rename: leave no file of unknown content.
                with self._lock:
                    self._counts["write_errors"] += 1
                    if replaced is not None:
                        self._drop_locked(replaced)
                with contextlib.suppress(OSError):
                    snapshot_path(self.directory, key).unlink(missing_ok=True)
                self._health.failed("write", exc)
                raise
            self._health.wrote()
            entry = TierEntry(key=key, header=header, path=path, num_bytes=len(data),
                              sequence=sequence)
            with self._lock:
                current = index.get(key)
                self._num_bytes += entry.num_bytes - (current.num_bytes if current else 0)
                index[key] = entry
                self._counts["writes"] += 1
            return entry

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

    def _evict_books(self, budget: int, keep: str) -> list[TierEntry]:
        """Under `_lock`: take the oldest entries out of the index until `budget` holds;
        the caller unlinks their files after releasing the lock."""
        victims = []
        for entry in sorted(self._require_recovered().values(), key=_by_sequence):
            if self._num_bytes <= budget:
                break
            if entry.key != keep and self._drop_locked(entry):
                victims.append(entry)
        self._counts["evicted"] += len(victims)
        return victims

    def get(self, key: str) -> tuple[SnapshotHeader, dict[str, Plane]] | None:
        """Read and fully verify the snapshot under `key`; None on a miss.

        A file that fails any check (checksums, sizes, identity, `validate_header`, a link or
        a non-regular file in its place) is quarantined and SnapshotError is raised; a
        vanished file leaves the index and is a miss.
        """
        validate_key(key)
        with self._lock:
            entry = self._require_recovered().get(key)
            if entry is None:
                self._counts["misses"] += 1
                return None
        try:
            header, planes = self._read_verified(key, entry)
        except SnapshotError as exc:
            with self._lock:
                self._counts["misses"] += 1
                if self._drop_locked(entry):
                    self._quarantine(entry.path, exc.reason)
            raise
        except OSError as exc:
            unusable = directory_problem(self.directory, entry.path)
            if unusable is not None:
                self._go_cold("read", unusable)
            elif not isinstance(exc, FileNotFoundError):
                raise  # this file's own error: the caller quarantines it
            with self._lock:
                self._drop_locked(entry)
                self._counts["misses"] += 1
            return None
        with self._lock:
            self._counts["hits"] += 1
        return header, planes

    def quarantine(self, key: str, reason: str) -> bool:
        """Move the file under `key` to quarantine (it failed a check of the caller's, e.g.
        restoring it into the model); False if it was not indexed."""
        validate_key(key)
        with self._lock:
            entry = self._require_recovered().get(key)
            if entry is None or not self._drop_locked(entry):
                return False
            self._quarantine(entry.path, reason)
            return True

    def reconcile(self) -> tuple[str, ...]:
        """Drop indexed entries whose files are gone (or are no longer regular files);
        returns their keys. One lstat per entry, outside the lock. A directory that cannot
        be searched, or is gone, makes the tier cold: every entry is dropped."""
        with self._lock:
            entries = list(self._require_recovered().values())
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
            return tuple(entry.key for entry in gone if self._drop_locked(entry))

    def _go_cold(self, operation: str, error: OSError) -> tuple[str, ...]:
        """The directory failed `operation`: drop every entry (in place), count and log it
        once (storage.health); returns the keys dropped."""
        with self._lock:
            index = self._require_recovered()
            keys = tuple(index)
            index.clear()
            self._num_bytes = 0
        self._health.failed(operation, error, cold=True)
        return keys

    def remove(self, key: str) -> bool:
        """Delete the snapshot under `key`; False if there was none."""
        validate_key(key)
        error = None
        with self._lock:
            entry = self._require_recovered().get(key)
            if entry is None or not self._drop_locked(entry):
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
            return tuple(sorted(self._require_recovered().values(), key=_by_sequence))

    def statistics(self) -> TierStatistics:
        """A frozen snapshot of the tier's counters."""
        with self._lock:
            return TierStatistics(
                num_entries=len(self._index or {}), num_bytes=self._num_bytes,
                num_errors=self._health.num_errors, state=self._health.state.value,
                **{f"num_{name}": count for name, count in self._counts.items()})

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

    def _require_recovered(self) -> dict[str, TierEntry]:
        if self._index is None:
            raise RuntimeError("SsdTier.recover() must run before the tier is used")
        return self._index

    def _identity_problem(self, fingerprint: str, namespace: str) -> str | None:
        fingerprints, namespaces = self._expected_fingerprints, self._expected_namespaces
        if fingerprints is not None and fingerprint not in fingerprints:
            return "fingerprint mismatch"
        if namespaces is not None and namespace not in namespaces:
            return "namespace mismatch"
        return None

    def _check_identity(self, key: str, header: SnapshotHeader) -> None:
        problem = self._identity_problem(header.model_fingerprint, header.namespace)
        if problem is not None:
            raise SnapshotError(problem)
        check_shard(header, self._shard)
        if key != snapshot_key(header.namespace, header.token_ids):
            raise SnapshotError("file name does not match the key of its header")

    def _verified_entry(self, key: str, path: Path) -> TierEntry:
        """Headers only: the entry of a file whose header, sizes and identity check out."""
        try:
            validate_key(key)
        except ValueError:
            raise SnapshotError("file name is not a snapshot key") from None
        file, size = open_regular(path)
        with file:
            header, header_end = read_header(file, size)
        self._counts["bytes_read"] += header_end
        check_sizes(header, header_end, size)
        self._check_header(key, header)
        sequence = header.extra.get(SEQUENCE_FIELD, 0)
        return TierEntry(key=key, header=header, path=path, num_bytes=size,
                         sequence=sequence if type(sequence) is int else 0)

    def _read_verified(self, key: str, entry: TierEntry) -> tuple[SnapshotHeader,
                                                                  dict[str, Plane]]:
        file, size = open_regular(entry.path)
        with file:
            if size > self.max_bytes:
                raise SnapshotError(f"file of {size} bytes exceeds the tier budget")
            header, header_end = read_header(file, size)
            check_sizes(header, header_end, size)
            self._check_header(key, header)
            file.seek(0)
            data = file.read(size + 1)
        with self._lock:
            self._counts["bytes_read"] += header_end + len(data)
        header, planes = decode_snapshot(data)
        return header, planes

    def _check_header(self, key: str, header: SnapshotHeader) -> None:
        self._check_identity(key, header)
        if self._validate_header is not None:
            self._validate_header(header)

    def _quarantine(self, path: Path, reason: str) -> None:
        quarantine_entry(self.directory, path.name, reason)
        self._counts["quarantined"] += 1

    def _evict_until(self, budget: int, keep: str | None = None) -> int:
        num_evicted = 0
        for entry in sorted(self._require_recovered().values(), key=_by_sequence):
            if self._num_bytes <= budget:
                break
            if entry.key == keep:
                continue
            if self._on_evict is not None:
                self._on_evict(entry.key)
            self._delete_locked(entry)
            num_evicted += 1
        self._counts["evicted"] += num_evicted
        return num_evicted

    def _delete_locked(self, entry: TierEntry) -> None:
        entry.path.unlink(missing_ok=True)
        self._drop_locked(entry)

    def _drop_locked(self, entry: TierEntry) -> bool:
        if self._index is None or self._index.get(entry.key) is not entry:
            return False
        del self._index[entry.key]
        self._num_bytes -= entry.num_bytes
        return True


def _optional_set(values: Collection[str] | None) -> frozenset[str] | None:
    return None if values is None else frozenset(values)


def _by_sequence(entry: TierEntry) -> int:
    return entry.sequence
