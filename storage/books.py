"""The SSD tier's books: which snapshot files it indexes, their byte total, the write order
and the counters.

Sans-io, as the tier's core: `TierBooks` never touches a file, a lock or the clock. `SsdTier`
(storage.tier) holds its lock around every call and does the file I/O the answers call for:
it unlinks the entries `evict` takes out, moves to quarantine the ones `drop` let go. `drop`
compares the entry itself, not only its key, so a caller holding an entry a rewrite has
replaced drops nothing. Eviction is oldest-written first, by a sequence number each file
carries in its header's `extra` (SEQUENCE_FIELD), so the order survives restarts. Until
`install` (recovery) every use but `drop` and `num_entries` raises RuntimeError.
"""

from pathlib import Path

import attrs

from tqserve.storage.snapshot import SnapshotHeader

SEQUENCE_FIELD = "tier_sequence"
COUNTERS = ("hits", "misses", "writes", "quarantined", "evicted", "write_errors")


@attrs.frozen(kw_only=True)
class TierEntry:
    """One indexed snapshot file."""

    key: str
    header: SnapshotHeader
    path: Path
    num_bytes: int
    sequence: int

    @classmethod
    def of_file(cls, key: str, header: SnapshotHeader, path: Path, num_bytes: int) -> "TierEntry":
        """The entry of a file found on disk: its sequence from the header (0 if none)."""
        sequence = header.extra.get(SEQUENCE_FIELD, 0)
        return cls(key=key, header=header, path=path, num_bytes=num_bytes,
                   sequence=sequence if type(sequence) is int else 0)


class TierBooks:
    """Indexed entries by key, their byte total, the next write sequence and the counters."""

    def __init__(self) -> None:
        self._index: dict[str, TierEntry] | None = None
        self.num_bytes = 0
        self._next_sequence = 0
        self._counts = dict.fromkeys(COUNTERS, 0)

    def install(self, index: dict[str, TierEntry]) -> None:
        """Start from recovery's index (kept, not copied); new sequences follow its newest."""
        self._index = index
        self.num_bytes = sum(entry.num_bytes for entry in index.values())
        self._next_sequence = 1 + max((entry.sequence for entry in index.values()), default=0)

    @property
    def num_entries(self) -> int:
        """How many entries are indexed (0 before `install`)."""
        return len(self._index or {})

    def get(self, key: str) -> TierEntry | None:
        """The entry under `key`, if indexed."""
        return self._recovered().get(key)

    def entries(self) -> list[TierEntry]:
        """Every entry, in the index's order."""
        return list(self._recovered().values())

    def oldest_first(self) -> list[TierEntry]:
        """Every entry, oldest-written first."""
        return sorted(self._recovered().values(), key=_by_sequence)

    def take_sequence(self) -> int:
        """The sequence number of the next write."""
        self._recovered()
        sequence = self._next_sequence
        self._next_sequence += 1
        return sequence

    def add(self, entry: TierEntry) -> None:
        """Index a written file, in place of the entry under its key if there is one."""
        index = self._recovered()
        current = index.get(entry.key)
        self.num_bytes += entry.num_bytes - (current.num_bytes if current else 0)
        index[entry.key] = entry

    def drop(self, entry: TierEntry) -> bool:
        """Take `entry` out of the index; False if it is not the entry indexed under its key."""
        if self._index is None or self._index.get(entry.key) is not entry:
            return False
        del self._index[entry.key]
        self.num_bytes -= entry.num_bytes
        return True

    def evict(self, budget: int, keep: str) -> list[TierEntry]:
        """Take the oldest entries but `keep` out until at most `budget` bytes stay indexed;
        counted as evicted. The caller deletes their files."""
        victims = []
        for entry in self.oldest_first():
            if self.num_bytes <= budget:
                break
            if entry.key != keep and self.drop(entry):
                victims.append(entry)
        self._counts["evicted"] += len(victims)
        return victims

    def clear(self) -> tuple[str, ...]:
        """Drop every entry (the index stays the same dict); returns their keys."""
        index = self._recovered()
        keys = tuple(index)
        index.clear()
        self.num_bytes = 0
        return keys

    def count(self, name: str, amount: int = 1) -> None:
        """Add `amount` to the counter `name` (one of COUNTERS)."""
        self._counts[name] += amount

    def counters(self) -> dict[str, int]:
        """The counters by name, a copy."""
        return dict(self._counts)

    def _recovered(self) -> dict[str, TierEntry]:
        if self._index is None:
            raise RuntimeError("SsdTier.recover() must run before the tier is used")
        return self._index


def _by_sequence(entry: TierEntry) -> int:
    return entry.sequence
