"""Tensor parallel end to end: `tqserve serve --distributed` over 2 ranks under mlx.launch.

Real processes: `mlx.launch -n 2 --backend ring` on loopback starts two CPU ranks of
pycoder-29m (float32); rank 0 serves the WebSocket API on port 0. Greedy tokens of the
group equal mlx-lm's single-process generate_step over the same cache kind (plain,
TurboQuant k4v4, affine 8-bit), up to proven near-ties (tests/e2e/reference.classify).
A prefix hit and a cancel run across the group; SIGTERM on rank 0 stops both ranks with
exit 0; SIGKILL on rank 1 ends the group within a bounded time with one line, under the
launcher (mid-request: an error frame, or a closed socket where rank 0's watchdog had to
end a collective that hung) and without it (while idle: rank 0's health check). The
plain group writes its snapshots through to a cache dir (one file per rank); a second
group restarted over it serves them from the SSD, and a snapshot with one rank's file
corrupted or deleted runs cold on both ranks. Four groups in all, short generations: the
CI machine has 2 cores.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx
import mlx.core as mx
import pytest
import trio
from mlx_lm.generate import generate_step
from trio_websocket import ConnectionClosed, open_websocket_url

from tests.api import wsclient
from tests.api.wsclient import Session, stats, wait_stats
from tests.conftest import BIG_MODEL
from tests.e2e.reference import PROMPTS, classify
from tqserve.engine.kv.factory import cache_factory_for
from tqserve.storage import decode_header

REPO = Path(__file__).resolve().parents[2]
LAUNCH = shutil.which("mlx.launch", path=str(Path(sys.executable).parent)) or shutil.which(
    "mlx.launch")
START_TIMEOUT = 240  # seconds: two ranks import and load pycoder-29m on a loaded 2-core box
EXIT_TIMEOUT = 120   # seconds for the group to end after a signal: a hang guard
# --distributed-timeout of the group whose rank dies, well under EXIT_TIMEOUT. Not lower: a
# step where one rank compiles (mx.compile calls g++ on the CPU backend) keeps its peer in a
# collective that long, and a loaded 2-core machine once made that exceed 10 s (the watchdog
# ended a healthy group mid-batch).
TIMEOUT = 30
# The same for the group that finds its dead rank while idle: short, so the test ends soon
# after the kill (a ping every IDLE_TIMEOUT / 4), yet long enough for a healthy step on a
# loaded machine (4 s once ended a healthy group mid-batch, during a full suite run beside
# other work: the client saw the socket close with 1006).
IDLE_TIMEOUT = 15
MAX_TOKENS = 12
GREEDY = dict(temperature=0.0, max_tokens=MAX_TOKENS)
IDLE = dict(rows_active=0, rows_queued=0, kv_bytes=0, streams_open=0)
# A prompt long enough that its KV is worth snapshotting, and a continuation of it.
SHARED = PROMPTS[6] + "    e = np.exp(x - np.max(x))\n"
LONGER = SHARED + "    return e / e.sum()\n\n\ndef relu(x):\n"

pytestmark = [
    pytest.mark.skipif(LAUNCH is None, reason="mlx.launch not found next to the interpreter "
                                              "or on PATH"),
    pytest.mark.skipif(not (BIG_MODEL / "config.json").is_file(),
                       reason=f"pycoder-29m not found at {BIG_MODEL}"),
]


SERVE = [sys.executable, "-m", "tqserve.api.cli", "serve", "--distributed", "--model",
         str(BIG_MODEL), "--dtype", "float32", "--port", "0"]


class Group:
    """`mlx.launch -n 2 --backend ring -- python -m tqserve.api.cli serve --distributed`."""

    def __init__(self, *flags: str) -> None:
        self._stderr = tempfile.TemporaryFile(mode="w+")
        env = dict(os.environ, PYTHONPATH=str(REPO))
        self.proc = subprocess.Popen(
            [str(LAUNCH), "-n", "2", "--backend", "ring", "--", *SERVE, *flags],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=self._stderr, text=True,
            start_new_session=True)
        self.url = ""

    async def started(self) -> None:
        with trio.fail_after(START_TIMEOUT):
            line = await trio.to_thread.run_sync(self.proc.stdout.readline)
        assert " on http://" in line, (line, self.stderr())
        self.url = line.split(" on ")[1].split()[0]

    @property
    def ws_url(self) -> str:
        return self.url.replace("http://", "ws://") + "/v1/stream"

    def ranks(self) -> dict[int, int]:
        """rank -> pid of the launcher's children."""
        out = {}
        for child in Path(f"/proc/{self.proc.pid}/task").glob("*/children"):
            for pid in map(int, child.read_text().split()):
                env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                for entry in env:
                    if entry.startswith(b"MLX_RANK="):
                        out[int(entry[9:])] = pid
        return out

    def stderr(self) -> str:
        self._stderr.seek(0)
        return self._stderr.read()

    async def exit_code(self) -> int:
        return await trio.to_thread.run_sync(lambda: self.proc.wait(EXIT_TIMEOUT))

    def kill(self) -> None:
        """End the group; its stderr tail goes to the test's captured output (shown by
        pytest only when the test failed: the launcher's and the ranks' own words)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        print("group stderr tail:", self.stderr()[-3000:])


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


def reference(loaded: Any, prompt: str, make_cache: Any = None) -> tuple[list[int], list[float]]:
    """Greedy tokens of one process (mlx-lm's generate_step) and the top-2 gaps."""
    ids = loaded.tokenizer.encode(prompt)
    cache = make_cache(loaded.model) if make_cache is not None else None
    tokens, gaps = [], []
    for token, lp in generate_step(mx.array(ids), loaded.model, max_tokens=MAX_TOKENS,
                                   prompt_cache=cache):
        top2 = mx.sort(lp)[-2:].tolist()
        tokens.append(int(token))
        gaps.append(top2[1] - top2[0])
    return tokens, gaps


async def greedy_batch(ws_url: str, prompts: dict[str, str]) -> dict[str, Any]:
    """Every prompt at once on one socket (they batch on the group); results by id."""
    async with open_websocket_url(ws_url) as ws:
        session = Session(ws)
        for rid, prompt in prompts.items():
            await session.generate(rid, prompt=prompt, **GREEDY)
        results = await session.wait(*prompts)
    return dict(zip(prompts, results))


def check_identity(results: dict[str, Any], prompts: dict[str, str],
                   want: dict[str, tuple[list[int], list[float]]]) -> int:
    """Every result equals its reference (or a proven near-tie); returns the near-ties."""
    near = 0
    for rid, result in results.items():
        assert result.end["type"] == "done", result.end
        assert result.finish_reason == "length"
        tokens, gaps = want[prompts[rid]]
        near += classify(result.token_ids, tokens, gaps) == "near_tie"
    return near


async def test_two_ranks_plain_prefix_cancel_stop_and_restart_from_the_ssd(
        tmp_path: Path, big_model: Any) -> None:
    prompts = {f"p{i}": p for i, p in enumerate(PROMPTS[:4])} | {"shared": SHARED}
    want = {p: reference(big_model, p) for p in [*prompts.values(), LONGER]}
    cache = tmp_path / "cache"
    group = Group("--max-batch", "8", "--cache-dir", str(cache))
    try:
        await group.started()
        ranks = group.ranks()
        assert sorted(ranks) == [0, 1], ranks
        near = check_identity(await greedy_batch(group.ws_url, prompts), prompts, want)
        assert near <= 1, f"{near} near-ties in one batch"

        async with httpx.AsyncClient(timeout=30) as client, \
                open_websocket_url(group.ws_url) as ws:
            session = Session(ws)
            # prefix hit: SHARED's KV (published on every rank) serves LONGER's prefix
            await session.generate("hit", prompt=LONGER, **GREEDY)
            (hit,) = await session.wait("hit")
            usage = hit.end["usage"]
            assert usage["cached_tokens"] > 0 and usage["cached_tokens_by_tier"]["ram"] > 0, usage
            assert classify(hit.token_ids, *want[LONGER]) in ("same", "near_tie")
            # cancel mid-generation, then the group still agrees on a fresh request
            await session.generate("long", prompt=PROMPTS[4], temperature=0.0, max_tokens=2000)
            await session.first_token("long")
            await session.send({"type": "cancel", "id": "long"})
            (cancelled,) = await session.wait("long")
            assert cancelled.finish_reason == "cancelled", cancelled.end
            assert 0 < len(cancelled.tokens) < 2000
            await session.generate("after", prompt=PROMPTS[1], **GREEDY)
            (after,) = await session.wait("after")
            assert classify(after.token_ids, *want[PROMPTS[1]]) in ("same", "near_tie")
            await wait_stats(client, group.url, **IDLE)

        os.kill(ranks[0], signal.SIGTERM)  # a clean stop: rank 0 broadcasts STOP
        assert await group.exit_code() == 0, group.stderr()
        err = group.stderr()
        assert "shut down on SIGTERM" in err, err
        assert "Node with rank" not in err and "Traceback" not in err, err
        assert not alive(ranks[0]) and not alive(ranks[1])
    finally:
        group.kill()
    await restart_from_the_ssd(cache, big_model, want, acknowledged(err))


def shard_files(cache: Path) -> dict[int, dict[str, Path]]:
    """rank -> {key: file} of each rank's shard directory (storage.shard)."""
    return {rank: {p.name.removesuffix(".tqsnap"): p
                   for p in (cache / f"tp2-rank{rank}").glob("*.tqsnap")} for rank in (0, 1)}


def acknowledged(log: str, state: dict[str, bool] | None = None) -> dict[str, bool]:
    """key -> whether rank 0's log left it acknowledged (true) or removed after (false)."""
    state = dict(state or {})
    for line in log.splitlines():
        words = line.split()
        if words[:2] == ["tqserve.prefix:", "snapshot"] and len(words) >= 4:
            if words[2] in ("acknowledged", "removed"):
                state[words[3].rstrip(":")] = words[2] == "acknowledged"
    return state


def assert_on_every_rank(cache: Path, acked: dict[str, bool]) -> dict[int, dict[str, Path]]:
    """Both ranks hold the same files: exactly the acknowledged keys, each saying whose."""
    files = shard_files(cache)
    assert set(files[0]) == set(files[1]) == {k for k, ok in acked.items() if ok}, files
    for rank, paths in files.items():
        for path in paths.values():
            extra = decode_header(path.read_bytes()).extra
            assert (extra["tp_size"], extra["tp_rank"]) == (2, rank), path
    return files


def file_of(files: dict[str, Path], tokenizer: Any, prompt: str) -> str:
    """The one key whose snapshot covers `prompt` (its own finish snapshot)."""
    ids = tuple(tokenizer.encode(prompt))[:-1]
    keys = [k for k, path in files.items()
            if decode_header(path.read_bytes()).token_ids[:len(ids)] == ids]
    assert len(keys) == 1, (prompt, keys)
    return keys[0]


async def restart_from_the_ssd(cache: Path, big_model: Any, want: dict[str, Any],
                               acked: dict[str, bool]) -> None:
    """A new group over the first group's cache dir (sync flush this time): an SSD hit
    with the single process's tokens; one snapshot whose rank-1 file has a corrupted
    plane (found at load) and one whose rank-0 file was deleted (found at recovery) run
    cold on both ranks with the same tokens; the bad file quarantined on rank 1, the
    orphan removed, the group still up, /v1/stats reporting the SSD tier."""
    files = assert_on_every_rank(cache, acked)
    bad = file_of(files[0], big_model.tokenizer, PROMPTS[2])
    gone = file_of(files[0], big_model.tokenizer, PROMPTS[3])
    data = bytearray(files[1][bad].read_bytes())
    data[-1] ^= 0xFF  # the last plane's bytes: its header still checks out at recovery
    files[1][bad].write_bytes(bytes(data))
    files[0][gone].unlink()
    group = Group("--max-batch", "8", "--cache-dir", str(cache), "--ssd-flush", "sync")
    try:
        await group.started()
        async with httpx.AsyncClient(timeout=30) as client:
            start = (await stats(client, group.url))["prefix_cache"]
            assert start["ssd_entries"] == len(files[0]) - 1, start  # not `gone`
            for _ in range(50):  # rank 1 removes its orphan on its disk thread (bounded)
                if gone not in shard_files(cache)[1]:
                    break
                await trio.sleep(0.2)
            assert gone not in shard_files(cache)[1]

            prompts = {"ssd": LONGER, "bad": PROMPTS[2], "gone": PROMPTS[3]}
            results = await greedy_batch(group.ws_url, prompts)
            check_identity(results, prompts, want)
            usage = {rid: r.end["usage"] for rid, r in results.items()}
            assert usage["ssd"]["cached_tokens_by_tier"]["ssd"] > 0, usage
            assert usage["bad"]["cached_tokens"] == usage["gone"]["cached_tokens"] == 0, usage
            assert (cache / "tp2-rank1" / "quarantine" / f"{bad}.tqsnap").is_file()
            again = await greedy_batch(group.ws_url, {"again": PROMPTS[2]})  # still up, same KV
            check_identity(again, {"again": PROMPTS[2]}, want)
            assert again["again"].end["usage"]["cached_tokens_by_tier"]["ram"] > 0
            end = (await wait_stats(client, group.url, **IDLE))["prefix_cache"]
            assert end["hits_ssd"] >= 1 and end["quarantined"] == 1, end
            assert end["ssd_write_errors"] == 0 and end["ssd_entries"] > 0, end
            assert end["ssd_bytes"] > 0 and end["spills"] > 0, end
        os.kill(group.ranks()[0], signal.SIGTERM)
        assert await group.exit_code() == 0, group.stderr()
        err = group.stderr()
        assert "Node with rank" not in err and "Traceback" not in err, err
        assert f"snapshot {bad} failed on rank 1 (quarantined): checksum mismatch" in err, err
    finally:
        group.kill()
    assert_on_every_rank(cache, acknowledged(err, acked | {gone: False}))


async def test_two_ranks_turboquant_then_a_rank_dies(big_model: Any, monkeypatch: Any) -> None:
    # a collective that hangs on the dead peer ends at rank 0's watchdog (TIMEOUT): the
    # frames may take that long
    monkeypatch.setattr(wsclient, "FRAME_TIMEOUT", TIMEOUT + 30)
    make_cache = cache_factory_for(big_model.model, "k4v4")
    prompts = {f"q{i}": p for i, p in enumerate(PROMPTS[:4])}
    want = {p: reference(big_model, p, make_cache) for p in prompts.values()}
    group = Group("--kv", "turboquant:k4v4", "--max-batch", "8", "--distributed-timeout",
                  str(TIMEOUT))
    try:
        await group.started()
        ranks = group.ranks()
        near = check_identity(await greedy_batch(group.ws_url, prompts), prompts, want)
        assert near <= 1, f"{near} near-ties in one batch"

        async with open_websocket_url(group.ws_url) as ws:
            session = Session(ws)
            await session.generate("doomed", prompt=PROMPTS[5], temperature=0.0,
                                   max_tokens=2000)
            await session.first_token("doomed")
            os.kill(ranks[1], signal.SIGKILL)
            end = None
            try:
                (doomed,) = await session.wait("doomed")
                end = doomed.end
                await session.recv()  # the server then closes the socket
                raise AssertionError("a frame after the end")
            except ConnectionClosed:
                pass  # (no answer at all: rank 0's watchdog ended a collective that hung)
        assert end is None or (end["type"] == "error" and end["code"] == "internal_error"
                               and "tensor-parallel group failed" in end["message"]), end
        code = await group.exit_code()  # bounded: no hang
        err = group.stderr()
        assert "Node with rank 1 exited with code -9" in err, err
        assert "tqserve: error: tensor-parallel group failed: rank 0" in err, err
        assert not alive(ranks[0]) and not alive(ranks[1]), err
        assert "Traceback" not in err, err
        print(f"\nrank 1 killed: the request ended with {end}; launcher exit {code}; "
              f"stderr tail: {err[-300:]!r}")
    finally:
        group.kill()


def free_ports(count: int) -> list[int]:
    socks = [socket.socket() for _ in range(count)]
    for sock in socks:
        sock.bind(("127.0.0.1", 0))
    ports = [sock.getsockname()[1] for sock in socks]
    for sock in socks:
        sock.close()
    return ports


async def test_without_a_launcher_affine_then_a_rank_dies_while_idle(
        tmp_path: Path, big_model: Any) -> None:
    """Ranks started as mlx.launch would (MLX_RANK, MLX_HOSTFILE) with an affine 8-bit KV
    cache: greedy tokens equal one process over the same cache kind. Then, with no launcher
    to end the group, rank 0's own health check (a ping every --distributed-timeout / 4
    while idle) finds the killed rank and exits 1 with one line."""
    make_cache = cache_factory_for(big_model.model, None, kv_quant=8)
    prompts = {f"a{i}": p for i, p in enumerate(PROMPTS[7:9])}
    want = {p: reference(big_model, p, make_cache) for p in prompts.values()}
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in free_ports(2)]))
    procs = []
    err = tmp_path / "rank0.err"
    for rank in (0, 1):
        env = dict(os.environ, PYTHONPATH=str(REPO), MLX_RANK=str(rank),
                   MLX_HOSTFILE=str(hostfile))
        procs.append(subprocess.Popen(
            [*SERVE, "--kv", "affine:8", "--distributed-timeout", str(IDLE_TIMEOUT)],
            cwd=REPO, env=env,
            text=True,
            stdout=subprocess.PIPE, stderr=err.open("w") if rank == 0 else subprocess.DEVNULL))
    try:
        with trio.fail_after(START_TIMEOUT):
            line = await trio.to_thread.run_sync(procs[0].stdout.readline)
        assert " on http://" in line, (line, err.read_text())
        url = line.split(" on ")[1].split()[0].replace("http://", "ws://") + "/v1/stream"
        check_identity(await greedy_batch(url, prompts), prompts, want)
        procs[1].kill()
        code = await trio.to_thread.run_sync(lambda: procs[0].wait(EXIT_TIMEOUT))
        text = err.read_text()
        assert code == 1, text
        assert "tqserve: error: tensor-parallel group failed: rank 0" in text, text
        assert "Traceback" not in text, text
        print("\nrank 0 after rank 1 was killed while idle:", text.strip().splitlines()[-1])
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
