"""Cache-owner actor: the KV ledger. Every row's lease, the KV byte budget and what the
core charged against it, the KV bytes resident.

Owns: the leases (request id -> its row id and the positions the core charged it for),
the budget (bytes, from engine.kv_budget), the core's latest charge of the running rows,
the resident bytes the runner reported, and the counts of leases and releases by reason.
Decides nothing: the sans-io core decides which rows start under the budget (a row is
charged its whole life when it starts, or with --kv-admission preempt what it holds, the
longest row preempted under pressure: engine.kv_budget) and the scheduler reports each
decision here (a preemption is a release with reason "preempted", its resumption a
lease). This
ledger is what statistics, /metrics and `wait_idle` read: it posts its record to the
board (actors.board) after every message.
Receives: Lease, Release, KvUsage from the scheduler (CACHE_OWNER_MAILBOX).
Sends: nothing. A release of a row that is not leased to that request is our bug: it raises.
"""

from __future__ import annotations

import attrs
import trio

from tqserve.actors.board import Board
from tqserve.actors.mailbox import Inbox
from tqserve.actors.messages import KvUsage, Lease, Release


@attrs.frozen(kw_only=True)
class CacheOwnerStatistics:
    rows_active: int
    kv_bytes: int          # resident: what the runner's caches allocate now
    kv_budget_bytes: int   # what admitted rows may come to hold together (0: no budget)
    kv_charged_bytes: int  # what the core charged the running rows (engine.kv_budget)
    leased_positions: int  # positions the leased rows were charged for, summed
    num_leases: int
    num_releases: int
    releases_by_reason: dict[str, int]

    @property
    def idle(self) -> bool:
        """No row leased, no KV resident, nothing charged."""
        return self.rows_active == 0 and self.kv_bytes == 0 and self.kv_charged_bytes == 0


@attrs.define
class KvLedger:
    """The ledger's books (sans-io; `apply` one message at a time)."""

    budget_bytes: int = 0
    leases: dict[str, tuple[int, int]] = attrs.Factory(dict)  # request id -> (row, positions)
    kv_bytes: int = 0
    charged_bytes: int = 0
    num_leases: int = 0
    num_releases: int = 0
    releases_by_reason: dict[str, int] = attrs.Factory(dict)

    def apply(self, msg: Lease | Release | KvUsage) -> None:
        match msg:
            case Lease(request_id=rid, row_id=row, kv_positions=positions):
                if rid in self.leases:
                    raise RuntimeError(f"{rid} leased row {row} while holding row "
                                       f"{self.leases[rid][0]}")
                self.leases[rid] = (row, positions)
                self.num_leases += 1
            case Release(request_id=rid, row_id=row, reason=reason):
                held = self.leases.get(rid)
                if held is None or held[0] != row:
                    raise RuntimeError(f"release of row {row} by {rid}, which holds "
                                       f"{'no row' if held is None else f'row {held[0]}'}")
                del self.leases[rid]
                self.num_releases += 1
                self.releases_by_reason[reason] = self.releases_by_reason.get(reason, 0) + 1
            case KvUsage(kv_bytes=nbytes, charged_bytes=charged):
                self.kv_bytes, self.charged_bytes = nbytes, charged
            case _:
                raise TypeError(f"cache owner got unexpected {type(msg).__name__}")

    def statistics(self) -> CacheOwnerStatistics:
        return CacheOwnerStatistics(
            rows_active=len(self.leases), kv_bytes=self.kv_bytes,
            kv_budget_bytes=self.budget_bytes, kv_charged_bytes=self.charged_bytes,
            leased_positions=sum(p for _, p in self.leases.values()),
            num_leases=self.num_leases, num_releases=self.num_releases,
            releases_by_reason=dict(self.releases_by_reason))


async def run_cache_owner(ledger: KvLedger, inbox: Inbox, board: Board,
                          task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    board.post(cache_owner=ledger.statistics())
    task_status.started()
    async for msg in inbox:
        ledger.apply(msg)
        board.post(cache_owner=ledger.statistics())
