"""Crash safety: SIGKILL mid-write never loses an acknowledged snapshot or exposes a torn one.

On Linux without power loss, SIGKILL cannot drop page-cache data, so the kill loop proves
atomic visibility (temp file + rename) and recovery; the fsync discipline that survives power
loss is asserted structurally by recording the calls.
"""

import os
import random
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tqserve.storage.snapshot import read_snapshot
from tqserve.storage.tier import QUARANTINE_DIR, SsdTier
from tqserve.storage.writer import (is_temporary_name, snapshot_key, validate_key,
                            write_snapshot_file)
from tests.unit.test_storage_snapshot import header_fields

REPO_ROOT = Path(__file__).resolve().parents[2]
NUM_KILLS = 50

WRITER_SCRIPT = """
import random, sys
from tqserve.storage.tier import SsdTier
from tqserve.storage.writer import snapshot_key

directory, seed = sys.argv[1], int(sys.argv[2])
rng = random.Random(seed)
tier = SsdTier(directory, max_bytes=1 << 40)
tier.recover()
print("ready", flush=True)
for n in range(1 << 30):
    tokens = [seed, n] + [rng.randrange(1 << 17) for _ in range(rng.randrange(200))]
    size = rng.randrange(1, 1 << 15)
    fields = dict(cache_kind="kv", k_bits=None, v_bits=None, head_dim=64, rotation_id=None,
                  model_fingerprint="fp-crash", namespace="ns-crash", token_ids=tokens,
                  offset=len(tokens), minimum_reusable_offset=0, created_ns=n)
    planes = [("layers.0.keys", rng.randbytes(size), (size,), "uint8"),
              ("layers.0.values", bytes(4 * size), (size,), "float32")]
    key = snapshot_key("ns-crash", tokens)
    tier.put(key, fields, planes)
    print(key, flush=True)
"""


def run_writer_until_killed(directory: Path, seed: int, delay: float) -> list[str]:
    """Start the writer, SIGKILL it `delay` seconds after it is ready; return acknowledged keys."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    process = subprocess.Popen([sys.executable, "-c", WRITER_SCRIPT, str(directory), str(seed)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    try:
        ready = process.stdout.readline()
        if ready != b"ready\n":
            raise RuntimeError(f"writer did not start: {process.stderr.read().decode()}")
        time.sleep(delay)
        process.send_signal(signal.SIGKILL)
        output, _ = process.communicate()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == -signal.SIGKILL
    lines = output.decode().split("\n")
    # The last element is either "" or a line cut short by the kill: not acknowledged.
    return [validate_key(line) for line in lines[:-1]]


def test_sigkill_during_writes_loses_no_acknowledged_snapshot(tmp_path):
    rng = random.Random(2024)
    directory = tmp_path / "ssd"
    acknowledged: set[str] = set()
    num_temporaries_removed = 0
    for kill in range(NUM_KILLS):
        new_keys = run_writer_until_killed(directory, seed=kill, delay=rng.uniform(0.0, 0.08))
        acknowledged.update(new_keys)

        tier = SsdTier(directory, max_bytes=1 << 40)
        report = tier.recover()

        num_temporaries_removed += report.num_temporaries_removed
        assert report.quarantined == ()
        indexed = {entry.key for entry in tier.entries()}
        assert acknowledged <= indexed
        for key in new_keys:
            header, planes = tier.get(key)
            assert snapshot_key(header.namespace, header.token_ids) == key
            assert planes["layers.0.values"].data == bytes(4 * header.planes[0].raw_len)
        assert not [name for name in os.listdir(directory) if is_temporary_name(name)]
        assert not (directory / QUARANTINE_DIR).exists()
    assert len(acknowledged) >= NUM_KILLS
    for entry in tier.entries():
        read_snapshot(entry.path)


@pytest.fixture
def recorded_calls(monkeypatch) -> list[tuple[str, str]]:
    """Record fsync (of a file or a directory) and os.replace calls, in order."""
    calls: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        mode = os.fstat(fd).st_mode
        calls.append(("fsync", "directory" if stat.S_ISDIR(mode) else "file"))
        real_fsync(fd)

    def replace(source, destination) -> None:
        calls.append(("replace", Path(destination).name))
        real_replace(source, destination)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    return calls


def test_writer_fsyncs_the_file_before_rename_and_the_directory_after(tmp_path, recorded_calls):
    key = "0123456789abcdef" * 2
    path = write_snapshot_file(tmp_path, key, b"payload")
    assert recorded_calls == [("fsync", "file"), ("replace", f"{key}.tqsnap"), ("fsync", "directory")]
    assert path.read_bytes() == b"payload"
    assert os.listdir(tmp_path) == [f"{key}.tqsnap"]


def test_tier_put_acknowledges_only_after_the_directory_fsync(tmp_path, recorded_calls):
    tier = SsdTier(tmp_path, max_bytes=1 << 20)
    tier.recover()
    recorded_calls.clear()
    fields = header_fields()
    key = snapshot_key(fields["namespace"], fields["token_ids"])
    tier.put(key, fields, [("p", bytes(8), (8,), "uint8")])
    assert recorded_calls == [("fsync", "file"), ("replace", f"{key}.tqsnap"), ("fsync", "directory")]


def test_failed_fsync_propagates_and_leaves_nothing(tmp_path, monkeypatch):
    def failing_fsync(fd: int) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "fsync", failing_fsync)
    with pytest.raises(OSError, match="Input/output error"):
        write_snapshot_file(tmp_path, "ab" * 16, b"payload")
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("key", ["", "abc", "AB" * 16, "ab" * 33, "../" + "ab" * 16,
                                 "ab" * 16 + "\n", "ab" * 8 + "/x", None])
def test_only_hex_keys_become_paths(tmp_path, key):
    with pytest.raises(ValueError):
        write_snapshot_file(tmp_path, key, b"x")
    assert os.listdir(tmp_path) == []


def test_snapshot_key_is_a_stable_unambiguous_digest():
    key = snapshot_key("ns", [1, 2, 3])
    assert validate_key(key) == key and len(key) == 64
    assert snapshot_key("ns", (1, 2, 3)) == key
    assert len({key, snapshot_key("ns", [1, 2]), snapshot_key("ns", [1, 2, 3, 0]),
                snapshot_key("ns2", [1, 2, 3]), snapshot_key("n", [1, 2, 3])}) == 5
    with pytest.raises(ValueError):
        snapshot_key("ns", [-1])
    with pytest.raises(ValueError):
        snapshot_key("ns", [2**32])
