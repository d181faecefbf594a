"""Tensor-parallel shards of the SSD tier without a group: names, identity and the
follower's disk thread.

Real SsdTiers over real directories. A ShardDisk's thread is made deterministic by closing
it (close() runs every queued job, then stops): its results are then complete.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tqserve.storage.shard import ShardId
from tqserve.storage.shard_disk import ShardDisk
from tqserve.storage.snapshot import decode_header
from tqserve.storage.tier import QUARANTINE_DIR, SsdTier
from tqserve.storage.writer import snapshot_key
from tests.unit.test_storage_snapshot import header_fields

NS = "ns-test"
FP = "fp-test"


def tier_at(directory: Path, shard: ShardId | None) -> SsdTier:
    tier = SsdTier(directory, 1 << 20, expected_fingerprints=[FP], shard=shard)
    tier.recover()
    return tier


def recovery(directory: Path, shard: ShardId | None):
    return SsdTier(directory, 1 << 20, expected_fingerprints=[FP], shard=shard).recover()


def planes(seed: int = 0) -> list[tuple[str, bytes, tuple[int, ...], str]]:
    return [("0.keys", bytes((seed + i * 7) % 251 for i in range(4096)), (4096,), "uint8")]


def key_of(tokens: tuple[int, ...], namespace: str = NS) -> str:
    return snapshot_key(namespace, tokens)


def test_a_shard_is_named_by_group_size_and_rank(tmp_path: Path) -> None:
    shard = ShardId(2, 1)
    assert shard.name == "tp2-rank1"
    assert shard.directory(tmp_path) == tmp_path / "tp2-rank1"
    assert shard.fields() == {"tp_size": 2, "tp_rank": 1}
    for size, rank in ((1, 0), (2, 2), (2, -1)):
        with pytest.raises(ValueError):
            ShardId(size, rank)


def test_a_shard_file_says_whose_it_is_and_nobody_else_loads_it(tmp_path: Path) -> None:
    """rank 1 of 2 writes; its file copied under the same name to rank 0 of 2, to rank 1
    of 4 and to a single process is quarantined there, naming both identities; a single
    process's file is refused by a shard; each tier still serves its own."""
    one_of_two = tier_at(ShardId(2, 1).directory(tmp_path), ShardId(2, 1))
    fields = header_fields(token_ids=(1, 2, 3))
    key = key_of((1, 2, 3))
    entry = one_of_two.put(key, fields, planes())
    header = decode_header(entry.path.read_bytes())
    assert (header.extra["tp_size"], header.extra["tp_rank"]) == (2, 1)
    single = tier_at(tmp_path / "single", None)
    own = single.put(key, fields, planes())
    assert "tp_size" not in decode_header(own.path.read_bytes()).extra

    readers = {ShardId(2, 0): "read by rank 0 of a 2-rank group",
               ShardId(4, 1): "read by rank 1 of a 4-rank group",
               None: "read by a single process"}
    for shard, says in readers.items():
        directory = tmp_path / f"copy-{shard.name if shard else 'single'}"
        directory.mkdir(mode=0o700)
        shutil.copy(entry.path, directory / entry.path.name)
        report = recovery(directory, shard)
        assert report.quarantined == ((entry.path.name, "shard mismatch: written by rank 1 "
                                       f"of a 2-rank group, {says}"),), shard
        assert (directory / QUARANTINE_DIR / entry.path.name).is_file()

    planted = ShardId(2, 0).directory(tmp_path / "planted")
    planted.mkdir(parents=True, mode=0o700)
    shutil.copy(own.path, planted / own.path.name)
    report = recovery(planted, ShardId(2, 0))
    assert report.quarantined == ((own.path.name, "shard mismatch: written by a single "
                                   "process, read by rank 0 of a 2-rank group"),)

    again = SsdTier(ShardId(2, 1).directory(tmp_path), 1 << 20, expected_fingerprints=[FP],
                    shard=ShardId(2, 1))
    assert again.recover().num_loaded == 1
    assert again.get(key)[0].token_ids == (1, 2, 3)


def drained(disk: ShardDisk) -> list[dict]:
    disk.close()
    return disk.take_results()


def statuses(results: list[dict]) -> dict[tuple[str, int], str]:
    """(kind, order) -> status; each order reported exactly once."""
    out = {(r["kind"], r["order"]): r["status"] for r in results}
    assert len(out) == len(results), results
    return out


