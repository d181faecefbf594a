"""The SSD tier: index, recovery, quarantine, eviction, statistics and the trio wrappers."""

import os
import random
import secrets

import pytest
import trio

from tqserve.storage.snapshot import SnapshotError, read_snapshot
from tqserve.storage.cachedir import QUARANTINE_MAX_FILES
from tqserve.storage.tier import QUARANTINE_DIR, SsdTier
from tqserve.storage.writer import snapshot_key
from tests.unit.test_storage_snapshot import header_fields, header_region_length, sample_planes


def store(tier: SsdTier, tokens: tuple[int, ...], size: int = 256, **overrides) -> str:
    """Put a snapshot of `size` incompressible bytes for `tokens`; return its key."""
    fields = {**header_fields(token_ids=tokens), **overrides}
    key = snapshot_key(fields["namespace"], tokens)
    tier.put(key, fields, [("layers.0.keys", os.urandom(size), (size,), "uint8")])
    return key


def snapshot_files(tier: SsdTier) -> set[str]:
    return {path.name for path in tier.directory.iterdir() if path.is_file()}


def index_matches_directory(tier: SsdTier) -> bool:
    return snapshot_files(tier) == {f"{entry.key}.tqsnap" for entry in tier.entries()}


@pytest.fixture
def tier(tmp_path) -> SsdTier:
    tier = SsdTier(tmp_path / "ssd", max_bytes=1 << 20)
    tier.recover()
    return tier


def test_put_get_round_trip_and_statistics(tier):
    planes = sample_planes(random.Random(4))
    fields = header_fields()
    key = snapshot_key(fields["namespace"], fields["token_ids"])
    entry = tier.put(key, fields, planes)

    header, decoded = tier.get(key)

    assert header == entry.header
    assert header.token_ids == fields["token_ids"]
    assert {name: plane.data for name, plane in decoded.items()} == {n: d for n, d, *_ in planes}
    assert tier.get("ab" * 16) is None
    stats = tier.statistics()
    assert (stats.num_entries, stats.num_bytes) == (1, entry.num_bytes)
    assert (stats.num_hits, stats.num_misses, stats.num_writes) == (1, 1, 1)
    assert entry.num_bytes == entry.path.stat().st_size


def test_tier_must_recover_before_use(tmp_path):
    tier = SsdTier(tmp_path, max_bytes=1 << 20)
    with pytest.raises(RuntimeError, match="recover"):
        tier.get("ab" * 16)


def test_put_rejects_a_key_that_is_not_derived_from_the_header(tier):
    with pytest.raises(ValueError, match="file name does not match"):
        tier.put("ab" * 16, header_fields(), [])
    with pytest.raises(ValueError, match="hex"):
        tier.put("../../etc/passwd", header_fields(), [])
    assert snapshot_files(tier) == set()


def test_restart_restores_the_index_and_serves_from_disk(tier):
    keys = [store(tier, (7, n)) for n in range(4)]
    tier.remove(keys[0])

    restarted = SsdTier(tier.directory, max_bytes=1 << 20)
    report = restarted.recover()

    assert (report.num_loaded, report.num_quarantined) == (3, 0)
    assert [entry.key for entry in restarted.entries()] == keys[1:]
    assert restarted.get(keys[0]) is None
    assert restarted.get(keys[3])[0].token_ids == (7, 3)


