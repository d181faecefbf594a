"""The acceptor: a small process that owns the server's listening socket.

Under a burst of connects while the admission queue is full, the server's event loop is
busy streaming the admitted rows' tokens and running the actors; refusals answered on
that loop wait behind each other (issue 20: p50 324 ms at 1,000 connects on 2 cores, with
the in-loop gate of api.overload). This process accepts every connection instead and
reads its head (bounded by MAX_HEAD_BYTES, HOLD_SECONDS and max_held connections: a head
not whole in time is handed over with what came, and past max_held a connection is
handed over unread; the server's own header timeout then applies, from the hand-over). The server tells
it how many requests admission's queue takes now (`room`, an O(1) read, sent on each
change; STATE_POLL_SECONDS in api.handover); then:

* a head the gate may refuse (api.gate_head: a generation route with the right key, no
  Origin) is handed over while `room` lasts (each hand-over counts it down until the
  server's next figure) and answered with the canned 429 once it is used up; the server
  hears of each refusal (it counts and logs it) before the client has its answer;
* every other connection (`/health`, a WebSocket upgrade, another route, a head too
  long) is handed over at once with the bytes read so far: its descriptor goes to the
  server over a Unix socket (SCM_RIGHTS), and the server serves it as if it had accepted
  it (api.handover). While the server is shutting down (`room` -1) everything is.

It imports only the standard library and api.gate_head, runs one selector loop, ignores
SIGINT and SIGTERM (the server decides when to stop), and exits when the server closes
its end of the link or dies: its copy of the listening socket then closes with it.

The link carries frames of a 1-byte kind, a 4-byte big-endian length and a body. Server
to acceptor: `K` (the settings, JSON, first), `S` (JSON [room, the refusal's message]). Acceptor to server: `C` (a connection: its descriptor as SCM_RIGHTS, the
bytes read from it as the body), `R` (refusals since the last one: a JSON list of
[path, milliseconds from accept to answer]). The acceptor never blocks on the link: what
it cannot send now waits in its outbox (Outbox).
"""

from __future__ import annotations

import errno
import json
import os
import selectors
import signal
import socket
import struct
import sys
import time
from collections import deque

from tqserve.api.gate_head import (MAX_HEAD_BYTES, body_complete, head_complete,
                                   refusable_path, refusal_bytes)

FRAME = struct.Struct("!cI")
ACCEPTS_PER_WAKE = 256
DRAIN_SECONDS = 1.0  # an unread body is drained this long after the 429, then closed
DRAIN_BYTES = 1 << 20
HOLD_SECONDS = 1.0  # a head not whole by then is handed over with what came (slow clients)
PRIORITY_BOOST = 10  # niceness below the server's, where permitted (raise_priority)


def frame(kind: bytes, body: bytes = b"") -> bytes:
    """One frame of the link: kind, length, body."""
    return FRAME.pack(kind, len(body)) + body


def take_frames(buf: bytearray) -> list[tuple[bytes, bytes]]:
    """The whole frames at the start of `buf`, as (kind, body), taken out of it."""
    frames = []
    while len(buf) >= FRAME.size:
        kind, length = FRAME.unpack_from(buf)
        if len(buf) < FRAME.size + length:
            break
        frames.append((kind, bytes(buf[FRAME.size:FRAME.size + length])))
        del buf[:FRAME.size + length]
    return frames


