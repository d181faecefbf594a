"""A raw WebSocket client on trio streams, for hostile input (tools.attack and the tests).

It writes whatever frame it is told to (reserved bits, declared lengths that lie, invalid
UTF-8, compressed payloads) and reads the server's close code, which a well-behaved
client library would not let one do.
"""

from __future__ import annotations

import base64
import os
import socket
import struct
import zlib

import trio

OP_CONT, OP_TEXT, OP_BINARY, OP_CLOSE, OP_PING = 0x0, 0x1, 0x2, 0x8, 0x9
MAX_HEAD = 16384  # bytes of a handshake response head this client reads


def frame(opcode: int, payload: bytes, *, fin: bool = True, rsv1: bool = False,
          length: int | None = None) -> bytes:
    """One masked client frame; `length` declares a payload length other than the real one."""
    n = len(payload) if length is None else length
    head = bytes([(0x80 if fin else 0) | (0x40 if rsv1 else 0) | opcode])
    if n < 126:
        head += bytes([0x80 | n])
    elif n < 1 << 16:
        head += bytes([0x80 | 126]) + struct.pack("!H", n)
    else:
        head += bytes([0x80 | 127]) + struct.pack("!Q", n)
    mask = os.urandom(4)
    body = bytes(b ^ mask[i % 4] for i, b in enumerate(payload)) if len(payload) < 4096 \
        else _mask_fast(payload, mask)
    return head + mask + body


def _mask_fast(payload: bytes, mask: bytes) -> bytes:
    n = len(payload)
    key = int.from_bytes((mask * (n // 4 + 1))[:n], "big")
    return (int.from_bytes(payload, "big") ^ key).to_bytes(n, "big")


def deflate_bomb(inflated: int, chunk: int = 1 << 20) -> bytes:
    """A raw-deflate payload (permessage-deflate framing) inflating to `inflated` zero bytes
    (a multiple of `chunk`): one full-flushed compressed chunk, repeated."""
    comp = zlib.compressobj(9, zlib.DEFLATED, -15)
    block = comp.compress(bytes(chunk)) + comp.flush(zlib.Z_FULL_FLUSH)
    return block * max(1, inflated // chunk)


async def connect(port: int, *, path: str = "/v1/stream", extensions: str | None = None,
                  host: str = "127.0.0.1", receive_buffer: int | None = None,
                  origin: str | None = None) -> tuple[trio.SocketStream, bytes]:
    """Open a TCP connection and do the WebSocket handshake; returns (stream, response head).
    `receive_buffer`: SO_RCVBUF set before connecting (a small window: a client that stops
    reading fills it quickly); `origin`: sent as the Origin header (a browser's)."""
    if receive_buffer is None:
        stream = await trio.open_tcp_stream(host, port)
    else:
        sock = trio.socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
        await sock.connect((host, port))
        stream = trio.SocketStream(sock)
    key = base64.b64encode(os.urandom(16)).decode()
    lines = [f"GET {path} HTTP/1.1", f"Host: {host}:{port}", "Upgrade: websocket",
             "Connection: Upgrade", f"Sec-WebSocket-Key: {key}", "Sec-WebSocket-Version: 13"]
    if extensions is not None:
        lines.append(f"Sec-WebSocket-Extensions: {extensions}")
    if origin is not None:
        lines.append(f"Origin: {origin}")
    await stream.send_all(("\r\n".join(lines) + "\r\n\r\n").encode())
    head = b""
    while b"\r\n\r\n" not in head and len(head) < MAX_HEAD:
        data = await stream.receive_some(4096)
        if not data:
            break
        head += data
    return stream, head


async def send_quietly(stream: trio.SocketStream, data: bytes) -> bool:
    """Send; False once the server has closed (a refused frame is the expected outcome)."""
    try:
        await stream.send_all(data)
        return True
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        return False


async def read_close(stream: trio.SocketStream) -> int | None:
    """Read server frames until a close frame (its code) or EOF without one (None)."""
    buf = b""
    while True:
        while len(buf) >= 2:
            n = buf[1] & 0x7F
            at = 2
            if n == 126:
                if len(buf) < 4:
                    break
                n, at = struct.unpack("!H", buf[2:4])[0], 4
            elif n == 127:
                if len(buf) < 10:
                    break
                n, at = struct.unpack("!Q", buf[2:10])[0], 10
            if len(buf) < at + n:
                break
            opcode, payload, buf = buf[0] & 0x0F, buf[at:at + n], buf[at + n:]
            if opcode == OP_CLOSE:
                return struct.unpack("!H", payload[:2])[0] if len(payload) >= 2 else 1005
        try:
            data = await stream.receive_some(65536)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return None
        if not data:
            return None
        buf += data


class FrameReader:
    """Reads whole server frames (unmasked, one frame per message) from a stream."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self._buf = b""

    async def next(self) -> tuple[int, bytes] | None:
        """The next (opcode, payload), or None at EOF."""
        while True:
            parsed = self._parse()
            if parsed is not None:
                return parsed
            try:
                data = await self.stream.receive_some(65536)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return None
            if not data:
                return None
            self._buf += data

    def _parse(self) -> tuple[int, bytes] | None:
        buf = self._buf
        if len(buf) < 2:
            return None
        n, at = buf[1] & 0x7F, 2
        if n == 126:
            if len(buf) < 4:
                return None
            n, at = struct.unpack("!H", buf[2:4])[0], 4
        elif n == 127:
            if len(buf) < 10:
                return None
            n, at = struct.unpack("!Q", buf[2:10])[0], 10
        if len(buf) < at + n:
            return None
        self._buf = buf[at + n:]
        return buf[0] & 0x0F, buf[at:at + n]


async def http_get(port: int, path: str, host: str = "127.0.0.1") -> tuple[int, bytes]:
    """One HTTP/1.1 GET on its own connection: (status, body); reads content-length bytes."""
    stream = await trio.open_tcp_stream(host, port)
    async with stream:
        await stream.send_all(f"GET {path} HTTP/1.1\r\nHost: {host}\r\n"
                              "Connection: close\r\n\r\n".encode())
        data = b""
        while b"\r\n\r\n" not in data and (chunk := await stream.receive_some(65536)):
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                       if line.lower().startswith(b"content-length:")), 0)
        while len(body) < length and (chunk := await stream.receive_some(65536)):
            body += chunk
    return int(head.split(b" ", 2)[1]), body
