"""Files in the cache dir are untrusted input: real files, real links, FIFOs, sparse files.

Recovery reads headers only (counted by the tier's own `num_bytes_read`); declared sizes are
checked against the file before anything is allocated; links and non-regular entries are
never opened through; `quarantine/` cannot carry files out of the directory; the directory
must be private; vanished files leave the index.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import socket
import stat
import subprocess
import struct

import msgpack
import pytest
import zstandard

from tqserve.storage import cachedir
from tqserve.storage.snapshot import CHECKSUM_BYTES, MAGIC, SnapshotError, decode_header
from tqserve.storage.tier import QUARANTINE_DIR, SsdTier
from tqserve.storage.writer import snapshot_key
from tests.unit.test_storage_snapshot import header_fields, header_region_length
from tests.unit.test_storage_tier import store


def new_tier(directory, **kw) -> SsdTier:
    tier = SsdTier(directory, max_bytes=1 << 30, **kw)
    tier.recover()
    return tier


def forged(tokens: tuple[int, ...], plane: dict, blob: bytes) -> bytes:
    """A file with a valid, checksummed header describing `plane` (whatever it claims)."""
    fields = {**header_fields(token_ids=tokens), "format_version": 2,
              "planes": [{**plane, "compressed_len": len(blob),
                          "checksum": hashlib.blake2b(blob, digest_size=16).digest()}]}
    header = msgpack.packb(fields, use_bin_type=True)
    return b"".join([MAGIC, struct.pack("<I", len(header)), header,
                     hashlib.blake2b(header, digest_size=CHECKSUM_BYTES).digest(), blob])


def test_recovery_reads_headers_only_and_the_load_verifies_planes(tmp_path):
    directory = tmp_path / "ssd"
    tier = new_tier(directory)
    keys = [store(tier, (3, n), size=4096) for n in range(300)]
    files = {key: (directory / f"{key}.tqsnap").read_bytes() for key in keys}
    # A flipped plane byte in a file under its own name: the header is intact.
    damaged = keys[7]
    blob = bytearray(files[damaged])
    blob[-10] ^= 0x40
    (directory / f"{damaged}.tqsnap").write_bytes(bytes(blob))

    restarted = new_tier(directory)

    headers = sum(header_region_length(data) for data in files.values())
    total = sum(len(data) for data in files.values())
    assert restarted.statistics().num_bytes_read == headers < total // 5
    assert len(restarted.entries()) == 300  # the damaged file's header is fine
    with pytest.raises(SnapshotError, match="checksum mismatch in plane"):
        restarted.get(damaged)
    assert damaged not in {entry.key for entry in restarted.entries()}
    assert (directory / QUARANTINE_DIR / f"{damaged}.tqsnap").is_file()
    assert restarted.get(keys[8]) is not None
    # Each load reads the header, then the whole file.
    assert restarted.statistics().num_bytes_read == headers + sum(
        header_region_length(files[key]) + len(files[key]) for key in (damaged, keys[8]))


def test_declared_sizes_are_checked_before_anything_is_allocated(tmp_path):
    directory = tmp_path / "ssd"
    tier = new_tier(directory)
    good = store(tier, (1, 1))
    # A 2**40-byte plane from a tiny zstd frame that does not state its size.
    blob = zstandard.ZstdCompressor(write_content_size=False).compress(b"\0" * 4096)
    huge = (2, 2)
    (directory / f"{snapshot_key('ns-test', huge)}.tqsnap").write_bytes(forged(
        huge, {"name": "0.keys", "shape": [1 << 38], "dtype": "float32", "raw_len": 1 << 40},
        blob))
    # A plane whose declared compressed length runs past the end of the file.
    past = (2, 3)
    data = forged(past, {"name": "0.keys", "shape": [4096], "dtype": "uint8", "raw_len": 4096},
                  blob)
    (directory / f"{snapshot_key('ns-test', past)}.tqsnap").write_bytes(data[:-5])
    # Under the cap, but more than zstd's format can decode from so few bytes.
    ratio = (2, 6)
    (directory / f"{snapshot_key('ns-test', ratio)}.tqsnap").write_bytes(forged(
        ratio, {"name": "0.keys", "shape": [1 << 29], "dtype": "float32", "raw_len": 1 << 31},
        blob))
    # Sparse 30 GiB files: all zeros, and a real snapshot extended to 30 GiB.
    zeros = directory / f"{snapshot_key('ns-test', (2, 4))}.tqsnap"
    subprocess.run(["truncate", "-s", "30G", str(zeros)], check=True)
    extended = (2, 5)
    store(tier, extended)
    subprocess.run(["truncate", "-s", "30G",
                    str(directory / f"{snapshot_key('ns-test', extended)}.tqsnap")], check=True)

    restarted = SsdTier(directory, max_bytes=1 << 30)
    report = restarted.recover()

    reasons = dict(report.quarantined)
    assert len(reasons) == 5 and report.num_loaded == 1, reasons
    assert [entry.key for entry in restarted.entries()] == [good]
    assert any("over the cap" in why for why in reasons.values()), reasons
    assert any("ratio over 32768" in why for why in reasons.values()), reasons
    assert sum("header declares" in why for why in reasons.values()) == 2, reasons
    assert any("bad magic" in why for why in reasons.values()), reasons
    assert restarted.statistics().num_bytes_read < 64 << 10
    assert len(os.listdir(directory / QUARANTINE_DIR)) == 5


def test_cache_dir_is_created_private_and_a_shared_one_is_refused(tmp_path):
    fresh = tmp_path / "a" / "cache"
    new_tier(fresh)
    assert stat.S_IMODE(fresh.stat().st_mode) == 0o700
    for mode in (0o777, 0o770, 0o1777, 0o720):
        shared = tmp_path / f"shared-{mode:o}"
        shared.mkdir()
        shared.chmod(mode)
        with pytest.raises(ValueError, match=f"group- or world-writable.*{mode:04o}"):
            SsdTier(shared, max_bytes=1 << 20).recover()
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    with pytest.raises(ValueError, match="not a directory"):
        SsdTier(not_a_dir, max_bytes=1 << 20).recover()


def test_links_and_non_regular_entries_are_never_loaded(tmp_path, monkeypatch):
    directory = tmp_path / "ssd"
    outside = tmp_path / "outside"
    outside.mkdir()
    tier = new_tier(directory)
    kept = store(tier, (5, 0))
    linked = store(tier, (5, 1))
    target = outside / f"{linked}.tqsnap"
    shutil.move(directory / f"{linked}.tqsnap", target)
    os.symlink(target, directory / f"{linked}.tqsnap")
    fifo = directory / f"{snapshot_key('ns-test', (5, 2))}.tqsnap"
    os.mkfifo(fifo)
    (directory / f"{snapshot_key('ns-test', (5, 3))}.tqsnap").mkdir()
    os.mkdir(directory / ".tmp-leftover-dir")
    sock = directory / f"{snapshot_key('ns-test', (5, 5))}.tqsnap"
    server = socket.socket(socket.AF_UNIX)
    with monkeypatch.context() as patch:  # a relative path: AF_UNIX paths are short
        patch.chdir(directory)
        server.bind(sock.name)  # open() of a socket fails with ENXIO

    restarted = SsdTier(directory, max_bytes=1 << 30)
    report = restarted.recover()  # a FIFO opened without O_NONBLOCK would block here

    reasons = dict(report.quarantined)
    assert [entry.key for entry in restarted.entries()] == [kept]
    assert reasons[f"{linked}.tqsnap"] == "a symbolic link, not a regular file"
    assert reasons[fifo.name] == "not a regular file (a FIFO)"
    assert "a directory" in reasons[f"{snapshot_key('ns-test', (5, 3))}.tqsnap"]
    assert reasons[sock.name] == "not a regular file (a socket)"
    server.close()
    quarantined = directory / QUARANTINE_DIR
    assert (quarantined / f"{linked}.tqsnap").is_symlink()  # the link moved, not its target
    assert target.is_file() and decode_header(target.read_bytes()).token_ids == (5, 1)
    assert stat.S_ISFIFO((quarantined / fifo.name).lstat().st_mode)
    assert (directory / ".tmp-leftover-dir").is_dir()

    # An indexed file replaced by a link after recovery: the load refuses it, and removing
    # (as eviction does) unlinks only the link, never the target outside.
    victim = outside / "victim.tqsnap"
    victim.write_bytes((directory / f"{kept}.tqsnap").read_bytes())
    (directory / f"{kept}.tqsnap").unlink()
    os.symlink(victim, directory / f"{kept}.tqsnap")
    with pytest.raises(SnapshotError, match="symbolic link"):
        restarted.get(kept)
    assert victim.is_file() and restarted.entries() == ()
    again = store(restarted, (5, 4))
    os.replace(directory / f"{again}.tqsnap", outside / "again.tqsnap")
    os.symlink(outside / "again.tqsnap", directory / f"{again}.tqsnap")
    assert restarted.remove(again)
    assert (outside / "again.tqsnap").is_file()
    assert not os.path.lexists(directory / f"{again}.tqsnap")


def test_leftover_temporaries_are_removed_whatever_they_are_never_followed(tmp_path):
    """Issue 20 #11: `.tmp-*` leftovers are removed at start: a symbolic link (to a file,
    to a directory, dangling) as a link, its target untouched; a FIFO; a regular file. A
    directory of that name is left alone."""
    directory = tmp_path / "ssd"
    outside = tmp_path / "outside"
    outside.mkdir()
    kept = store(new_tier(directory), (4, 0))
    target = outside / "precious"
    target.write_bytes(b"not ours")
    os.symlink(target, directory / ".tmp-link-to-a-file")
    os.symlink(outside, directory / ".tmp-link-to-a-dir")
    os.symlink(tmp_path / "nowhere", directory / ".tmp-dangling")
    os.mkfifo(directory / ".tmp-fifo")
    (directory / f".tmp-{kept}-0badf00d").write_bytes(b"half a snapshot")
    os.mkdir(directory / ".tmp-dir")

    restarted = SsdTier(directory, max_bytes=1 << 30)
    report = restarted.recover()

    assert report.num_temporaries_removed == 5
    assert sorted(p.name for p in directory.iterdir()) == [".tmp-dir", f"{kept}.tqsnap"]
    assert target.read_bytes() == b"not ours" and list(outside.iterdir()) == [target]
    assert [entry.key for entry in restarted.entries()] == [kept]


def test_a_quarantine_symlink_never_moves_files_out_of_the_directory(tmp_path):
    directory = tmp_path / "ssd"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    tier = new_tier(directory)
    good = store(tier, (6, 0))
    bad = store(tier, (6, 1))
    (directory / f"{bad}.tqsnap").write_bytes(b"garbage")
    os.symlink(elsewhere, directory / QUARANTINE_DIR)

    restarted = SsdTier(directory, max_bytes=1 << 30)
    report = restarted.recover()

    assert [name for name, _ in report.quarantined] == [f"{bad}.tqsnap"]
    assert list(elsewhere.iterdir()) == []
    assert not os.path.lexists(directory / f"{bad}.tqsnap")  # deleted instead, logged
    assert [entry.key for entry in restarted.entries()] == [good]


def test_quarantine_keeps_only_the_newest_files_within_its_byte_bound(tmp_path, monkeypatch):
    """A flood of bad files (real recoveries, one per round) never grows quarantine/ past
    its bounds; the newest quarantined files are the ones kept."""
    directory = tmp_path / "ssd"
    new_tier(directory).recover()
    names = []
    for n in range(cachedir.QUARANTINE_MAX_FILES + 6):
        name = f"{snapshot_key('x', (7, n))}.tqsnap"
        (directory / name).write_bytes(b"garbage")
        names.append(name)
        if n % 10 == 9 or n == cachedir.QUARANTINE_MAX_FILES + 5:
            SsdTier(directory, max_bytes=1 << 30).recover()
    kept = {p.name for p in (directory / QUARANTINE_DIR).iterdir()}
    assert len(kept) == cachedir.QUARANTINE_MAX_FILES
    assert names[-1] in kept and names[0] not in kept

    monkeypatch.setattr(cachedir, "QUARANTINE_MAX_BYTES", 3 * 64 * 1024)
    sparse = directory / f"{snapshot_key('x', (8, 0))}.tqsnap"
    with open(sparse, "wb") as out:
        out.truncate(30 << 30)  # 30 GiB that occupy no blocks: counted as what they occupy
    SsdTier(directory, max_bytes=1 << 30).recover()
    dense = []
    for n in range(4):
        name = f"{snapshot_key('x', (9, n))}.tqsnap"
        (directory / name).write_bytes(os.urandom(64 * 1024))
        dense.append(name)
        SsdTier(directory, max_bytes=1 << 30).recover()
    kept = {p.name for p in (directory / QUARANTINE_DIR).iterdir()}
    assert set(dense[1:]) <= kept and dense[0] not in kept  # three 64 KiB files fit, not four
    assert sum(os.stat(directory / QUARANTINE_DIR / n).st_blocks * 512 for n in kept) \
        <= 3 * 64 * 1024


def test_vanished_files_leave_the_index_and_a_removed_directory_makes_the_tier_cold(
        tmp_path, caplog):
    directory = tmp_path / "ssd"
    tier = new_tier(directory)
    keys = [store(tier, (8, n)) for n in range(5)]
    (directory / f"{keys[0]}.tqsnap").unlink()
    assert tier.get(keys[0]) is None  # a missing file at load: a miss, out of the index
    assert tier.statistics().num_entries == 4
    for key in keys[1:3]:
        (directory / f"{key}.tqsnap").unlink()
    assert sorted(tier.reconcile()) == sorted(keys[1:3])
    stats = tier.statistics()
    assert (stats.num_entries, stats.num_errors, stats.state) == (2, 0, "ok")

    shutil.rmtree(directory)  # the whole directory: cold at the first read, one line
    assert tier.get(keys[3]) is None
    stats = tier.statistics()
    assert (stats.num_entries, stats.num_bytes, stats.num_errors, stats.state) == \
        (0, 0, 1, "cold")
    assert tier.entries() == () and tier.reconcile() == ()
    assert [r.levelname for r in caplog.records if "cache dir" in r.message] == ["WARNING"]
    # The next write creates the directory again, private, and the tier is ok.
    again = store(tier, (8, 9))
    assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
    assert [e.key for e in tier.entries()] == [again] and tier.get(again) is not None
    assert tier.statistics().state == "ok"


def test_encode_refuses_nothing_that_recovery_would_reject(tmp_path):
    """The writer's own files always pass the header-only checks (no false quarantine)."""
    directory = tmp_path / "ssd"
    tier = new_tier(directory)
    zeros = [("0.keys", b"\0" * (1 << 20), (1 << 20,), "uint8")]  # zstd's best ratio
    fields = header_fields(token_ids=(9, 9))
    tier.put(snapshot_key(fields["namespace"], (9, 9)), fields, zeros)
    assert new_tier(directory).statistics().num_entries == 1