class Outbox:
    """Frames for the server, sent without ever blocking the acceptor's loop: what the
    link does not take now waits here (with the connection whose descriptor it carries,
    closed once sent) until the link is writable again. Refusal reports wait as one list,
    sent as one `R` frame: a server too busy to read its link slows nothing here."""

    def __init__(self, link: socket.socket) -> None:
        self.link = link
        self.frames: deque[tuple[bytearray, socket.socket | None]] = deque()
        self.refusals: list[tuple[str, float]] = []

    def hand_over(self, sock: socket.socket, data: bytes) -> None:
        self.frames.append((bytearray(frame(b"C", data)), sock))

    def refused(self, path: str, ms: float) -> None:
        self.refusals.append((path, round(ms, 2)))

    @property
    def pending(self) -> bool:
        return bool(self.frames or self.refusals)

    def flush(self) -> None:
        """Send what the link takes now; OSError other than EAGAIN: the server is gone."""
        if self.refusals:
            self.frames.append((bytearray(frame(b"R", json.dumps(self.refusals).encode())),
                                None))
            self.refusals = []
        while self.frames:
            data, sock = self.frames[0]
            try:
                if sock is not None:  # the descriptor rides on the frame's first byte
                    sent = socket.send_fds(self.link, [bytes(data)], [sock.fileno()])
                    sock.close()
                    self.frames[0] = (data, None)
                else:
                    sent = self.link.send(data)
            except (BlockingIOError, InterruptedError):
                return
            del data[:sent]
            if not data:
                self.frames.popleft()

    def close(self) -> None:
        for _, sock in self.frames:
            if sock is not None:
                sock.close()
        self.frames.clear()


class _Held:
    """A connection whose head is being read: its bytes so far, then (refused) its drain."""

    __slots__ = ("sock", "data", "opened", "deadline", "draining", "drained")

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self.sock = sock
        self.data = b""
        self.opened = time.perf_counter()
        self.deadline = deadline
        self.draining = False
        self.drained = 0


class Acceptor:
    def __init__(self, listeners: list[socket.socket], link: socket.socket) -> None:
        self.listeners = listeners
        self.link = link
        # generation requests admission takes now (-1: no gate, hand everything over),
        # counted down per hand-over until the server's next `S`; the refusal's message
        self.room = 1
        self.message = ""
        self.api_key: str | None = None
        self.header_timeout = 10.0
        self.max_held = 1024
        self.held: dict[int, _Held] = {}
        self.selector = selectors.DefaultSelector()
        self._link_buf = bytearray()
        self.outbox = Outbox(link)
        self._watching_write = False

    def configure(self, settings: dict) -> None:
        self.api_key = settings.get("api_key")
        self.header_timeout = float(settings.get("header_timeout", self.header_timeout))
        self.max_held = int(settings.get("max_held", self.max_held))

    def run(self) -> None:
        for sock in self.listeners:
            sock.setblocking(False)
            self.selector.register(sock, selectors.EVENT_READ, "listen")
        self.link.setblocking(False)
        self.selector.register(self.link, selectors.EVENT_READ, "link")
        try:
            while True:
                timeout = self._next_deadline()
                for key, events in self.selector.select(timeout):
                    if key.data == "link":
                        if events & selectors.EVENT_READ and not self._read_link():
                            return
                    elif key.data == "listen":
                        self._accept(key.fileobj)  # type: ignore[arg-type]
                    else:
                        self._read_held(key.data)
                self._expire()
                if not self._flush():
                    return
        finally:
            self.outbox.close()

    def _flush(self) -> bool:
        """Send what the outbox holds; watch the link for writability while some waits.
        False once the server is gone."""
        try:
            self.outbox.flush()
        except OSError:
            return False
        if self.outbox.pending != self._watching_write:
            self._watching_write = self.outbox.pending
            events = selectors.EVENT_READ | (selectors.EVENT_WRITE if self._watching_write else 0)
            self.selector.modify(self.link, events, "link")
        return True

    def _next_deadline(self) -> float | None:
        if not self.held:
            return None
        return max(0.0, min(h.deadline for h in self.held.values()) - time.monotonic())

    def _read_link(self) -> bool:
        """Settings and state from the server; False once the server is gone."""
        try:
            chunk = self.link.recv(65536)
        except (BlockingIOError, InterruptedError):
            return True
        except OSError:
            return False
        if not chunk:
            return False
        self._link_buf += chunk
        for kind, body in take_frames(self._link_buf):
            if kind == b"K":
                self.configure(json.loads(body))
            elif kind == b"S":
                self.room, self.message = json.loads(body)
        return True

    def _accept(self, listener: socket.socket) -> None:
        for _ in range(ACCEPTS_PER_WAKE):
            try:
                sock, _ = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno == errno.EINVAL:  # the server stopped listening: so do we
                    self.selector.unregister(listener)
                return  # EMFILE and the like: leave it in the backlog for now
            if self.room < 0 or len(self.held) >= self.max_held:
                self._hand_over(sock, b"")  # (the server's own limits apply to it)
            else:
                sock.setblocking(False)
                held = _Held(sock, time.monotonic() + min(self.header_timeout, HOLD_SECONDS))
                self.held[sock.fileno()] = held
                self.selector.register(sock, selectors.EVENT_READ, held)

    def _hand_over(self, sock: socket.socket, data: bytes) -> None:
        self.outbox.hand_over(sock, data)  # (sent, and closed here, at the loop's flush)

    def _read_held(self, held: _Held) -> None:
        try:
            chunk = held.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            chunk = b""
        if held.draining:
            held.drained += len(chunk)
            if not chunk or held.drained >= DRAIN_BYTES:
                self._drop(held)
            return
        if not chunk:
            self._drop(held)
            return
        held.data += chunk
        if head_complete(held.data):
            self._decide(held)

    def _decide(self, held: _Held) -> None:
        path = refusable_path(held.data, self.api_key) if self.room >= 0 else None
        if path is not None and self.room > 0:
            self.room -= 1  # admission may take it: the server decides
            path = None
        if path is None or len(held.data) > MAX_HEAD_BYTES + 65536:
            self._release(held)
            self._hand_over(held.sock, held.data)
            return
        # the server hears of the refusal before the client does: a client that reads
        # /v1/stats after its 429 finds the refusal counted
        self.outbox.refused(path.decode("ascii"), (time.perf_counter() - held.opened) * 1000)
        self._flush()
        try:
            held.sock.send(refusal_bytes(path, self.message))
        except OSError:
            self._drop(held)
            return
        if body_complete(held.data):
            self._drop(held)
            return
        try:  # closing with unread bytes would reset the connection under the answer
            held.sock.shutdown(socket.SHUT_WR)
        except OSError:
            self._drop(held)
            return
        held.draining = True
        held.deadline = time.monotonic() + DRAIN_SECONDS

    def _expire(self) -> None:
        now = time.monotonic()
        for held in [h for h in self.held.values() if h.deadline <= now]:
            if held.draining:
                self._drop(held)  # a refused connection's drain is over: close
            else:  # no whole head in HOLD_SECONDS: the server's own timeouts take over
                self._release(held)
                self._hand_over(held.sock, held.data)

    def _release(self, held: _Held) -> None:
        self.selector.unregister(held.sock)
        self.held.pop(held.sock.fileno(), None)

    def _drop(self, held: _Held) -> None:
        self._release(held)
        held.sock.close()


