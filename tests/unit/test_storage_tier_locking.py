"""SsdTier never holds the lock that statistics()/entries() take across file I/O: while one
put is stuck inside its write (fsync), the books answer and a get of another key reads."""

import threading

import tqserve.storage.tier  # noqa: F401  (loads storage.tier)
from tqserve import storage
from tqserve.storage.tier import SsdTier
from tests.unit.test_storage_tier import store


def test_statistics_and_reads_answer_while_a_write_is_stuck(tmp_path, monkeypatch):
    tier = SsdTier(tmp_path, max_bytes=1 << 20)
    tier.recover()
    first = store(tier, (1, 2, 3))
    inside, release = threading.Event(), threading.Event()
    real = storage.tier.write_snapshot_file

    def stuck(*args):
        inside.set()
        release.wait()
        return real(*args)

    monkeypatch.setattr(storage.tier, "write_snapshot_file", stuck)
    writer = threading.Thread(target=store, args=(tier, (4, 5, 6)))
    writer.start()
    try:
        assert inside.wait(timeout=60)  # a hang guard only
        answered = []
        reader = threading.Thread(target=lambda: answered.append(
            (tier.statistics(), tier.entries(), tier.get(first))))
        reader.start()
        reader.join(timeout=60)
        assert answered, "statistics()/entries()/get() waited for a write's fsync"
        stats, entries, found = answered[0]
        assert stats.num_entries == 1 and [e.key for e in entries] == [first]
        assert found is not None and found[0].token_ids == (1, 2, 3)
    finally:
        release.set()
        writer.join()
    assert tier.statistics().num_entries == 2 and tier.statistics().num_writes == 2


def test_put_evicts_oldest_outside_the_lock_and_keeps_the_budget(tmp_path):
    tier = SsdTier(tmp_path, max_bytes=3000)
    tier.recover()
    evicted = []
    tier._on_evict = evicted.append
    keys = [store(tier, (i, i + 1), size=900) for i in range(6)]
    stats = tier.statistics()
    assert stats.num_bytes <= 3000 and stats.num_evicted == len(evicted) > 0
    assert evicted == keys[:len(evicted)]
    assert {p.name[:-7] for p in tmp_path.glob("*.tqsnap")} == {e.key for e in tier.entries()}
