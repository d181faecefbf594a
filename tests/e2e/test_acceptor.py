"""The acceptor process (api.acceptor, api.handover) in front of a real `tqserve serve`.

While admission is full, the acceptor answers generation requests with 429 itself: even
with the server's process stopped (SIGSTOP), so nothing on the server's event loop is in
the way; the refusals are counted in the server's /v1/stats once it runs again. When the
acceptor dies, the server accepts in-process; when the server dies, the acceptor exits and
the port is free again. Subprocess servers on loopback, raw sockets, the bundled model.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from pathlib import Path

import trio

from tqserve.tools.attack_phases import Server, stats

FULL = ["--max-batch", "1", "--max-queued-requests", "1"]
# a stream that holds its row: 4000 tokens, EOS (id 0) biased away, since a sampled stream
# could otherwise end early and free the row the test waits to see held (CI saw _fill time
# out once)
LONG = b'{"prompt": "import os\\n", "max_tokens": 4000, "stream": true, "logit_bias": {"0": -100}}'
SHORT = b'{"prompt": "import os\\n", "max_tokens": 2}'
WAIT_S = 30.0


def _post(body: bytes) -> bytes:
    return (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
            b"application/json\r\nConnection: close\r\nContent-Length: "
            + str(len(body)).encode() + b"\r\n\r\n" + body)


def _acceptor_of(pid: int) -> int:
    """The pid of the server's acceptor child."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid and b"tqserve.api.acceptor" in cmdline:
            return int(entry.name)
    raise AssertionError(f"no acceptor process under {pid}")


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state == "Z"


async def _status(port: int, body: bytes) -> tuple[int, bytes]:
    """One request on its own connection: the status and the whole answer."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(_post(body))
        got = b""
        while chunk := await stream.receive_some(65536):
            got += chunk
    return int(got.split(b" ", 2)[1]), got


async def _fill(port: int) -> list[trio.SocketStream]:
    """Two long streams: one holds the only row, then one the only queue slot.

    The acceptor refuses a generation request when the server's last figure says the queue
    is full, and that figure is up to a poll old (STATE_POLL_SECONDS, longer while the
    server's loop is busy): one taken just while the first stream sat in the queue, before
    its row started, refuses the second stream although /v1/stats already shows the queue
    empty (CI saw it). A refused stream, counted in /v1/stats, is sent again."""
    held = []
    for queued in (0, 1):
        with trio.fail_after(WAIT_S):
            while True:
                refused = await _rejected(port)
                stream = await trio.open_tcp_stream("127.0.0.1", port)
                await stream.send_all(_post(LONG))
                while (s := await stats(port)).get("rows_active") != 1 or (
                        s.get("rows_queued") != queued):
                    if s["rejections"].get("overloaded", 0) > refused:
                        break
                    await trio.sleep(0.05)
                else:
                    held.append(stream)
                    break
                await stream.aclose()
    return held


async def _rejected(port: int) -> int:
    return (await stats(port))["rejections"].get("overloaded", 0)


async def test_refusals_come_from_the_acceptor_while_the_server_is_stopped():
    server = Server(FULL)
    try:
        acceptor = _acceptor_of(server.proc.pid)
        held = await _fill(server.port)
        # the acceptor hears "full" within a poll (5 ms) of the server's loop; the
        # stats round trip after the sleep shows that loop ran past it
        await trio.sleep(0.1)
        before = await _rejected(server.port)
        os.kill(server.proc.pid, signal.SIGSTOP)
        try:
            answers: list[tuple[int, bytes]] = []

            async def one() -> None:
                answers.append(await _status(server.port, SHORT))

            with trio.fail_after(10):
                async with trio.open_nursery() as burst:
                    for _ in range(20):
                        burst.start_soon(one)
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
        assert [status for status, _ in answers] == [429] * 20
        assert all(b"retry-after: 1" in got and b'"code": "overloaded"' in got
                   for _, got in answers)
        with trio.fail_after(WAIT_S):  # counted by the server once it runs again
            while await _rejected(server.port) < before + 20:
                await trio.sleep(0.05)
        assert (await _status(server.port, b""))[0] == 429  # an empty body, still refused
        # the acceptor dies: the server accepts itself, the in-loop gate refuses
        os.kill(acceptor, signal.SIGKILL)
        with trio.fail_after(WAIT_S):
            while not _gone(acceptor):
                await trio.sleep(0.05)
        with trio.fail_after(WAIT_S):
            assert (await _status(server.port, SHORT))[0] == 429
        for stream in held:
            await stream.aclose()
        with trio.fail_after(WAIT_S):
            while (await stats(server.port)).get("rows_active") != 0:
                await trio.sleep(0.05)
            status, got = await _status(server.port, SHORT)
        assert status == 200 and json.loads(got.split(b"\r\n\r\n", 1)[1])["choices"]
        assert server.alive()
    finally:
        server.stop()


def test_a_killed_server_takes_its_acceptor_and_the_port_with_it():
    server = Server([])
    acceptor = _acceptor_of(server.proc.pid)
    server.proc.kill()
    server.proc.wait(WAIT_S)
    deadline = time.monotonic() + WAIT_S
    while not _gone(acceptor):
        assert time.monotonic() < deadline, "the acceptor outlived its server"
        time.sleep(0.05)
    with socket.socket() as sock:  # nothing listens there any more
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", server.port))
        sock.listen()