def raise_priority() -> int:
    """Run ahead of the server's compute threads where the process may (root,
    CAP_SYS_NICE, or RLIMIT_NICE: systemd's LimitNICE=): on a machine whose cores the
    decode keeps busy, the refusals wait for a core otherwise (docs/reliability.md).
    Returns the niceness the acceptor runs at."""
    now = os.getpriority(os.PRIO_PROCESS, 0)
    try:
        os.setpriority(os.PRIO_PROCESS, 0, now - PRIORITY_BOOST)
    except OSError:
        return now  # not permitted: the same priority as the server
    return now - PRIORITY_BOOST


def main(argv: list[str]) -> int:
    """`python -m tqserve.api.acceptor LINK_FD LISTEN_FD...` (api.handover starts it)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise_priority()
    link = socket.socket(fileno=int(argv[0]))
    listeners = [socket.socket(fileno=int(fd)) for fd in argv[1:]]
    try:
        Acceptor(listeners, link).run()
    finally:
        for sock in listeners:
            sock.close()
        link.close()
    return 0


if __name__ == "__main__":
    if len(sys.argv) < 3:
        print("usage: python -m tqserve.api.acceptor LINK_FD LISTEN_FD...", file=sys.stderr)
        raise SystemExit(2)
    raise SystemExit(main(sys.argv[1:]))