def test_the_disk_thread_writes_reads_and_reports_every_order(tmp_path: Path) -> None:
    shard = ShardId(2, 1)
    tier = SsdTier(shard.directory(tmp_path), 1 << 20, expected_fingerprints=[FP], shard=shard)
    disk = ShardDisk(tier, NS)
    disk.recover()
    good = {tokens: key_of(tokens) for tokens in ((1, 2), (3, 4), (5, 6))}
    for order, (tokens, key) in enumerate(good.items(), start=1):
        disk.write(order, key, header_fields(token_ids=tokens), planes(order))
    disk.write(4, key_of((7, 8)), header_fields(token_ids=(9, 9)), planes())  # wrong key
    disk.fail_write(5, "not staged")
    results = drained(disk)
    assert statuses(results) == {("recovered", 0): "ok", ("write", 1): "ok",
                                 ("write", 2): "ok", ("write", 3): "ok",
                                 ("write", 4): "error", ("write", 5): "error"}
    reasons = {r["order"]: r["reason"] for r in results}
    assert reasons[5] == "not staged" and "file name does not match" in reasons[4]
    names = {p.name for p in shard.directory(tmp_path).iterdir() if p.is_file()}
    assert names == {f"{key}.tqsnap" for key in good.values()}  # durable: renamed in place

    # reads: one passes (its planes wait), one file was deleted, one corrupted
    (k12, k34, k56) = good.values()
    os.unlink(tier.directory / f"{k34}.tqsnap")
    path = tier.directory / f"{k56}.tqsnap"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF  # a byte of the last plane: the header still checks out
    path.write_bytes(bytes(data))
    disk = first = ShardDisk(tier, NS, max_jobs=1)
    disk.read(10, k12)
    disk.read(13, k12)  # over max_jobs (order 10 is queued or holds planes): busy at once
    assert statuses(drained(disk)) == {("read", 10): "ok", ("read", 13): "busy"}
    disk = ShardDisk(tier, NS)
    disk.read(11, k34)
    disk.read(12, k56)
    results = drained(disk)
    assert statuses(results) == {("read", 11): "missing", ("read", 12): "quarantined"}
    assert "checksum mismatch" in results[1]["reason"]  # one thread: reported in order
    assert (tier.directory / QUARANTINE_DIR / f"{k56}.tqsnap").is_file()
    assert disk.take_read(10) is None  # (held by the first disk)
    header, read = first.take_read(10)
    assert header.token_ids == (1, 2) and read["0.keys"].data == planes(1)[0][1]
    assert first.take_read(10) is None and disk.take_read(11) is None


def test_keep_removes_this_namespaces_other_files_and_recovery_reports_its_keys(
        tmp_path: Path) -> None:
    shard = ShardId(2, 1)
    tier = tier_at(shard.directory(tmp_path), shard)
    mine = [key_of((i, i + 1)) for i in range(3)]
    for i, key in enumerate(mine):
        tier.put(key, header_fields(token_ids=(i, i + 1)), planes(i))
    other = key_of((1, 2), "ns-other")
    tier.put(other, header_fields(namespace="ns-other", token_ids=(1, 2)), planes())
    stray = ShardId(2, 0).directory(tmp_path)  # rank 0's file planted among rank 1's
    tier_at(stray, ShardId(2, 0)).put(key_of((8, 9)), header_fields(token_ids=(8, 9)), planes())
    shutil.copy(stray / f"{key_of((8, 9))}.tqsnap", tier.directory)

    fresh = SsdTier(tier.directory, 1 << 20, expected_fingerprints=[FP], shard=shard)
    disk = ShardDisk(fresh, NS)
    disk.recover()
    disk.keep([mine[1]])
    (recovered,) = drained(disk)
    assert sorted(recovered["keys"]) == sorted(mine) and recovered["quarantined"] == 1
    assert sorted(e.key for e in fresh.entries()) == sorted([mine[1], other])  # other NS kept


def test_planes_let_go_of_before_or_after_their_read_ends_free_the_slot(tmp_path: Path
                                                                         ) -> None:
    shard = ShardId(2, 1)
    tier = tier_at(shard.directory(tmp_path), shard)
    key = key_of((1, 2))
    tier.put(key, header_fields(token_ids=(1, 2)), planes())
    disk = ShardDisk(tier, NS, max_jobs=1)
    disk.read(1, key)
    disk.discard(1)  # the read may not have run yet: it lets go when it ends
    assert statuses(drained(disk)) == {("read", 1): "ok"}
    disk.read(2, key)  # (closed: nothing runs, but the slot is free again, so no "busy")
    assert disk.take_results() == [] and disk.take_read(1) is None
