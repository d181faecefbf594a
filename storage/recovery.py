"""Recovery: what an SSD tier finds in its directory at start, and the report of it.

`scan` lists the directory once, in name order. A temporary leftover of an unfinished
write is removed whatever it is (a link itself, never its target), except a directory
(storage.cachedir). A snapshot file is read headers only, through the tier's reader
(storage.reader), and becomes an entry, or is quarantined with its reason: one bad file
never stops start-up. A file gone since the listing is skipped; anything else is left
alone. The tier then installs the entries in its books and evicts down to its budget
(storage.tier); plane checksums wait for the first load of each file.
"""

import os
from collections.abc import Callable
from pathlib import Path

import attrs

from tqserve.storage.books import TierEntry
from tqserve.storage.cachedir import remove_leftover
from tqserve.storage.reader import SnapshotReader
from tqserve.storage.snapshot import SnapshotError
from tqserve.storage.writer import SNAPSHOT_SUFFIX, is_temporary_name


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
class Scan:
    """What `scan` found: the index to start from, and what it removed or quarantined."""

    index: dict[str, TierEntry]
    num_temporaries_removed: int
    quarantined: tuple[tuple[str, str], ...]  # (file name, reason)


def scan(directory: Path, reader: SnapshotReader,
         quarantine: Callable[[Path, str], None]) -> Scan:
    """Remove leftovers, index the files whose headers check out, `quarantine(path, reason)`
    the others. OSError if the directory cannot be listed."""
    num_temporaries = 0
    quarantined: list[tuple[str, str]] = []
    index: dict[str, TierEntry] = {}
    for name in sorted(os.listdir(directory)):
        path = directory / name
        if is_temporary_name(name):
            num_temporaries += remove_leftover(path)
        elif name.endswith(SNAPSHOT_SUFFIX):
            key = name[: -len(SNAPSHOT_SUFFIX)]
            try:
                header, size = reader.read_verified_header(key, path)
            except FileNotFoundError:
                continue  # gone since the listing
            except (SnapshotError, OSError) as exc:  # one file never stops start-up
                reason = (exc.reason if isinstance(exc, SnapshotError)
                          else f"unreadable: {exc.strerror or exc}")
                quarantine(path, reason)
                quarantined.append((name, reason))
                continue
            index[key] = TierEntry.of_file(key, header, path, size)
    return Scan(index=index, num_temporaries_removed=num_temporaries,
                quarantined=tuple(quarantined))
