"""The SSD tier under a failing cache dir (issue 20 #6): real file-system errors, no raise.

Each case makes the error for real: the directory replaced by a file (ENOTDIR on every
path through it), removed, or searched without permission (EACCES, in a child process
that runs without the capabilities that let root ignore permissions). The clock of the
write pause is the tier's injected `clock` (a number the test moves), never a sleep.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tqserve.storage.health import TierHealth, TierState
from tqserve.storage.tier import SsdTier
from tests.unit.test_storage_tier import store

REPO = Path(__file__).resolve().parents[2]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def replace_by_a_file(directory: Path) -> None:
    shutil.rmtree(directory)
    directory.write_bytes(b"not a directory")


def test_a_directory_replaced_by_a_file_makes_the_tier_cold_without_raising(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="tqserve.storage.tier")
    clock = Clock()
    directory = tmp_path / "ssd"
    tier = SsdTier(directory, max_bytes=1 << 20, clock=clock, retry_seconds=5)
    tier.recover()
    keys = [store(tier, (20, n)) for n in range(3)]
    replace_by_a_file(directory)

    assert tier.get(keys[0]) is None  # ENOTDIR: a miss, and every entry dropped
    stats = tier.statistics()
    assert (stats.num_entries, stats.num_bytes, stats.state, stats.num_errors) == \
        (0, 0, "cold", 1)
    assert tier.reconcile() == () and tier.remove(keys[1]) is False
    with pytest.raises(NotADirectoryError):  # the write is tried: it fails, counted
        store(tier, (20, 9))
    with pytest.raises(OSError, match="paused after a failed one"):
        store(tier, (20, 10))  # inside the pause: not even encoded
    stats = tier.statistics()
    assert (stats.num_write_errors, stats.num_errors, stats.state) == (2, 2, "cold")
    warnings = [r for r in caplog.records if "cache dir" in r.message]
    assert [r.levelname for r in warnings] == ["WARNING"]
    assert "read failed (Not a directory)" in warnings[0].message

    directory.unlink()  # the directory is back; the pause runs out; the next write works
    directory.mkdir(mode=0o700)
    with pytest.raises(OSError, match="paused"):
        store(tier, (20, 11))
    clock.now = 5.0
    back = store(tier, (20, 12))
    assert tier.statistics().state == "ok" and tier.get(back) is not None
    assert [r.levelname for r in caplog.records if "cache dir" in r.message] == \
        ["WARNING", "INFO"]


def test_reconcile_and_remove_never_raise_for_the_directory(tmp_path):
    directory = tmp_path / "ssd"
    tier = SsdTier(directory, max_bytes=1 << 20)
    tier.recover()
    keys = [store(tier, (21, n)) for n in range(3)]
    replace_by_a_file(directory)
    assert tier.remove(keys[0]) is True  # its unlink fails (ENOTDIR): counted, not raised
    stats = tier.statistics()
    assert (stats.num_entries, stats.state, stats.num_errors) == (2, "read_only", 1)
    assert sorted(tier.reconcile()) == sorted(keys[1:])  # cold: everything dropped
    stats = tier.statistics()
    assert (stats.num_entries, stats.state, stats.num_errors) == (0, "cold", 2)


def test_health_states_only_worsen_until_a_write_succeeds():
    clock = Clock()
    health = TierHealth(Path("d"), clock=clock, retry_seconds=1)
    error = OSError(28, "No space left on device")
    health.failed("read", error, cold=True)
    health.failed("write", error)
    assert health.state is TierState.COLD and not health.can_write()
    clock.now = 1.0
    assert health.can_write()
    health.wrote()
    assert health.state is TierState.OK and health.num_errors == 2
    health.failed("read", error)  # a read error alone: reads of others go on, writes too
    assert health.state is TierState.READ_ONLY and health.can_write()
    with pytest.raises(ValueError, match="retry_seconds"):
        TierHealth(Path("d"), retry_seconds=-1)


def drop_permission_capabilities() -> None:
    """In a child before its exec: root without CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH
    (dropped from the bounding set, so the program exec'd never has them) obeys modes."""
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (1, 2):
        if libc.prctl(24, cap, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
            raise OSError(ctypes.get_errno(), "PR_CAPBSET_DROP")


def without_permission_capabilities() -> dict:
    """subprocess options that run a child unable to ignore permissions, as root too."""
    return {"preexec_fn": drop_permission_capabilities} if os.geteuid() == 0 else {}


CHILD = textwrap.dedent("""
    import json, os, sys
    from tqserve.storage.tier import SsdTier
    from tests.unit.test_storage_tier import store
    directory = sys.argv[1]
    tier = SsdTier(directory, max_bytes=1 << 20)
    tier.recover()
    keys = [store(tier, (22, n)) for n in range(2)]
    os.chmod(directory, 0)
    got = tier.get(keys[0])
    gone = tier.reconcile()
    try:
        store(tier, (22, 9))
        wrote = "ok"
    except OSError as exc:
        wrote = exc.strerror or str(exc)
    os.chmod(directory, 0o700)
    stats = tier.statistics()
    print(json.dumps({"got": got, "gone": list(gone), "wrote": wrote, "state": stats.state,
                      "errors": stats.num_errors, "entries": stats.num_entries}))
""")


def test_a_directory_without_permissions_makes_the_tier_cold(tmp_path):
    """chmod 000 on the cache dir of a process that is not root (or is root without the
    capabilities that ignore permissions): EACCES for real, a miss, never a raise."""
    directory = tmp_path / "ssd"
    try:
        done = subprocess.run([sys.executable, "-c", CHILD, str(directory)], cwd=REPO,
                              capture_output=True, text=True, timeout=120,
                              env={**os.environ, "PYTHONPATH": str(REPO)},
                              **without_permission_capabilities())
    except subprocess.SubprocessError as exc:
        pytest.skip(f"cannot drop root's permission capabilities here: {exc}")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.splitlines()[-1])
    assert result == {"got": None, "gone": [], "wrote": "Permission denied", "state": "cold",
                      "errors": 2, "entries": 0}, done.stderr