def test_eviction_removes_oldest_first_and_survives_restart(tier):
    one = len(read_snapshot_bytes(tier, store(tier, (1,), size=1000)))
    tier.max_bytes = 3 * one + one // 2
    keys = [store(tier, (2, n), size=1000) for n in range(5)]

    assert [entry.key for entry in tier.entries()] == keys[2:]
    assert tier.statistics().num_evicted == 3
    assert tier.statistics().num_bytes <= tier.max_bytes
    assert index_matches_directory(tier)

    restarted = SsdTier(tier.directory, max_bytes=tier.max_bytes)
    restarted.recover()
    newest = store(restarted, (3,), size=1000)
    assert [entry.key for entry in restarted.entries()] == keys[3:] + [newest]
    assert index_matches_directory(restarted)

    smaller = SsdTier(tier.directory, max_bytes=one + one // 2)
    assert smaller.recover().num_evicted == 2
    assert [entry.key for entry in smaller.entries()] == [newest]


def test_overwriting_a_key_keeps_one_file_and_counts_bytes_once(tier):
    key = store(tier, (9,), size=100)
    store(tier, (9,), size=3000)
    assert [entry.key for entry in tier.entries()] == [key]
    assert tier.statistics().num_bytes == tier.entries()[0].path.stat().st_size
    assert index_matches_directory(tier)


def test_snapshot_larger_than_the_budget_is_refused(tmp_path):
    tier = SsdTier(tmp_path, max_bytes=500)
    tier.recover()
    with pytest.raises(ValueError, match="exceeds the tier budget"):
        store(tier, (1,), size=2000)
    assert snapshot_files(tier) == set()


def read_snapshot_bytes(tier: SsdTier, key: str) -> bytes:
    return (tier.directory / f"{key}.tqsnap").read_bytes()


def corrupted_variants(good: bytes) -> list[bytes]:
    """Every header byte flipped once, 50 flipped plane bytes, and truncations on a grid."""
    rng = random.Random(5)
    variants = []
    header_end = header_region_length(good)
    positions = list(range(header_end)) + rng.sample(range(header_end, len(good)), 50)
    for index in positions:
        corrupt = bytearray(good)
        corrupt[index] ^= 1 << (index % 8)
        variants.append(bytes(corrupt))
    for length in sorted(set(range(0, len(good), 37)) | {header_end - 1, header_end, len(good) - 1}):
        variants.append(good[:length])
    return variants


def test_recover_quarantines_every_corrupted_file_and_keeps_serving_good_ones(tier, caplog):
    """Under names that are not their keys, every variant fails recovery's header checks
    (payload flips under their own names wait for the load: tests/unit/test_cache_dir.py)."""
    good_keys = [store(tier, (4, n)) for n in range(3)]
    variants = corrupted_variants(read_snapshot_bytes(tier, good_keys[0]))
    names = []
    for data in variants:
        name = f"{secrets.token_hex(16)}.tqsnap"
        (tier.directory / name).write_bytes(data)
        with pytest.raises(SnapshotError):
            read_snapshot(tier.directory / name)
        names.append(name)

    restarted = SsdTier(tier.directory, max_bytes=1 << 30)
    report = restarted.recover()

    assert sorted(name for name, _ in report.quarantined) == sorted(names)
    assert report.num_loaded == 3
    assert sorted(entry.key for entry in restarted.entries()) == sorted(good_keys)
    assert all(restarted.get(key) is not None for key in good_keys)
    kept = os.listdir(tier.directory / QUARANTINE_DIR)  # bounded: the newest (cachedir)
    assert len(kept) == QUARANTINE_MAX_FILES < len(names) and set(kept) <= set(names)
    assert max(names) in kept  # recovery goes in name order: the last one moved stays
    assert index_matches_directory(restarted)
    assert restarted.statistics().num_quarantined == len(variants)
    assert "header checksum mismatch" in caplog.text


def test_swapped_files_are_quarantined(tier):
    first, second, third = (store(tier, (6, n)) for n in range(3))
    a, b = (tier.directory / f"{key}.tqsnap" for key in (first, second))
    a.rename(tier.directory / "swap")
    b.rename(a)
    (tier.directory / "swap").rename(b)

    restarted = SsdTier(tier.directory, max_bytes=1 << 20)
    report = restarted.recover()

    assert {reason for _, reason in report.quarantined} == {"file name does not match the key of its header"}
    assert sorted(name for name, _ in report.quarantined) == sorted([a.name, b.name])
    assert [entry.key for entry in restarted.entries()] == [third]


def test_files_of_another_model_or_namespace_are_quarantined(tier):
    other_model = store(tier, (8,), model_fingerprint="fp-b", namespace="ns-a")
    other_scheme = store(tier, (8,), model_fingerprint="fp-a", namespace="ns-b")

    restarted = SsdTier(tier.directory, max_bytes=1 << 20, expected_fingerprints={"fp-a"},
                        expected_namespaces={"ns-a"})
    report = restarted.recover()

    assert dict(report.quarantined) == {f"{other_model}.tqsnap": "fingerprint mismatch",
                                        f"{other_scheme}.tqsnap": "namespace mismatch"}
    assert restarted.entries() == ()
    with pytest.raises(ValueError, match="fingerprint mismatch"):
        store(restarted, (8,), model_fingerprint="fp-b", namespace="ns-a")
    assert restarted.get(store(restarted, (8,), model_fingerprint="fp-a", namespace="ns-a"))


def test_get_reverifies_and_quarantines_a_file_damaged_after_recovery(tier):
    key = store(tier, (10,))
    path = tier.directory / f"{key}.tqsnap"
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x10
    path.write_bytes(bytes(data))

    with pytest.raises(SnapshotError, match="checksum mismatch in plane layers.0.keys"):
        tier.get(key)

    assert tier.get(key) is None
    assert (tier.directory / QUARANTINE_DIR / path.name).exists()
    stats = tier.statistics()
    assert (stats.num_entries, stats.num_bytes, stats.num_quarantined) == (0, 0, 1)


def test_file_deleted_behind_the_tier_is_a_miss(tier):
    key = store(tier, (11,))
    (tier.directory / f"{key}.tqsnap").unlink()
    assert tier.get(key) is None
    assert tier.entries() == ()
    assert tier.statistics().num_misses == 1


def test_recover_removes_temporaries_and_quarantines_bad_names(tier):
    key = store(tier, (12,))
    (tier.directory / f".tmp-{key}-0badf00d").write_bytes(b"half a snapshot")
    (tier.directory / "NOT-A-KEY.tqsnap").write_bytes(read_snapshot_bytes(tier, key))
    (tier.directory / "README").write_text("left alone")

    report = SsdTier(tier.directory, max_bytes=1 << 20).recover()

    assert report.num_temporaries_removed == 1
    assert report.quarantined == (("NOT-A-KEY.tqsnap", "file name is not a snapshot key"),)
    assert snapshot_files(tier) == {f"{key}.tqsnap", "README"}


def test_write_error_propagates_counts_and_leaves_no_file(tier, monkeypatch):
    kept = store(tier, (13,))

    def failing_replace(source, destination):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", failing_replace)
    with pytest.raises(OSError, match="No space left"):
        store(tier, (14,))
    monkeypatch.undo()

    assert tier.statistics().num_write_errors == 1
    assert [entry.key for entry in tier.entries()] == [kept]
    assert snapshot_files(tier) == {f"{kept}.tqsnap"}


def test_remove(tier):
    key = store(tier, (15,))
    assert tier.remove(key) is True
    assert tier.remove(key) is False
    assert snapshot_files(tier) == set()
    assert tier.statistics().num_bytes == 0


async def test_async_wrappers_run_on_worker_threads(tmp_path):
    tier = SsdTier(tmp_path, max_bytes=1 << 20)
    assert (await tier.recover_async()).num_loaded == 0
    rng = random.Random(6)
    expected = {}

    async def put_one(n: int) -> None:
        fields = header_fields(token_ids=(20, n))
        key = snapshot_key(fields["namespace"], fields["token_ids"])
        planes = sample_planes(rng)
        expected[key] = planes[0][1]
        await tier.put_async(key, fields, planes)

    async with trio.open_nursery() as nursery:
        for n in range(8):
            nursery.start_soon(put_one, n)

    for key, data in expected.items():
        header, planes = await tier.get_async(key)
        assert planes["layers.0.keys"].data == data
    assert tier.statistics().num_writes == 8
    assert index_matches_directory(tier)


def test_on_evict_announces_each_eviction_before_the_unlink(tmp_path):
    """The server logs "snapshot removed" from this hook: it must run while the file exists,
    so a crash between the two never hides the removal of an acknowledged file."""
    directory = tmp_path / "ssd"
    seen: list[tuple[str, bool]] = []

    def hook(key: str) -> None:
        seen.append((key, (directory / f"{key}.tqsnap").is_file()))

    tier = SsdTier(directory, max_bytes=1 << 20, on_evict=hook)
    tier.recover()
    first = store(tier, (1,), size=1000)
    one = tier.entries()[0].num_bytes
    tier.max_bytes = 2 * one + one // 2
    keys = [first] + [store(tier, (2, n), size=1000) for n in range(3)]
    assert seen == [(keys[0], True), (keys[1], True)]
    restarted = SsdTier(directory, max_bytes=one + one // 2, on_evict=hook)
    restarted.recover()  # the budget shrank: recovery evicts the oldest too
    assert seen[2:] == [(keys[2], True)]
    assert [entry.key for entry in restarted.entries()] == keys[3:]
