"""The package's one way to write a file: beside, synced, renamed, with the folder synced.

Every writer of the package (checkpoints, exports, Hugging Face folders, token shards, manifests, `predict`
outputs) goes through :func:`atomic_write`, so a failure (a full disk, a kill, an exception in the caller's
writer) never leaves a truncated file under the final name and never replaces the file already there, and a
power loss after the rename cannot bring the old file back. Only the new, uniquely named partial file is ever
deleted.
"""

import errno
import os
import stat
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

from moe_lightning.run import heartbeat

PARTIAL_SUFFIX = ".partial"
DISK_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


class DiskFullError(OSError):
    """A write the disk had no room for; the message names the file, the folder and the free space."""

    def __str__(self) -> str:
        return self.strerror


def fsync_directory(path: Path) -> None:
    """Make a rename in ``path`` durable, where the OS and file system allow syncing a directory."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # e.g. Windows cannot open a directory
        return
    try:
        os.fsync(fd)
    except OSError as error:
        if error.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def disk_full_message(path: Path, needed: int | None = None) -> str:
    """``needed``: the bytes this process was writing, where the writer knows them (a sharded checkpoint's shards)."""
    folder = path.parent if path.parent.exists() else Path.cwd()
    free = shutil.disk_usage(folder).free
    size = f"{needed:,} bytes needed, " if needed is not None else ""
    return (f"{path} was not written: the disk is full ({size}{free:,} bytes free on {folder}). "
            "What was there before is intact; free space or write elsewhere.")


def disk_full_error(path: Path, needed: int | None = None) -> DiskFullError:
    """The package's one disk-full error, for writers that learn of a full disk other than from ``atomic_write``
    (torch's zip writer, DCP)."""
    return DiskFullError(errno.ENOSPC, disk_full_message(path, needed))


@contextmanager
def atomic_write(path: str | Path, mode: int | None = None) -> Iterator[BinaryIO]:
    """Open a new partial file beside ``path`` for binary writing (and reading back); on a clean exit sync it,
    rename it over ``path`` and sync the folder. On any exception the partial file is removed and ``path`` is untouched; a
    full disk is raised as :class:`DiskFullError` naming the file. The file keeps the mode of the one it replaces
    (the user's choice), a new one gets ``mode`` (default 0644)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if mode is None:
        try:
            mode = stat.S_IMODE(path.stat().st_mode)
        except FileNotFoundError:
            mode = 0o644
    fd, partial = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=PARTIAL_SUFFIX)
    try:
        os.chmod(partial, mode)  # mkstemp creates 0o600
        with os.fdopen(fd, "w+b") as file:
            yield file
            file.flush()
            os.fsync(file.fileno())
        os.replace(partial, path)
    except BaseException as error:
        Path(partial).unlink(missing_ok=True)
        if isinstance(error, OSError) and error.errno in DISK_FULL:
            raise DiskFullError(error.errno, disk_full_message(path)) from None
        raise
    fsync_directory(path.parent)


def write_bytes(path: str | Path, data: bytes) -> None:
    with atomic_write(path) as file:
        file.write(data)


def write_text(path: str | Path, text: str) -> None:
    write_bytes(path, text.encode())


class ProgressingFile:
    """A file whose every ``write`` tells this rank's heartbeat the writer moves on (``heartbeat.progressed``: one
    integer increment), so the stall watchdog does not take a long checkpoint write for a stalled rank; a write
    that stops (a stopped process, a hung file system) stops the progress with it. Everything else is the file's."""

    def __init__(self, file: BinaryIO):
        self._file = file

    def write(self, data) -> int:
        heartbeat.progressed()
        return self._file.write(data)

    def __getattr__(self, name: str):
        return getattr(self._file, name)


def write_with(path: str | Path, writer: Callable[[BinaryIO], None]) -> None:
    """``writer(file)`` into ``path`` atomically (e.g. ``lambda f: torch.save(obj, f)``: streamed, not buffered)."""
    with atomic_write(path) as file:
        writer(file)
