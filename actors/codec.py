"""The one msgpack codec of the actors' messages (actors.messages registers the classes).

A message encodes as a msgpack map with its tag under "t" and its fields; nested
registered classes (SamplingParams) encode the same way. Tuples travel as msgpack arrays
and are restored through each class's converters.

Bulk bytes (the snapshot planes the spill actor writes and loads) travel out of band:
`encode(message, buffers)` appends every `bytes` value of OUT_OF_BAND bytes or more to
`buffers` and the msgpack data holds its index (an ExtType), and `decode(data, buffers)`
puts the same objects back. A mailbox carries the data with its buffers, so a 300 MB
snapshot crosses an edge without a copy, as pickle's protocol 5 passes buffers. Without
`buffers` (the recorder, the wire, the tests) every value is inline.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import attrs
import msgpack

OUT_OF_BAND = 1 << 14  # bytes values this large ride beside the msgpack data, not in it
_BUFFER = 1  # the ExtType code of an out-of-band buffer's index
_SCALARS = (str, int, float, bool, type(None))


class CodecError(ValueError):
    """Bytes that are not a message of this codec."""


class Codec:
    """Encodes and decodes the registered attrs classes (see the module doc)."""

    def __init__(self, classes: Iterable[type]) -> None:
        self.classes: dict[str, type] = {cls.__name__: cls for cls in classes}
        self._fields = {cls: tuple(f.name for f in attrs.fields(cls))
                        for cls in self.classes.values()}

    def encode(self, message: Any, buffers: list[bytes] | None = None) -> bytes:
        """Encode a registered message to msgpack bytes (large bytes into `buffers`)."""
        return msgpack.packb(self._to_plain(message, buffers), use_bin_type=True)

    def decode(self, data: bytes, buffers: Sequence[bytes] = ()) -> Any:
        """Decode msgpack bytes produced by `encode` back to the message object."""
        def buffer(code: int, index: bytes) -> Any:
            if code != _BUFFER:
                raise CodecError(f"unknown extension type {code}")
            return buffers[int.from_bytes(index, "big")]

        try:
            plain = msgpack.unpackb(data, raw=False, strict_map_key=False, ext_hook=buffer)
            return self._from_plain(plain)
        except (ValueError, TypeError, IndexError, msgpack.UnpackException) as exc:
            raise CodecError(f"cannot decode message: {exc}") from exc

    def _to_plain(self, obj: Any, buffers: list[bytes] | None) -> Any:
        if isinstance(obj, _SCALARS):  # first: a step's message is mostly token ids
            return obj
        if isinstance(obj, bytes):
            if buffers is None or len(obj) < OUT_OF_BAND:
                return obj
            buffers.append(obj)
            return msgpack.ExtType(_BUFFER, (len(buffers) - 1).to_bytes(4, "big"))
        if isinstance(obj, (tuple, list)):
            return [self._to_plain(v, buffers) for v in obj]
        names = self._fields.get(type(obj))
        if names is None:
            if attrs.has(type(obj)):
                raise TypeError(f"{type(obj).__name__} is not a registered message class")
            return obj
        out = {"t": type(obj).__name__}
        for field in names:
            out[field] = self._to_plain(getattr(obj, field), buffers)
        return out

    def _from_plain(self, obj: Any) -> Any:
        if isinstance(obj, dict) and "t" in obj:
            cls = self.classes.get(obj["t"])
            if cls is None:
                raise CodecError(f"unknown message tag {obj['t']!r}")
            return cls(**{k: self._from_plain(v) for k, v in obj.items() if k != "t"})
        if isinstance(obj, list):
            return [self._from_plain(v) for v in obj]
        return obj
