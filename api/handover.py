"""The server's side of the acceptor process (api.acceptor): hypercorn's worker loop,
fed with connections that another process accepted.

`serve_handed_over` does what hypercorn's `worker_serve` does (the app's lifespan, one
GatedTCPServer per connection in a handler nursery, the graceful deadline at shutdown),
except that it never accepts: it starts `python -m tqserve.api.acceptor` with the
listening sockets, and takes each connection the acceptor hands over (its descriptor,
and the bytes the acceptor read from it) off the link. Every STATE_POLL_SECONDS it tells
the acceptor whether admission is full (api.overload's gate: an O(1) read), and it counts
and logs each refusal the acceptor answered, as the in-loop gate does.

If the acceptor dies (killed, crashed), the server logs a warning and accepts in-process
from then on, with the in-loop gate (the listening sockets are shared: nothing is
re-bound, connects in the backlog are kept; connections the acceptor held unanswered are
reset). When the server stops (or is cancelled), it closes the link: the acceptor exits,
and with it its copy of the listening sockets; then the server closes its own. If the server dies, the acceptor sees the link's EOF and
exits too (it ignores SIGINT and SIGTERM: the server decides when to stop).
"""

from __future__ import annotations

import array
import json
import logging
import socket
import subprocess
import sys
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.config import Sockets
from hypercorn.trio.lifespan import Lifespan
from hypercorn.trio.worker_context import WorkerContext
from hypercorn.typing import AppWrapper, ConnectionState, LifespanState
from hypercorn.utils import repr_socket_addr

from tqserve.api.acceptor import frame, take_frames
from tqserve.api.overload import GatedTCPServer, OverloadGate

log = logging.getLogger("tqserve.server")
STATE_POLL_SECONDS = 0.005  # how stale the acceptor's idea of "full" may be
FDS_PER_RECV = 16
EXIT_WAIT_SECONDS = 2.0  # then the acceptor is killed


