"""The SSD tier's health: errors of the cache dir's file system, counted and logged once.

A cache dir can fail under a running server: its permissions changed (EACCES), the
directory removed or replaced by a file (ENOENT, ENOTDIR), a full or read-only file system
(ENOSPC, EDQUOT, EROFS), a failing disk (EIO). None of these may stop the server: the tier
answers a miss instead of a hit and abandons the write, and this record says why.

States (`TierState`):
  * ok: reads and writes work;
  * read_only: a write (or a removal) failed: reads are still served; writes are skipped
    until `retry_seconds` have passed since the failure, then the next one is tried (it
    succeeds: ok again; it fails: another interval), so a full disk costs one failed write
    per interval, not one encode and one failed write per snapshot;
  * cold: the directory could not be read (or was gone): the tier dropped every indexed
    entry (files still there are indexed again at the next start); writes as above, and
    the first write after a successful one is ok again.
Every failed file-system operation counts one error; each change of state logs one line:
a warning when it worsens (the directory, the operation, the error), an info line when
the tier is ok again. Thread-safe: the tier's reads and writes run on worker threads.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger("tqserve.storage.tier")

RETRY_SECONDS = 10.0  # a failed disk rarely recovers faster; one write is tried per interval


class TierState(enum.Enum):
    OK = "ok"
    READ_ONLY = "read_only"
    COLD = "cold"


_WORSE = {TierState.OK: 0, TierState.READ_ONLY: 1, TierState.COLD: 2}


class TierHealth:
    """The state of one cache dir (see the module doc)."""

    def __init__(self, directory: Path, clock: Callable[[], float] = time.monotonic,
                 retry_seconds: float = RETRY_SECONDS) -> None:
        if retry_seconds < 0:
            raise ValueError(f"retry_seconds must be >= 0, got {retry_seconds}")
        self.directory = directory
        self._clock = clock
        self._retry_seconds = retry_seconds
        self._lock = threading.Lock()
        self._state = TierState.OK
        self._num_errors = 0
        self._retry_at: float | None = None  # writes wait until then (after a failed one)

    @property
    def state(self) -> TierState:
        return self._state

    @property
    def num_errors(self) -> int:
        """File-system errors seen since construction."""
        return self._num_errors

    def failed(self, operation: str, error: OSError, *, cold: bool = False) -> None:
        """Count one error of `operation` ("read", "write", "remove", ...); `cold`: the
        directory could not be read (the caller dropped its entries). A failed write or
        removal pauses writes for `retry_seconds`."""
        new = TierState.COLD if cold else TierState.READ_ONLY
        with self._lock:
            self._num_errors += 1
            if operation in ("write", "remove"):
                self._retry_at = self._clock() + self._retry_seconds
            if _WORSE[new] <= _WORSE[self._state]:
                return
            self._state = new
        what = ("cold: its entries dropped, misses until a write succeeds" if cold
                else f"read-only: writes paused, one tried every {self._retry_seconds:g} s")
        logger.warning("cache dir %s: %s failed (%s): the SSD tier is %s", self.directory,
                       operation, error.strerror or error, what)

    def can_write(self) -> bool:
        """Whether a write may be tried now (not inside a pause after a failed one)."""
        with self._lock:
            return self._retry_at is None or self._clock() >= self._retry_at

    def wrote(self) -> None:
        """A write succeeded: the tier is ok again (logged once)."""
        with self._lock:
            self._retry_at = None
            if self._state is TierState.OK:
                return
            self._state = TierState.OK
        logger.info("cache dir %s works again: the SSD tier is ok", self.directory)
