"""tqserve recordings: a zstd stream of msgpack records (no MLX needed to read one).

The first record is a header {"format": "tqserve-recording", "version": 1, "model",
"config"}; each following record is one finished, admitted request:
{"request_id", "arrival_s" (seconds since recording began), "prompt_tokens", "params"
(every sampling field, the seed included — None if the client gave none), "output_tokens",
"finish_reason", "cached_tokens"}. Each record is flushed as its own zstd block, so a
server killed mid-run leaves every record written before the kill readable; a torn tail
is ignored by `read_recording`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, BinaryIO

import msgpack
import zstandard

FORMAT = "tqserve-recording"
VERSION = 1


class RecordingWriter:
    """Appends records to a new recording file. Blocking: call it from a worker thread."""

    def __init__(self, path: str | Path, header: dict[str, Any]) -> None:
        try:
            self._file: BinaryIO = open(path, "wb")
        except OSError as exc:
            raise ValueError(f"cannot write the recording {path}: {exc.strerror}") from None
        self._zstd = zstandard.ZstdCompressor(level=3).stream_writer(self._file)
        self.num_records = 0
        self._write({"format": FORMAT, "version": VERSION, **header})

    def _write(self, record: dict[str, Any]) -> None:
        self._zstd.write(msgpack.packb(record, use_bin_type=True))
        self._zstd.flush(zstandard.FLUSH_BLOCK)

    def write(self, record: dict[str, Any]) -> None:
        self._write(record)
        self.num_records += 1

    def close(self) -> None:
        self._zstd.flush(zstandard.FLUSH_FRAME)
        self._file.close()


def read_recording(path: str | Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(header, records); ValueError naming the file when it is not a recording."""
    with open(path, "rb") as f:
        reader = zstandard.ZstdDecompressor().stream_reader(f, read_across_frames=True)
        unpacker = msgpack.Unpacker(raw=False, strict_map_key=False)
        try:
            while chunk := reader.read(1 << 16):
                unpacker.feed(chunk)
        except zstandard.ZstdError as exc:
            if not unpacker.tell():
                raise ValueError(f"{path}: not a zstd-compressed tqserve recording: "
                                 f"{exc}") from None
        items = []
        try:
            for item in unpacker:
                items.append(item)
        except (ValueError, msgpack.UnpackException):
            pass  # a torn last record of a killed server
    if not items or not isinstance(items[0], dict) or items[0].get("format") != FORMAT:
        raise ValueError(f"{path}: not a tqserve recording (no {FORMAT!r} header)")
    if items[0].get("version") != VERSION:
        raise ValueError(f"{path}: recording version {items[0].get('version')} "
                         f"(this tool reads {VERSION})")
    return items[0], items[1:]
