"""The cache directory as untrusted input: a private directory, no-follow opens, quarantine.

Anyone who can write into the cache directory can plant files the server will read, so:

* `prepare_directory` creates it 0700 and refuses (ValueError, one line naming the path and
  its mode) a directory that is group- or world-writable or owned by another user.
* `open_regular` opens an entry with O_NOFOLLOW and O_NONBLOCK (a FIFO never blocks the
  open) and refuses anything that is not a regular file: a symbolic link, a FIFO, a
  directory, a device. The caller reads from the returned descriptor, so the file checked
  is the file read.
* `remove_leftover` deletes a `.tmp-*` leftover at start without following it (a link goes,
  its target stays); `directory_problem` tells a file's own error from its directory's.
* `quarantine_entry` moves a bad entry (whatever its type: a link moves as a link, its
  target untouched) into `quarantine/` with directory-relative renames. When `quarantine/`
  is not a real directory of the cache dir (e.g. a symbolic link planted to carry files
  elsewhere), nothing is moved out of the directory: the entry is deleted instead.
  `quarantine/` is bounded: each moved entry's mtime is set to the time of the move, and
  after it the entries quarantined longest ago are deleted until at most QUARANTINE_MAX_FILES remain,
  holding at most QUARANTINE_MAX_BYTES of disk blocks (a sparse file counts what it
  occupies), so a stream of planted or damaged files cannot fill the disk. Directories
  in it are left alone (never recursed into).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
import time
from pathlib import Path
from typing import BinaryIO

from tqserve.storage.snapshot import SnapshotError

logger = logging.getLogger("tqserve.storage.tier")

QUARANTINE_DIR = "quarantine"
QUARANTINE_MAX_FILES = 64  # enough to read what went wrong; a flood keeps the newest
QUARANTINE_MAX_BYTES = 1 << 30  # disk blocks the kept files may occupy
DIRECTORY_MODE = 0o700
_UNSAFE_BITS = stat.S_IWGRP | stat.S_IWOTH


def prepare_directory(directory: Path) -> None:
    """Create `directory` (mode 0700) if missing; ValueError if it is not private to us.

    OSError if it cannot be created or inspected.
    """
    if not os.path.lexists(directory):
        directory.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.mkdir(directory, DIRECTORY_MODE)
        except FileExistsError:
            pass
    info = os.stat(directory)
    if not stat.S_ISDIR(info.st_mode):
        raise ValueError(f"--cache-dir {str(directory)!r} is not a directory")
    mode = stat.S_IMODE(info.st_mode)
    if mode & _UNSAFE_BITS:
        raise ValueError(
            f"--cache-dir {str(directory)!r} is group- or world-writable (mode {mode:04o}): "
            f"others could plant snapshot files; run chmod 700 on it")
    if info.st_uid != os.geteuid():
        raise ValueError(f"--cache-dir {str(directory)!r} belongs to uid {info.st_uid}, "
                         f"not to this process (uid {os.geteuid()})")


def open_regular(path: Path) -> tuple[BinaryIO, int]:
    """Open a regular file for reading without following links: (file, size).

    SnapshotError for a link or a non-regular file; FileNotFoundError if it is gone; other
    OSError as raised.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP or os.path.islink(path):
            raise SnapshotError("a symbolic link, not a regular file") from None
        try:
            mode = os.lstat(path).st_mode
        except OSError:
            raise exc from None
        if not stat.S_ISREG(mode):  # e.g. a socket (ENXIO)
            raise SnapshotError(f"not a regular file ({_kind(mode)})") from None
        raise
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise SnapshotError(f"not a regular file ({_kind(info.st_mode)})")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb", buffering=0), info.st_size
    except BaseException:
        os.close(fd)
        raise


def directory_problem(directory: Path, path: Path) -> OSError | None:
    """Why `directory`, which holds `path`, cannot be used any more (it cannot be searched:
    EACCES, ENOTDIR, EIO...; or it is gone), or None if it can (an error was `path`'s own)."""
    try:
        os.lstat(path)
    except FileNotFoundError as exc:
        if not os.path.isdir(directory):
            return exc
    except OSError as exc:
        return exc
    return None


def remove_leftover(path: Path) -> int:
    """Delete a temporary leftover of an unfinished write, whatever it is (a link itself,
    never what it points to), except a directory (left alone, logged); 1 if removed."""
    try:
        if stat.S_ISDIR(os.lstat(path).st_mode):
            logger.warning("ignored %s: a leftover name that is a directory", path.name)
            return 0
        os.unlink(path)
    except FileNotFoundError:
        return 0
    return 1


def quarantine_entry(directory: Path, name: str, reason: str) -> bool:
    """Move entry `name` of `directory` into its `quarantine/`; True if moved.

    When there is no usable quarantine directory the entry is deleted (a directory entry
    that cannot be deleted stays, logged). Never raises OSError.
    """
    try:
        dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        logger.warning("cannot quarantine %s (%s): %s", name, reason, exc)
        return False
    try:
        if _move_into_quarantine(dir_fd, name):
            logger.warning("quarantined snapshot %s: %s", name, reason)
            return True
        try:
            os.unlink(name, dir_fd=dir_fd)
            logger.warning("deleted bad snapshot %s (it could not be moved into a real "
                           "quarantine/ directory): %s", name, reason)
        except FileNotFoundError:
            pass
        except OSError as exc:
            logger.warning("left bad entry %s in place (%s): %s", name, exc, reason)
        return False
    finally:
        os.close(dir_fd)


def _move_into_quarantine(dir_fd: int, name: str) -> bool:
    try:
        os.mkdir(QUARANTINE_DIR, DIRECTORY_MODE, dir_fd=dir_fd)
    except FileExistsError:
        pass
    except OSError:
        return False
    try:
        quarantine_fd = os.open(QUARANTINE_DIR, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
                                | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError:  # a symbolic link (ELOOP) or not a directory (ENOTDIR)
        return False
    try:
        os.replace(name, name, src_dir_fd=dir_fd, dst_dir_fd=quarantine_fd)
        now = time.time_ns()
        with contextlib.suppress(OSError):
            os.utime(name, ns=(now, now), dir_fd=quarantine_fd, follow_symlinks=False)
        _prune_quarantine(quarantine_fd)
        return True
    except FileNotFoundError:
        return True  # gone already: nothing left to serve
    except OSError:  # e.g. a directory of that name already in quarantine/
        return False
    finally:
        os.close(quarantine_fd)


def _prune_quarantine(quarantine_fd: int) -> None:
    """Delete the oldest-quarantined entries beyond the count and byte bounds (module doc)."""
    entries = []
    for name in os.listdir(quarantine_fd):
        try:
            info = os.stat(name, dir_fd=quarantine_fd, follow_symlinks=False)
        except OSError:
            continue
        if not stat.S_ISDIR(info.st_mode):
            entries.append((info.st_mtime_ns, name, info.st_blocks * 512))
    entries.sort(reverse=True)  # newest first
    kept_bytes = 0
    for number, (_, name, size) in enumerate(entries):
        kept_bytes += size
        if number < QUARANTINE_MAX_FILES and kept_bytes <= QUARANTINE_MAX_BYTES:
            continue
        try:
            os.unlink(name, dir_fd=quarantine_fd)
            logger.info("deleted quarantined %s: quarantine/ keeps the newest %d files, "
                        "%d bytes", name, QUARANTINE_MAX_FILES, QUARANTINE_MAX_BYTES)
        except OSError:
            pass


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return f"mode {mode:o}"