class AcceptorLink:
    """The server's end of the link to one acceptor process."""

    def __init__(self, process: subprocess.Popen[bytes], link: trio.socket.SocketType) -> None:
        self.process = process
        self.link = link

    @classmethod
    def spawn(cls, listeners: list[socket.socket]) -> AcceptorLink:
        """Start the acceptor on these listening sockets (it shares them, dup'ed)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        fds = [theirs.fileno(), *(sock.fileno() for sock in listeners)]
        try:
            process = subprocess.Popen(
                [sys.executable, "-m", "tqserve.api.acceptor", *map(str, fds)],
                pass_fds=fds, stdin=subprocess.DEVNULL)
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        return cls(process, trio.socket.from_stdlib_socket(ours))

    async def send(self, kind: bytes, body: bytes = b"") -> None:
        await self.link.send(frame(kind, body))

    async def frames(self) -> AsyncIterator[tuple[bytes, bytes, int | None]]:
        """(kind, body, descriptor of a `C` frame) until the acceptor is gone. A link
        whose descriptors were cut short (MSG_CTRUNC) counts as gone: frames and
        descriptors could no longer be paired."""
        buf = bytearray()
        fds: deque[int] = deque()
        try:
            while True:
                try:
                    data, ancdata, flags, _ = await self.link.recvmsg(
                        65536, socket.CMSG_SPACE(FDS_PER_RECV * 4))
                except OSError:
                    return
                for level, ctype, cdata in ancdata:
                    if level == socket.SOL_SOCKET and ctype == socket.SCM_RIGHTS:
                        got = array.array("i")
                        got.frombytes(cdata[:len(cdata) - len(cdata) % got.itemsize])
                        fds.extend(got)
                if not data or flags & socket.MSG_CTRUNC:
                    return
                buf += data
                for kind, body in take_frames(buf):
                    yield kind, body, (fds.popleft() if kind == b"C" and fds else None)
        finally:
            for fd in fds:
                socket.close(fd)

    async def push_state(self, gate: OverloadGate, settings: dict[str, object]) -> None:
        """The settings, then admission's room and message every STATE_POLL_SECONDS (the
        acceptor counts its hand-overs down from each figure: a figure sent again resets
        what the server has taken in since)."""
        try:
            await self.send(b"K", json.dumps(settings).encode())
            while True:
                await self.send(b"S", json.dumps(gate.room()).encode("utf-8"))
                await trio.sleep(STATE_POLL_SECONDS)
        except OSError:
            return  # the acceptor is gone: `frames` ends and the server accepts itself

    async def close(self) -> None:
        """Close the link (the acceptor exits on its EOF) and reap the process."""
        self.link.close()
        try:
            await trio.to_thread.run_sync(self.process.wait, EXIT_WAIT_SECONDS)
        except subprocess.TimeoutExpired:
            self.process.kill()
            await trio.to_thread.run_sync(self.process.wait)


def stop_listening(sockets: Sockets) -> None:
    """Stop listening at once, in this process and the acceptor (they share the sockets):
    a connect from now on is refused, not queued behind a server that is going away."""
    for sock in sockets.insecure_sockets:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # closed already, or never listening


def binds_of(sockets: Sockets) -> list[str]:
    return [f"http://{repr_socket_addr(sock.family, sock.getsockname())}"
            for sock in sockets.insecure_sockets]


async def serve_handed_over(app: AppWrapper, hc: HypercornConfig, sockets: Sockets,
                            gate: OverloadGate, *,
                            shutdown_trigger: Callable[[], Awaitable[object]],
                            task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED
                            ) -> None:
    """hypercorn's worker_serve with the acceptor in front (module docstring). Plain HTTP
    sockets only (TLS and QUIC sockets go through worker_serve)."""
    lifespan_state: LifespanState = {}
    lifespan = Lifespan(app, hc, lifespan_state)
    context = WorkerContext(None)
    connection = partial(GatedTCPServer, app, hc, context, ConnectionState(lifespan_state.copy()))
    async with trio.open_nursery() as lifespan_nursery:
        await lifespan_nursery.start(lifespan.handle_lifespan)
        await lifespan.wait_for_startup()
        async with trio.open_nursery() as handlers:
            link = AcceptorLink.spawn(list(sockets.insecure_sockets))
            task_status.started(binds_of(sockets))
            try:
                async with trio.open_nursery() as nursery:
                    async def stop() -> None:
                        await shutdown_trigger()
                        nursery.cancel_scope.cancel()

                    nursery.start_soon(stop)
                    nursery.start_soon(link.push_state, gate, _settings(hc, gate))
                    try:
                        await _take_connections(link, gate, connection, handlers)
                    except BaseException:
                        stop_listening(sockets)  # cancelled: no connect is taken from now
                        raise
                    log.warning("the acceptor process exited (rc %s): accepting in-process",
                                link.process.poll())
                    listeners = [trio.SocketListener(trio.socket.from_stdlib_socket(sock))
                                 for sock in sockets.insecure_sockets]
                    await trio.serve_listeners(connection, listeners, handler_nursery=handlers)
            finally:
                stop_listening(sockets)
                with trio.CancelScope(shield=True):
                    await link.close()
                for sock in sockets.insecure_sockets:  # the port is free when serve returns
                    sock.close()
                await context.terminated.set()
                handlers.cancel_scope.deadline = trio.current_time() + hc.graceful_timeout
        await lifespan.wait_for_shutdown()
        lifespan_nursery.cancel_scope.cancel()


def _settings(hc: HypercornConfig, gate: OverloadGate) -> dict[str, object]:
    cap = getattr(hc, "connection_cap", None)
    return {"api_key": gate.api_key, "header_timeout": getattr(hc, "header_timeout", 10.0),
            "max_held": cap.limit if cap is not None else 1024}


async def _take_connections(link: AcceptorLink, gate: OverloadGate,
                            connection: Callable[[trio.SocketStream], GatedTCPServer],
                            handlers: trio.Nursery) -> None:
    """Serve each handed-over connection, count each refusal, until the link ends."""
    async for kind, body, fd in link.frames():
        if kind == b"C" and fd is not None:
            handlers.start_soon(_serve_one, connection, fd, body)
        elif kind == b"R":
            for path, ms in json.loads(body):
                gate.refused(str(path).encode("ascii"), float(ms))


async def _serve_one(connection: Callable[[trio.SocketStream], GatedTCPServer], fd: int,
                     preread: bytes) -> None:
    """One handed-over connection, served; its socket closed however that ends (a
    cancelled hypercorn connection skips its own close)."""
    sock = trio.socket.from_stdlib_socket(socket.socket(fileno=fd))
    try:
        server = connection(trio.SocketStream(sock))
        server._preread = preread
        await server.run()
    finally:
        sock.close()
