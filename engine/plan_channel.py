"""The tensor-parallel group's channel: rank 0's broadcasts and the ranks' small replies.

Broadcast (`send` / `receive`): one `all_sum` of a BLOCK-byte uint8 array (zeros on the
other ranks) carries a length and the first bytes; a longer payload takes a second
all_sum. The payload is a pickle read back by an unpickler that accepts only
tqserve.engine classes and plain containers (the peers are the processes the launcher
started, but a payload never names arbitrary callables).

Replies (`gather`): every rank gives some bytes and every rank gets all of them, rank 0's
first: one all_sum of the lengths (each rank writes its own slot), then, unless all are
empty, one all_sum of the bytes (each rank writes its own span). The other ranks never
start a collective of their own: they reply only inside an operation rank 0 broadcast,
so every rank issues the same collectives in the same order.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import mlx.core as mx
import numpy as np

BLOCK = 4096  # bytes of the first broadcast: 4 of length, then a decode step's whole plan
_SAFE_BUILTINS = {"tuple", "list", "dict", "set", "frozenset", "object", "int", "float",
                  "str", "bytes", "bool", "complex"}


class GroupFailure(RuntimeError):
    """The tensor-parallel group cannot go on (a peer died or a step failed)."""


class _PlanUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module.startswith("tqserve.engine.") or (
                module == "copyreg" and name in ("__newobj__", "_reconstructor")) or (
                module == "builtins" and name in _SAFE_BUILTINS):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"a plan may not carry {module}.{name}")


def encode(op: str, args: tuple[Any, ...]) -> bytes:
    return pickle.dumps((op, args), protocol=pickle.HIGHEST_PROTOCOL)


def decode(data: bytes) -> tuple[str, tuple[Any, ...]]:
    op, args = _PlanUnpickler(io.BytesIO(data)).load()
    return str(op), tuple(args)


def encode_reply(value: Any) -> bytes:
    """A reply (plain values only) as bytes for `gather`."""
    return pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)


def decode_reply(data: bytes) -> Any:
    return _PlanUnpickler(io.BytesIO(data)).load()


class PlanChannel:
    """Rank 0 sends, every other rank receives, through all_sum (see the module doc)."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.rank = group.rank()

    def _sum(self, data: mx.array) -> bytes:
        try:
            out = mx.distributed.all_sum(data, group=self.group)
            mx.eval(out)
        except RuntimeError as exc:
            raise GroupFailure(f"rank {self.rank}: {exc}") from exc
        # mx.array implements the buffer protocol; its stub declares no __buffer__
        return bytes(memoryview(out))  # type: ignore[arg-type]

    def send(self, payload: bytes) -> None:
        if self.rank != 0:
            raise RuntimeError("only rank 0 sends plans")
        head = len(payload).to_bytes(4, "little") + payload[:BLOCK - 4]
        # mx.array takes any buffer (memoryview) at run time; its stub lists no buffer type
        self._sum(mx.array(memoryview(head.ljust(BLOCK, b"\0")), dtype=mx.uint8))  # type: ignore[arg-type]
        if len(payload) > BLOCK - 4:
            rest = payload[BLOCK - 4:]
            self._sum(mx.array(memoryview(rest), dtype=mx.uint8))  # type: ignore[arg-type]

    def receive(self) -> bytes:
        head = self._sum(mx.zeros((BLOCK,), dtype=mx.uint8))
        size = int.from_bytes(head[:4], "little")
        if size <= BLOCK - 4:
            return head[4:4 + size]
        return head[4:] + self._sum(mx.zeros((size - (BLOCK - 4),), dtype=mx.uint8))

    def gather(self, reply: bytes) -> list[bytes]:
        """Every rank's `reply`, by rank, on every rank (see the module doc)."""
        lengths = np.zeros(self.group.size(), dtype=np.int32)
        lengths[self.rank] = len(reply)
        sizes = np.frombuffer(self._sum(mx.array(lengths)), dtype=np.int32).tolist()
        total = sum(sizes)
        if total == 0:
            return [b""] * len(sizes)
        start = sum(sizes[:self.rank])
        spans = np.zeros(total, dtype=np.uint8)
        spans[start:start + len(reply)] = np.frombuffer(reply, dtype=np.uint8)
        data = self._sum(mx.array(spans))
        offsets = np.cumsum([0, *sizes]).tolist()
        return [data[offsets[i]:offsets[i + 1]] for i in range(len(sizes))]
