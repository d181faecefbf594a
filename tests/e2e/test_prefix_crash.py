"""Crash safety of the real server: SIGKILL `tqserve serve` at random moments while it writes
snapshots, restart it on the same --cache-dir, and check the directory every time.

Each cycle starts `python -m api.cli serve` as a subprocess (bundled draft model, float32,
--ssd-flush sync unless TQSERVE_CRASH_FLUSH says async, a 1-byte RAM budget so every
finished row spills to disk at the next step), drives short multi-turn conversations over
WebSockets (each turn extends the previous one, so SSD ancestors get superseded and removed
too), and SIGKILLs it after a seeded random delay.
The server's log goes to a file: "snapshot acknowledged <key>" is written only after the
file, its rename and its directory are fsynced; "snapshot removed <key>" before any unlink.

Proven after every kill and every restart:
  * zero acknowledged snapshots missing: each key whose last word in the logs is
    "acknowledged" is in the directory and verifies (storage.read_snapshot);
  * zero corrupt snapshots loaded: after recovery nothing was quarantined, every indexed
    file verifies, and the server's index holds exactly the files on disk;
  * zero temporary files left after recovery.
On Linux without power loss SIGKILL cannot drop page-cache data, so this proves atomic
visibility, ordering of acknowledgement and removal, and recovery (the fsyncs themselves are
asserted structurally in tests/unit/test_storage_crash.py).
"""

from __future__ import annotations

import collections
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import trio
from trio_websocket import ConnectionClosed, HandshakeError, open_websocket_url

from tqserve.storage.snapshot import read_snapshot
from tqserve.storage.tier import QUARANTINE_DIR
from tqserve.storage.writer import SNAPSHOT_SUFFIX, is_temporary_name
from tests.api.wsclient import Session

REPO_ROOT = Path(__file__).resolve().parents[2]
# The suite runs 20 kills (~2 s each: a server start); a longer run sets TQSERVE_CRASH_KILLS
# (e.g. 200, the figures of record) and may set TQSERVE_CRASH_FLUSH=async (the default
# --ssd-flush); figures: docs/prefix-cache.md.
NUM_KILLS = int(os.environ.get("TQSERVE_CRASH_KILLS", "20"))
FLUSH = os.environ.get("TQSERVE_CRASH_FLUSH", "sync")
SEED = 20261130
MAX_KILL_DELAY = 0.8      # seconds after "serving" until the kill (uniform from 0.05)
CONVERSATIONS = 3         # concurrent WebSocket conversations per server
START_TIMEOUT = 60.0      # a hang guard for one server start, never a measurement
VOCAB = 8192              # the bundled draft model's vocabulary
SERVING = re.compile(r"serving .* on (http://\S+) \(WebSocket")
EVENT = re.compile(r"tqserve\.prefix: snapshot (acknowledged|removed) ([0-9a-f]{16,64})$")


def server_command(directory: Path) -> list[str]:
    return [sys.executable, "-u", "-m", "tqserve.api.cli", "serve", "--port", "0", "--dtype", "float32",
            "--cache-dir", str(directory), "--ssd-flush", FLUSH, "--ram-cache-bytes", "1",
            "--max-batch", "4", "--max-tokens-cap", "16", "--default-max-tokens", "4"]


def snapshot_events(log: Path) -> list[tuple[str, str]]:
    """(event, key) in log order; a last line cut short by the kill matches nothing."""
    return [(m[1], m[2]) for m in map(EVENT.match, log.read_text().splitlines()) if m]


def snapshot_files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.iterdir() if p.name.endswith(SNAPSHOT_SUFFIX))


def check_acknowledged(directory: Path, status: dict[str, str]) -> int:
    """Every key last acknowledged is on disk and verifies; returns how many."""
    required = [key for key, last in status.items() if last == "acknowledged"]
    for key in required:
        path = directory / f"{key}{SNAPSHOT_SUFFIX}"
        assert path.is_file(), f"acknowledged snapshot {key} is missing"
        read_snapshot(path)  # SnapshotError fails the test
    return len(required)


