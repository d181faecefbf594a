"""The SSD tier's reader: every snapshot file is untrusted input, read only through checks.

Anyone who can write into the cache dir can plant a file there (storage.cachedir), so a file
is served only if it is one this tier accepts: its name is a snapshot key and the key of its
header, its model fingerprint and namespace are ones the tier expects, it was written by
the tier's shard (storage.shard), and the caller's `validate_header` passes (the engine
checks planes against its model). `read_verified_header` (recovery) reads headers only —
magic, version, fields, header checksum, identity, declared sizes against the real file
size — so start-up costs the same whatever the planes hold; `read_verified` (a hit) checks
the header again, then reads the whole file and verifies every plane checksum. Both open
with `open_regular`: links and non-regular entries are never opened through. A failed
check raises SnapshotError (the tier quarantines the file); OSError is the file's or its
directory's own error. `num_bytes_read` counts every byte read, failed reads' too.
"""

import threading
from collections.abc import Callable, Collection
from pathlib import Path

from tqserve.storage.cachedir import open_regular
from tqserve.storage.shard import ShardId, check_shard
from tqserve.storage.snapshot import (Plane, SnapshotError, SnapshotHeader, check_sizes,
                                      decode_snapshot, read_header)
from tqserve.storage.writer import snapshot_key, validate_key


class SnapshotReader:
    """Reads one tier's snapshot files, each checked against what the tier accepts."""

    def __init__(
        self,
        *,
        expected_fingerprints: Collection[str] | None = None,
        expected_namespaces: Collection[str] | None = None,
        validate_header: Callable[[SnapshotHeader], None] | None = None,
        shard: ShardId | None = None,
    ) -> None:
        """As SsdTier's arguments of the same names (None: any fingerprint, any namespace,
        no check of the caller's, a single process's files). Thread-safe."""
        self._expected_fingerprints = _optional_set(expected_fingerprints)
        self._expected_namespaces = _optional_set(expected_namespaces)
        self._validate_header = validate_header
        self._shard = shard
        self._lock = threading.Lock()  # guards the counter: reads run on several threads
        self._num_bytes_read = 0

    @property
    def num_bytes_read(self) -> int:
        """Bytes read from files since construction."""
        with self._lock:
            return self._num_bytes_read

    def check_identity(self, key: str, header: SnapshotHeader) -> None:
        """SnapshotError unless `header` has an expected fingerprint and namespace, was
        written by this tier's shard, and `key` is its key (`put` checks new files too)."""
        problem = self._identity_problem(header.model_fingerprint, header.namespace)
        if problem is not None:
            raise SnapshotError(problem)
        check_shard(header, self._shard)
        if key != snapshot_key(header.namespace, header.token_ids):
            raise SnapshotError("file name does not match the key of its header")

    def read_verified_header(self, key: str, path: Path) -> tuple[SnapshotHeader, int]:
        """Headers only: the header of the file `key` names at `path` and the file's size,
        if its header, declared sizes and identity check out."""
        try:
            validate_key(key)
        except ValueError:
            raise SnapshotError("file name is not a snapshot key") from None
        file, size = open_regular(path)
        with file:
            header, header_end = read_header(file, size)
        self._count(header_end)
        check_sizes(header, header_end, size)
        self._check_header(key, header)
        return header, size

    def read_verified(self, key: str, path: Path,
                      max_bytes: int) -> tuple[SnapshotHeader, dict[str, Plane]]:
        """The whole file, every checksum verified; one over `max_bytes` is refused unread."""
        file, size = open_regular(path)
        with file:
            if size > max_bytes:
                raise SnapshotError(f"file of {size} bytes exceeds the tier budget")
            header, header_end = read_header(file, size)
            check_sizes(header, header_end, size)
            self._check_header(key, header)
            file.seek(0)
            data = file.read(size + 1)
        self._count(header_end + len(data))
        header, planes = decode_snapshot(data)
        return header, planes

    def _check_header(self, key: str, header: SnapshotHeader) -> None:
        self.check_identity(key, header)
        if self._validate_header is not None:
            self._validate_header(header)

    def _identity_problem(self, fingerprint: str, namespace: str) -> str | None:
        fingerprints, namespaces = self._expected_fingerprints, self._expected_namespaces
        if fingerprints is not None and fingerprint not in fingerprints:
            return "fingerprint mismatch"
        if namespaces is not None and namespace not in namespaces:
            return "namespace mismatch"
        return None

    def _count(self, num_bytes: int) -> None:
        with self._lock:
            self._num_bytes_read += num_bytes


def _optional_set(values: Collection[str] | None) -> frozenset[str] | None:
    return None if values is None else frozenset(values)
