"""Clean shutdown of a real `tqserve serve` process on SIGTERM and SIGINT.

Every open stream gets a final `done` (finish_reason "shutdown" at the --shutdown-timeout,
or "length" when it finishes in time), then its socket closes with 1001; a request sent
after the signal is refused with `shutting_down`; the process exits 0 with exactly one
shutdown line on stderr and no traceback.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
import pytest
import trio
from trio_websocket import ConnectionClosed, HandshakeError, open_websocket_url

from tests.api.wsclient import LONG_PROMPT, MAX_FRAMES, STATS_POLL_SLEEP, STATS_POLLS, Session

REPO = Path(__file__).resolve().parents[2]
START_TIMEOUT = 120  # seconds for imports and the model load: a hang guard
EXIT_TIMEOUT = 60    # seconds for the whole shutdown: a hang guard
NUM_STREAMS = 3


class ServeProcess:
    """`python -m api.cli serve --port 0` with stderr in a file; `url` once it serves."""

    def __init__(self, *flags: str) -> None:
        self._stderr = tempfile.TemporaryFile(mode="w+")
        env = dict(os.environ, PYTHONPATH=str(REPO))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tqserve.api.cli", "serve", "--port", "0", *flags], cwd=REPO,
            env=env, stdout=subprocess.PIPE, stderr=self._stderr, text=True)
        self.url = ""

    async def started(self) -> None:
        with trio.fail_after(START_TIMEOUT):
            line = await trio.to_thread.run_sync(self.proc.stdout.readline)
        assert " on http://" in line, (line, self.stderr())
        self.url = line.split(" on ")[1].split()[0]

    @property
    def ws_url(self) -> str:
        return self.url.replace("http://", "ws://") + "/v1/stream"

    def stderr(self) -> str:
        self._stderr.seek(0)
        return self._stderr.read()

    async def exit_code(self) -> int:
        return await trio.to_thread.run_sync(lambda: self.proc.wait(EXIT_TIMEOUT))

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()
        self._stderr.close()


async def wait_health(url: str, status: int) -> None:
    """Poll /health (bounded) until it answers `status`."""
    async with httpx.AsyncClient() as client:
        for _ in range(STATS_POLLS):
            if (await client.get(url + "/health")).status_code == status:
                return
            await trio.sleep(STATS_POLL_SLEEP)
    raise AssertionError(f"/health never answered {status}")


async def read_until_closed(session: Session) -> int:
    """File every frame until the server closes the socket; return the close code."""
    for _ in range(MAX_FRAMES):
        try:
            session.file(*await session.recv())
        except ConnectionClosed as closed:
            return closed.reason.code
    raise AssertionError(f"the socket stayed open for {MAX_FRAMES} frames")


async def poll_stats_until_gone(url: str) -> None:
    """GET /v1/stats back to back until the server stops answering, so that a signal is
    likely to arrive while an HTTP handler runs (where a KeyboardInterrupt used to be
    swallowed by hypercorn)."""
    async with httpx.AsyncClient() as client:
        for _ in range(MAX_FRAMES):
            try:
                response = await client.get(url + "/v1/stats")
            except httpx.TransportError:
                return
            assert response.status_code == 200, response.text


async def shut_down_with_streams(sig: signal.Signals, timeout: float, max_tokens: int,
                                 *, repeat_signal: bool = False) -> tuple[Session, str]:
    """Open NUM_STREAMS streams, signal the server, check what every client sees."""
    server = ServeProcess("--shutdown-timeout", str(timeout))
    try:
        await server.started()
        async with open_websocket_url(server.ws_url) as ws, trio.open_nursery() as nursery:
            session = Session(ws)
            rids = [f"s{i}" for i in range(NUM_STREAMS)]
            for rid in rids:
                await session.generate(rid, prompt=LONG_PROMPT, max_tokens=max_tokens,
                                       temperature=0)
            for rid in rids:
                await session.first_token(rid)
            if timeout < 60:
                nursery.start_soon(poll_stats_until_gone, server.url)
                await trio.sleep(0)
            server.proc.send_signal(sig)
            if repeat_signal:
                server.proc.send_signal(sig)
            late = None
            if timeout >= 60:  # the streams are still running: this socket can still answer
                await wait_health(server.url, 503)  # the engine stopped admitting
                await session.generate("late", prompt="def f():", max_tokens=3)
                late, _ = await session.reply("late")
                with pytest.raises(HandshakeError):  # a new socket is refused too
                    async with open_websocket_url(server.ws_url):
                        pass
            code = await read_until_closed(session)
        assert await server.exit_code() == 0, server.stderr()
        stderr = server.stderr()
    finally:
        server.kill()
    assert code == 1001
    if late is not None:
        assert late["type"] == "error" and late["code"] == "shutting_down", late
    for rid in rids:
        result = session.results[rid]
        assert result.end is not None and result.end["type"] == "done", result.frames[-2:]
        assert result.end["usage"]["completion_tokens"] == len(result.tokens)
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr
    assert "error" not in stderr.lower(), stderr
    lines = [line for line in stderr.splitlines() if line.strip()]
    # one line for the shutdown, the last one (a BLAS line may precede it, at start)
    assert [line for line in lines if "shut down" in line] == lines[-1:], stderr
    assert lines[-1].startswith(f"tqserve: shut down on {sig.name}: "), stderr
    assert f"{NUM_STREAMS} requests in flight" in lines[-1]
    return session, lines[-1]


async def test_sigterm_lets_requests_finish_within_the_timeout():
    session, line = await shut_down_with_streams(signal.SIGTERM, timeout=120, max_tokens=200)
    assert {session.results[f"s{i}"].finish_reason for i in range(NUM_STREAMS)} == {"length"}
    assert all(len(session.results[f"s{i}"].tokens) == 200 for i in range(NUM_STREAMS))
    assert "0 ended at the --shutdown-timeout" in line


@pytest.mark.parametrize("attempt", range(3))
async def test_sigint_ends_requests_at_a_short_timeout(attempt):
    # 2000 tokens do not finish within 0.2 s; the first attempt sends the signal twice
    session, line = await shut_down_with_streams(signal.SIGINT, timeout=0.2, max_tokens=2000,
                                                 repeat_signal=attempt == 0)
    assert {session.results[f"s{i}"].finish_reason for i in range(NUM_STREAMS)} == {"shutdown"}
    assert f"{NUM_STREAMS} ended at the --shutdown-timeout" in line
