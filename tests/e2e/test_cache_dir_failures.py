"""A cache dir that fails under a running engine (issue 20 #6): the server never exits,
every request is answered (a miss instead of a hit), and the error is counted and logged
once.

Real errors only: `chmod 000` on the directory of a real `tqserve serve` subprocess that is
not root, or is root without the capabilities that let root ignore permissions (EACCES);
the directory replaced by a file (ENOTDIR) or removed, under an embedded engine; and a full
file system, a tmpfs of a few snapshots, where the machine lets the test mount one.
Prompts are token ids of the bundled draft model (float32).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import subprocess
import sys

import httpx
import pytest
import trio
from trio_websocket import open_websocket_url

from tqserve.actors.engine import open_engine
from tqserve.engine.config import Config
from tests.api.test_metrics import scrape
from tests.api.wsclient import Session
from tests.e2e.test_prefix_crash import REPO_ROOT, wait_serving
from tests.e2e.test_prefix_write_through import GUARD_S, cold, prompt, run
from tests.unit.test_storage_health import without_permission_capabilities

WARNING = "tqserve.storage.tier: cache dir"  # the tier's one line per failure (storage.health)


async def generate(ws_url: str, rid: str, tokens: tuple[int, ...]) -> dict:
    async with open_websocket_url(ws_url) as ws:
        session = Session(ws)
        await session.generate(rid, prompt_tokens=list(tokens), max_tokens=4, temperature=0)
        (result,) = await session.wait(rid)
    assert result.end["type"] == "done", result.end
    return {"tokens": result.token_ids, "cached": result.end["usage"]["cached_tokens"]}


async def test_chmod_000_on_the_cache_dir_of_a_running_server(draft_model, tmp_path):
    """The issue's case: two files written, a server restarted over them, `chmod 000`:
    the next SSD hit is a miss with the cold answer (it used to kill the server: exit 1
    from an uncaught PermissionError), the tier is cold (the read and the next write
    counted in /v1/stats and /metrics, one log line), the next request is served, and
    SIGTERM still exits 0."""
    directory = tmp_path / "cache"
    p, q, written = prompt(70, 60), prompt(71, 40), prompt(74, 50)
    async with open_engine(Config(cache_dir=str(directory)), loaded=draft_model) as engine:
        await run(engine, p)
        await run(engine, written)  # a second file: the old code died on its lstat
    want_p, want_q = await cold(draft_model, p), await cold(draft_model, q)
    log = tmp_path / "server.log"
    command = [sys.executable, "-u", "-m", "tqserve.api.cli", "serve", "--port", "0",
               "--dtype", "float32", "--cache-dir", str(directory), "--ram-cache-bytes", "1"]
    with open(log, "wb") as sink:
        try:
            process = await trio.lowlevel.open_process(
                command, stdout=sink, stderr=subprocess.STDOUT, cwd=REPO_ROOT,
                env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
                **without_permission_capabilities())
        except subprocess.SubprocessError as exc:
            pytest.skip(f"cannot drop root's permission capabilities here: {exc}")
    try:
        url = await wait_serving(process, log)
        ws_url = url.replace("http://", "ws://") + "/v1/stream"
        os.chmod(directory, 0)
        try:
            with trio.fail_after(GUARD_S):
                hit = await generate(ws_url, "hit", p)
                other = await generate(ws_url, "other", q)
                async with httpx.AsyncClient(timeout=30) as client:
                    stats = (await client.get(url + "/v1/stats")).json()["prefix_cache"]
                    metrics = await scrape(client, url)
        finally:
            os.chmod(directory, 0o700)
        assert process.poll() is None, log.read_text()[-3000:]
        process.send_signal(signal.SIGTERM)
        with trio.fail_after(GUARD_S):
            code = await process.wait()
    finally:
        with contextlib.suppress(ProcessLookupError):
            process.kill()
    text = log.read_text()
    assert code == 0, text[-3000:]
    assert (hit, other) == ({"tokens": want_p, "cached": 0}, {"tokens": want_q, "cached": 0})
    assert stats["ssd_state"] == "cold" and stats["ssd_entries"] == 0, stats
    assert stats["ssd_errors"] >= 2 and stats["ssd_write_errors"] >= 1, stats  # read, write
    assert metrics["tqserve:prefix_cache_ssd_errors_total"][()] == stats["ssd_errors"]
    assert metrics["tqserve:prefix_cache_ssd_state"][(("state", "cold"),)] == 1
    assert metrics["tqserve:prefix_cache_ssd_state"][(("state", "ok"),)] == 0
    lines = [line for line in text.splitlines() if WARNING in line]
    assert len(lines) == 1 and "Permission denied" in lines[0], lines
    assert "Traceback" not in text, text[-3000:]


@pytest.mark.parametrize("how", ["replaced_by_a_file", "removed"])
async def test_the_cache_dir_replaced_or_removed_under_an_embedded_engine(
        draft_model, tmp_path, caplog, how):
    """Restarted over written files, then the directory replaced by a file (ENOTDIR) or
    removed: the hit is a miss with the cold answer and the tier goes cold with one
    warning. A removed directory is made again, private, by the next write (ok again,
    that snapshot an SSD hit after a restart); a file in its place stays cold."""
    caplog.set_level(logging.INFO, logger="tqserve.storage.tier")
    directory = tmp_path / "cache"
    p, q = prompt(72, 60), prompt(73, 40)
    config = Config(cache_dir=str(directory), ram_cache_bytes=1, ssd_flush="sync")
    with trio.fail_after(GUARD_S):
        async with open_engine(config, loaded=draft_model) as engine:
            await run(engine, p)
        async with open_engine(config, loaded=draft_model) as engine:
            assert engine.statistics().prefix_cache.ssd_entries >= 1
            shutil.rmtree(directory)
            if how == "replaced_by_a_file":
                directory.write_bytes(b"")
            hit = await run(engine, p)
            other = await run(engine, q)
            stats = engine.statistics().prefix_cache
    assert hit[0] == await cold(draft_model, p) and hit[1].cached_tokens == 0
    assert other[0] == await cold(draft_model, q)
    warnings = [r for r in caplog.records if r.levelname == "WARNING" and "cache dir" in
                r.message]
    assert len(warnings) == 1 and "read failed" in warnings[0].message, \
        [r.message for r in warnings]
    if how == "replaced_by_a_file":  # the read, then the first write: ENOTDIR
        assert (stats.ssd_state, stats.ssd_entries, stats.ssd_errors) == ("cold", 0, 2)
        assert stats.ssd_write_errors >= 1, stats
        assert directory.read_bytes() == b""  # never touched
        return
    # the read, then the write that made the directory again (ENOENT): ok since
    assert (stats.ssd_state, stats.ssd_errors, stats.ssd_write_errors) == ("ok", 2, 0), stats
    assert stats.ssd_entries >= 2 and directory.stat().st_mode & 0o777 == 0o700
    with trio.fail_after(GUARD_S):
        async with open_engine(config, loaded=draft_model) as engine:
            again = await run(engine, q)
    assert again[1].cached_tokens_by_tier == {"ram": 0, "ssd": len(q) - 1}


@pytest.fixture
def tiny_filesystem(tmp_path):
    """A 512 KiB tmpfs (a few draft-model snapshots), where the machine lets us mount."""
    mount = tmp_path / "tiny"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k,mode=0700", "tmpfs",
                           str(mount)], capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {made.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


async def test_a_full_file_system_makes_the_tier_read_only(draft_model, tiny_filesystem,
                                                           caplog):
    """Writes until the tmpfs is full (ENOSPC, for real): the tier turns read-only with
    one warning, writes are abandoned and counted, requests keep their cold answers, and
    a snapshot written before is still an SSD hit."""
    caplog.set_level(logging.INFO, logger="tqserve.storage.tier")
    config = Config(cache_dir=str(tiny_filesystem / "cache"), ram_cache_bytes=1,
                    ssd_flush="sync")
    prompts = [prompt(80 + n, 100) for n in range(12)]
    with trio.fail_after(GUARD_S):
        async with open_engine(config, loaded=draft_model) as engine:
            answers = [await run(engine, p) for p in prompts]
            stats = engine.statistics().prefix_cache
            hit = await run(engine, prompts[0])
    assert stats.ssd_state == "read_only" and stats.ssd_write_errors >= 1, stats
    assert 1 <= stats.ssd_entries < len(prompts), stats
    for p, (tokens, done) in zip(prompts, answers):
        assert tokens == await cold(draft_model, p) and done.cached_tokens == 0
    assert hit[1].cached_tokens_by_tier == {"ram": 0, "ssd": len(prompts[0]) - 1}
    warnings = [r.message for r in caplog.records if r.levelname == "WARNING" and "cache dir"
                in r.message]
    assert len(warnings) == 1 and "No space left on device" in warnings[0], warnings
