"""Crash-safe snapshot files: temp file, fsync, rename, fsync directory, then acknowledge.

A reader never sees a partly written `<key>.tqsnap`: bytes go to `.tmp-<key>-<random>` in the
same directory, are fsynced, renamed over the final name (atomic within one filesystem), and
the directory is fsynced so the rename itself survives power loss. Keys are hex digests made
here from the namespace and token ids; nothing from a request ever becomes a path.
"""

import contextlib
import hashlib
import os
import re
import secrets
import struct
from collections.abc import Sequence
from pathlib import Path

SNAPSHOT_SUFFIX = ".tqsnap"
TEMP_PREFIX = ".tmp-"
KEY_PATTERN = re.compile(r"[0-9a-f]{16,64}")
_KEY_PERSON = b"tqsnap-key"


def validate_key(key: str) -> str:
    """Return `key` if it is 16 to 64 lowercase hex digits, else raise ValueError."""
    if not isinstance(key, str) or KEY_PATTERN.fullmatch(key) is None:
        raise ValueError(f"snapshot key must be 16-64 lowercase hex digits, got {key!r:.80}")
    return key


def snapshot_key(namespace: str, token_ids: Sequence[int]) -> str:
    """The key of the snapshot of `token_ids` in `namespace`: a 32-byte blake2b, in hex."""
    digest = hashlib.blake2b(digest_size=32, person=_KEY_PERSON)
    encoded = namespace.encode("utf-8")
    digest.update(struct.pack("<Q", len(encoded)))
    digest.update(encoded)
    try:
        digest.update(struct.pack(f"<{len(token_ids)}I", *token_ids))
    except struct.error as exc:
        raise ValueError(f"token ids must be integers in [0, 2**32): {exc}") from None
    return digest.hexdigest()


def snapshot_path(directory: str | Path, key: str) -> Path:
    """Where the snapshot with `key` lives in `directory`."""
    return Path(directory) / f"{validate_key(key)}{SNAPSHOT_SUFFIX}"


def is_temporary_name(name: str) -> bool:
    """Whether a directory entry is a leftover of an unfinished write."""
    return name.startswith(TEMP_PREFIX)


def fsync_directory(directory: str | Path) -> None:
    """Make renames and unlinks in `directory` durable."""
    fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_snapshot_file(directory: str | Path, key: str, data: bytes) -> Path:
    """Durably write `data` as `<key>.tqsnap` in `directory`; return only once it is on disk.

    Any OSError propagates after the temporary file is removed; there is no retry.
    """
    final = snapshot_path(directory, key)
    temporary = final.with_name(f"{TEMP_PREFIX}{key}-{secrets.token_hex(4)}")
    try:
        with open(temporary, "xb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, final)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
    fsync_directory(directory)
    return final