def check_recovered(directory: Path, stats: dict) -> None:
    """After recovery: no temporaries, nothing quarantined, every indexed file verifies."""
    names = [p.name for p in directory.iterdir()]
    assert not [n for n in names if is_temporary_name(n)], names
    quarantine = directory / QUARANTINE_DIR
    assert not quarantine.exists() or not list(quarantine.iterdir()), \
        sorted(p.name for p in quarantine.iterdir())
    files = snapshot_files(directory)
    for path in files:
        read_snapshot(path)
    prefix = stats["prefix_cache"]
    assert prefix["quarantined"] == 0, prefix
    assert prefix["ssd_entries"] == len(files), (prefix, len(files))


async def wait_serving(process: trio.Process, log: Path) -> str:
    with trio.fail_after(START_TIMEOUT):
        while True:
            text = log.read_text()
            found = SERVING.search(text)
            if found:
                return found[1]
            assert process.poll() is None, f"server exited at start:\n{text[-3000:]}"
            await trio.sleep(0.01)


async def converse(ws_url: str, rng: random.Random, name: str) -> None:
    """Multi-turn greedy requests until cancelled (the kill ends the connection)."""
    try:
        async with open_websocket_url(ws_url) as ws:
            session = Session(ws)
            history: list[int] = []
            for turn in range(1 << 20):
                if len(history) > 96:
                    history = []
                history += [rng.randrange(32, VOCAB) for _ in range(rng.randrange(1, 6))]
                rid = f"{name}-{turn}"
                await session.generate(rid, prompt_tokens=history,
                                       max_tokens=rng.randrange(1, 5), temperature=0)
                (result,) = await session.wait(rid)
                assert result.end["type"] == "done", result.end
                history += result.token_ids
    except (ConnectionClosed, HandshakeError, OSError, trio.BrokenResourceError):
        pass  # the server was killed under us


async def test_sigkill_server_loses_no_acknowledged_snapshot(tmp_path):
    rng = random.Random(SEED)
    directory = tmp_path / "cache"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    status: dict[str, str] = {}   # key -> last event about it across every server's log
    counts: collections.Counter[str] = collections.Counter()
    torn_at_kill = 0
    started = time.monotonic()
    async with httpx.AsyncClient() as client:
        for cycle in range(NUM_KILLS + 1):
            log = tmp_path / f"server-{cycle}.log"
            with open(log, "wb") as sink:
                process = await trio.lowlevel.open_process(
                    server_command(directory), stdout=sink, stderr=subprocess.STDOUT,
                    env=env, cwd=REPO_ROOT)
            try:
                url = await wait_serving(process, log)
                # Recovery ran before "serving": its removals are in the log already.
                status.update((key, event) for event, key in snapshot_events(log))
                check_acknowledged(directory, status)
                response = await client.get(url + "/v1/stats")
                check_recovered(directory, response.json())
                if cycle == NUM_KILLS:
                    break
                ws_url = url.replace("http://", "ws://") + "/v1/stream"
                async with trio.open_nursery() as nursery:
                    for c in range(CONVERSATIONS):
                        nursery.start_soon(converse, ws_url,
                                           random.Random(rng.getrandbits(64)), f"c{c}")
                    await trio.sleep(rng.uniform(0.05, MAX_KILL_DELAY))
                    process.send_signal(signal.SIGKILL)  # with requests in flight
                    nursery.cancel_scope.cancel()
            finally:
                process.send_signal(signal.SIGKILL)
                await process.wait()
            torn_at_kill += any(is_temporary_name(p.name) for p in directory.iterdir())
            events = snapshot_events(log)
            counts.update(event for event, _ in events)
            status.update((key, event) for event, key in events)
            check_acknowledged(directory, status)
    required = check_acknowledged(directory, status)
    print(f"{NUM_KILLS} kills in {time.monotonic() - started:.1f}s: {counts['acknowledged']} "
          f"acknowledgements, {counts['removed']} removals, {required} snapshots required at "
          f"the end, {torn_at_kill} kills left a temporary file")
    assert counts["acknowledged"] >= NUM_KILLS, "too few snapshots written to prove anything"
    assert counts["removed"] > 0, "no snapshot was ever superseded: removal went untested"
