"""A rank's shard of the SSD tier (`serve --distributed --cache-dir`): its identity and directory.

Under tensor parallelism every rank holds only its own KV heads, so each persisted snapshot
is one file per rank. A shard is named by the group size and the rank (`ShardId`):

* its files live in their own subdirectory of the cache dir, `tp<size>-rank<rank>/`
  (ranks on one host share the cache dir; ranks on several hosts each have their own at
  the same path), with their own `quarantine/`. A single process scans only the cache
  dir's top level, so it never even lists a shard's files;
* every shard file says whose it is: `tp_size` and `tp_rank` in the header's `extra`
  (written by `SsdTier.put`), checked with the model fingerprint and the key wherever a
  header is checked (`check_shard`): a file of rank 1 of 2 is refused by rank 0, by a
  group of another size and by a single process (no shard), even when copied under the
  right name into their directory.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs

from tqserve.storage.snapshot import SnapshotError, SnapshotHeader

SIZE_FIELD = "tp_size"
RANK_FIELD = "tp_rank"


def _valid(inst: ShardId, attr: attrs.Attribute, value: int) -> None:
    if type(value) is not int or value < 0:
        raise ValueError(f"{attr.name} must be an integer >= 0, got {value!r}")


@attrs.frozen
class ShardId:
    """Rank `rank` of a tensor-parallel group of `size` ranks."""

    size: int = attrs.field(validator=_valid)
    rank: int = attrs.field(validator=_valid)

    def __attrs_post_init__(self) -> None:
        if self.size < 2 or self.rank >= self.size:
            raise ValueError(f"no rank {self.rank} in a group of {self.size}")

    @property
    def name(self) -> str:
        """The shard's subdirectory name, e.g. `tp2-rank1`."""
        return f"tp{self.size}-rank{self.rank}"

    def directory(self, cache_dir: str | Path) -> Path:
        """Where this shard's files live under `cache_dir`."""
        return Path(cache_dir) / self.name

    def fields(self) -> dict[str, int]:
        """The header `extra` fields that name this shard."""
        return {SIZE_FIELD: self.size, RANK_FIELD: self.rank}

    def describe(self) -> str:
        return f"rank {self.rank} of a {self.size}-rank group"


def _written_by(extra: dict[str, Any]) -> str:
    size, rank = extra.get(SIZE_FIELD), extra.get(RANK_FIELD)
    if size is None and rank is None:
        return "a single process"
    return f"rank {rank!r:.12} of a {size!r:.12}-rank group"


def check_shard(header: SnapshotHeader, shard: ShardId | None) -> None:
    """SnapshotError unless `header` was written by `shard` (None: by a single process)."""
    extra = header.extra
    want = shard.fields() if shard is not None else {}
    got = {name: extra[name] for name in (SIZE_FIELD, RANK_FIELD) if name in extra}
    if got != want or any(type(value) is not int for value in got.values()):
        mine = shard.describe() if shard is not None else "a single process"
        raise SnapshotError(f"shard mismatch: written by {_written_by(extra)}, read by {mine}")
