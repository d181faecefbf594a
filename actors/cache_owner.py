"""Cache-owner actor: the engine's books of KV use — how many rows are leased, how many
KV bytes are resident, how rows were released.

Owns: counts only. Which request holds which row is the scheduler core's record (it
assigns row ids); this actor keeps no copy of it.
Receives: Lease, Release, KvUsage from the scheduler (CACHE_OWNER_MAILBOX).
Sends: nothing. A release with no row leased is our bug and raises loudly.
"""

from __future__ import annotations

import attrs
import trio

from tqserve.actors.mailbox import Inbox
from tqserve.actors.messages import KvUsage, Lease, Release


@attrs.frozen(kw_only=True)
class CacheOwnerStatistics:
    rows_active: int
    kv_bytes: int
    num_leases: int
    num_releases: int
    releases_by_reason: dict[str, int]


@attrs.define
class RowBooks:
    rows_active: int = 0
    kv_bytes: int = 0
    num_leases: int = 0
    num_releases: int = 0
    releases_by_reason: dict[str, int] = attrs.Factory(dict)
    changed: trio.Event = attrs.Factory(trio.Event)  # replaced after every message

    @property
    def idle(self) -> bool:
        return self.rows_active == 0 and self.kv_bytes == 0

    def apply(self, msg: Lease | Release | KvUsage) -> None:
        match msg:
            case Lease():
                self.rows_active += 1
                self.num_leases += 1
            case Release(request_id=rid, row_id=row, reason=reason):
                if self.rows_active == 0:
                    raise RuntimeError(f"release of row {row} by {rid} with no row leased")
                self.rows_active -= 1
                self.num_releases += 1
                self.releases_by_reason[reason] = self.releases_by_reason.get(reason, 0) + 1
            case KvUsage(kv_bytes=nbytes):
                self.kv_bytes = nbytes

    def statistics(self) -> CacheOwnerStatistics:
        return CacheOwnerStatistics(
            rows_active=self.rows_active, kv_bytes=self.kv_bytes, num_leases=self.num_leases,
            num_releases=self.num_releases, releases_by_reason=dict(self.releases_by_reason))


async def run_cache_owner(books: RowBooks, inbox: Inbox,
                          task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    task_status.started()
    async for msg in inbox:
        books.apply(msg)
        books.changed.set()
        books.changed = trio.Event()
