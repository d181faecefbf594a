"""The cache owner's KV ledger (actors/cache_owner.py): leases, releases, the core's charge."""

import pytest

from tqserve.actors.cache_owner import KvLedger
from tqserve.actors.messages import KvUsage, Lease, Release


def test_the_ledger_books_every_lease_and_the_cores_charge():
    ledger = KvLedger(budget_bytes=1 << 20)
    ledger.apply(Lease(request_id="a", row_id=0, kv_positions=300))
    ledger.apply(Lease(request_id="b", row_id=1, kv_positions=40))
    ledger.apply(KvUsage(kv_bytes=4096, num_rows=2, charged_bytes=65536))
    stats = ledger.statistics()
    assert (stats.rows_active, stats.leased_positions, stats.kv_bytes) == (2, 340, 4096)
    assert (stats.kv_budget_bytes, stats.kv_charged_bytes) == (1 << 20, 65536)
    assert not stats.idle
    ledger.apply(Release(request_id="a", row_id=0, reason="stop"))
    ledger.apply(Release(request_id="b", row_id=1, reason="cancelled"))
    ledger.apply(KvUsage(kv_bytes=0, num_rows=0, charged_bytes=0))
    stats = ledger.statistics()
    assert stats.idle and stats.leased_positions == 0
    assert (stats.num_leases, stats.num_releases) == (2, 2)
    assert stats.releases_by_reason == {"stop": 1, "cancelled": 1}


def test_a_release_that_does_not_match_a_lease_is_our_bug_and_changes_nothing():
    ledger = KvLedger()
    ledger.apply(Lease(request_id="a", row_id=3))
    with pytest.raises(RuntimeError, match="release of row 4 by a, which holds row 3"):
        ledger.apply(Release(request_id="a", row_id=4, reason="stop"))
    with pytest.raises(RuntimeError, match="which holds no row"):
        ledger.apply(Release(request_id="z", row_id=3, reason="stop"))
    with pytest.raises(RuntimeError, match="leased row 5 while holding row 3"):
        ledger.apply(Lease(request_id="a", row_id=5))
    assert ledger.statistics().rows_active == 1 and ledger.num_releases == 0
