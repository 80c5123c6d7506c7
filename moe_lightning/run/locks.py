"""One owner per folder: the package's one lock, taken through ``lock_folder`` by ``fit`` (checkpoint and run
folders) and ``tokenize`` (its output folder, or one task's share of it), with one contract and one set of file
names: ``.moe-lightning.lock`` (the folder's: exclusive for a run, shared by the tasks of one array),
``.moe-lightning.task-<i>-of-<n>.lock`` (one task's, exclusive) and ``.moe-lightning.turn.lock`` (``take_turn``:
one at a time of the tasks sharing a folder, for a file any of them may write).

A lock is ``flock`` on a file in the folder, taken now or refused (``wait=True``: waited for, where one process
must finish a step the others then use). The kernel releases it when its holder dies, however it dies (SIGKILL, the
out-of-memory killer), so a lock is never stale and nothing is ever taken over; it holds across hosts where the
file system implements flock (Lustre mounted ``-o flock``; NFS with lockd). A file system without flock is one
line naming those mount options; one whose flock is local to each node (Lustre ``-o localflock``, NFS ``-o nolock``
or ``local_lock=flock``) is warned about once: the lock then keeps apart the runs of one node only.

- Who holds a lock exclusively is recorded beside it, ``<lock>.holder`` (host, pid, and a tokenize task's index
  and count), so that a refusal names the holder. It is a file of its own: records are written through ``durable``
  (a new file renamed over the old), which would replace the locked file itself.
- A lock belongs to the open file, so a second ``open`` + ``flock`` in the holding process would refuse that
  process itself. The locks this process holds are kept in ``_HELD``: asking again for one (a second ``fit`` in
  one Python process) adds a user of the same open file, and the file is unlocked when its last user releases.
- A child forked while a lock is held (a DataLoader or tokenize worker) closes its copies of the lock files at
  once (``os.register_at_fork``): the lock stays its parent's alone, and goes when the parent dies, not when the
  last of a killed run's workers notices.
- Lock files stay after release; a run folder removed by the run that created it goes while still locked. A
  process that opened a lock file just before its removal finds, once it holds the lock, that the name points
  elsewhere (or nowhere), and locks the file that is there now. Release removes only this process's own record.
- The lock file is created readable and writable by whoever the umask allows, and opened read-only where it is
  not writable, enough for a local file system; on NFS an exclusive lock needs write access, and a lock file of
  another user that is not group-writable is one line saying so.
- Something else at a lock file's name or its record's (a directory, a FIFO) is refused in one line naming it
  (``NotALockFileError``), before anything is written.
"""

import errno
import fcntl
import json
import os
import re
import socket
import stat
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from moe_lightning.run.durable import write_text

HOLDER_SUFFIX = ".holder"
LOCK_PREFIX = ".moe-lightning"
LOCK_FILE = LOCK_PREFIX + ".lock"
TURN_FILE = LOCK_PREFIX + ".turn.lock"


class FolderLockedError(RuntimeError):
    """Another process holds the lock in a conflicting mode; ``holders`` names it (``describe``'s words)."""

    def __init__(self, path: Path, holders: str):
        super().__init__(f"{path} is locked by {holders}")
        self.path, self.holders = path, holders


class NoFlockError(RuntimeError):
    """The file system of the lock file cannot lock; the message is one line naming the mount options."""


class NotALockFileError(RuntimeError):
    """A lock file's name (or its holder record's) taken by something else: a directory, a FIFO, a device."""

    def __init__(self, path: Path, what: str):
        super().__init__(f"{path} is {what}, not the package's lock file: {path.parent} is locked through a regular "
                         "file of that name (and its holder record); move it away, or choose another folder.")
        self.path = path


_KINDS = {stat.S_IFDIR: "a directory", stat.S_IFIFO: "a FIFO", stat.S_IFSOCK: "a socket", stat.S_IFCHR: "a device",
          stat.S_IFBLK: "a device"}


def _refuse_unless_file(path: Path, mode: int) -> None:
    if not stat.S_ISREG(mode):
        raise NotALockFileError(path, _KINDS.get(stat.S_IFMT(mode), "not a regular file"))


@dataclass
class _Open:
    """This process's open lock file: its users (``acquire`` calls not yet released) and the record it wrote."""
    fd: int
    shared: bool
    users: int = 0
    record: str | None = None


_HELD: dict[str, _Open] = {}  # by the lock file's real path


def _forget_in_child() -> None:
    """A forked child owns none of its parent's locks: its copies of the files are closed (the lock, which belongs
    to the open file the parent still has, is untouched)."""
    for held in _HELD.values():
        try:
            os.close(held.fd)
        except OSError:
            pass
    _HELD.clear()


os.register_at_fork(after_in_child=_forget_in_child)


def record_path(lock: Path) -> Path:
    return lock.with_name(lock.name + HOLDER_SUFFIX)


class HeldLock:
    """One ``acquire`` of ``path``; ``release`` gives it back, once however often it is called."""

    def __init__(self, path: Path, key: str):
        self.path, self.key, self.released = path, key, False

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        held = _HELD[self.key]
        held.users -= 1
        if held.users:
            return
        del _HELD[self.key]
        try:
            if held.record is not None and record_path(self.path).read_text() == held.record:
                record_path(self.path).unlink()  # still ours: no one else writes it while we hold the lock
        except OSError:
            pass  # removed or replaced by hand: nothing of ours to remove
        finally:
            os.close(held.fd)


def acquire(path: Path, shared: bool = False, about: dict | None = None, wait: bool = False) -> HeldLock:
    """Lock ``path`` (created if missing) shared or exclusively, now or never (or once free, with ``wait``). An
    exclusive holder records itself (host, pid and ``about``) in ``<path>.holder``. Raises ``FolderLockedError`` naming the holder while another
    process holds it in a conflicting mode (or this one holds it shared and asks for it exclusively: flock's
    conversion drops the shared lock first), ``NoFlockError`` where the file system cannot lock."""
    key = os.path.realpath(path)
    held = _HELD.get(key)
    if held is not None and held.shared and not shared:
        raise FolderLockedError(path, f"this process itself (host {socket.gethostname()}, pid {os.getpid()}), "
                                      "which holds it shared")
    if held is None:
        _warn_if_local_only(path)
        for _ in range(100):
            fd = _open(path)
            try:
                _flock(fd, path, shared, wait)
                if _names(path, fd):
                    break
            except BaseException:
                os.close(fd)
                raise
            os.close(fd)  # removed or replaced while we locked it: lock the file that is there now
        else:
            raise FolderLockedError(path, "processes that keep removing or replacing the lock file")
        try:
            record = None
            if not shared:
                record = json.dumps({"host": socket.gethostname(), "pid": os.getpid(), **(about or {})})
                try:  # the record replaces a file of that name, never a directory
                    _refuse_unless_file(record_path(path), os.stat(record_path(path)).st_mode)
                except FileNotFoundError:
                    pass
                write_text(record_path(path), record)
        except BaseException:
            os.close(fd)
            raise
        held = _HELD[key] = _Open(fd, shared, record=record)
    held.users += 1
    return HeldLock(path, key)


def _open(path: Path) -> int:
    """The lock file, opened (``O_NONBLOCK``: a FIFO in its place must not block the open); anything else at its
    name is refused (``NotALockFileError``)."""
    try:
        fd = _open_any(path)
    except IsADirectoryError:
        raise NotALockFileError(path, "a directory") from None
    try:
        _refuse_unless_file(path, os.fstat(fd).st_mode)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open_any(path: Path) -> int:
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_NONBLOCK, 0o666)
    except PermissionError:  # another user's lock file in a shared folder, or a folder we cannot write
        try:
            return os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        except FileNotFoundError:
            raise PermissionError(f"cannot create the lock file {path}: {path.parent} is not writable by this user; "
                                  "choose a folder you can write.") from None
    except FileNotFoundError:  # the folder itself was removed (a failed run's, by that run) since we were asked
        path.parent.mkdir(parents=True, exist_ok=True)
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_NONBLOCK, 0o666)


def _names(path: Path, fd: int) -> bool:
    """Whether ``path`` still names the open file ``fd`` (not when it is gone, or stale on NFS)."""
    try:
        now, ours = os.stat(path), os.fstat(fd)
    except (FileNotFoundError, OSError) as error:
        if isinstance(error, FileNotFoundError) or error.errno == errno.ESTALE:
            return False
        raise
    return (now.st_dev, now.st_ino) == (ours.st_dev, ours.st_ino)


_WARNED: set[str] = set()


def _warn_if_local_only(path: Path) -> None:
    """Once per mount: flock there excludes the processes of this node only."""
    mount = local_only_flock(Path(os.path.realpath(path)).parent)
    if mount is not None and mount not in _WARNED:  # names its mount point: once per mount
        _WARNED.add(mount)
        warnings.warn(f"{path.parent}: {mount}, so its lock keeps apart the runs of this node only; two jobs on "
                      "different nodes are not kept apart (Lustre: mount with -o flock; NFS: run lockd, without "
                      "-o nolock or local_lock).", stacklevel=3)


def local_only_flock(folder: Path, mountinfo: str | None = None) -> str | None:
    """Why flock in ``folder`` is local to each node (``"lustre mounted localflock"``), from the mount that holds it
    (``/proc/self/mountinfo``, or the text given), or ``None``. ``folder`` is resolved first: a relative path or a
    symlink names the mount it lands on."""
    folder = Path(os.path.realpath(folder))
    if mountinfo is None:
        try:
            mountinfo = Path("/proc/self/mountinfo").read_text()
        except OSError:
            return None
    best = None
    for line in mountinfo.splitlines():
        fields, _, after = line.partition(" - ")
        fields, after = fields.split(), after.split()
        if len(fields) < 6 or len(after) < 3:
            continue
        point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), fields[4])  # mountinfo escapes (\040)
        # the deepest mount holding the folder; of two at one point the later, which hides the earlier
        if (str(folder) + "/").startswith(point.rstrip("/") + "/") and (best is None or len(point) >= len(best[0])):
            best = (point, after[0], set(fields[5].split(",")) | set(after[2].split(",")))
    if best is None:
        return None
    point, kind, options = best
    if kind == "lustre" and "localflock" in options:
        return f"lustre at {point} is mounted localflock"
    if kind.startswith("nfs"):
        local = {"nolock", "local_lock=flock", "local_lock=all"} & options
        if local:
            return f"{kind} at {point} is mounted {sorted(local)[0]}"
    return None


def _flock(fd: int, path: Path, shared: bool, wait: bool) -> None:
    try:
        fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | (0 if wait else fcntl.LOCK_NB))
    except OSError as error:
        if error.errno in (errno.EWOULDBLOCK, errno.EACCES):  # held by another
            raise FolderLockedError(path, describe(holders([record_path(path)]))) from None
        if error.errno == errno.EBADF and fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY:
            # NFS: an exclusive lock needs the file open for writing
            raise PermissionError(f"cannot lock {path}: another user's lock file, not writable by this one (NFS needs "
                                  "write access to lock); make it group-writable (chmod g+w, and umask 002 for the "
                                  "group's runs).") from None
        raise NoFlockError(f"cannot lock {path} ({os.strerror(error.errno or 0)}): the file system of {path.parent} "
                           "has no flock (Lustre: mount with -o flock; NFS: run lockd, no -o nolock); choose a "
                           "folder on a file system that locks.") from None


def holders(records: Iterable[Path]) -> list[dict]:
    """The holder records among ``records`` that may be current. A record of this host whose process is gone is an
    earlier holder's (a killed one leaves its record); another host's cannot be judged from here and is kept."""
    found, host = [], socket.gethostname()
    for path in records:
        try:
            record = json.loads(path.read_text())
            if record["host"] != host or _running(int(record["pid"])):
                found.append(record)
        except (OSError, ValueError, KeyError, TypeError):
            continue  # removed meanwhile, or not a record
    return found


def describe(found: list[dict]) -> str:
    """``task 3 of 8, host h, pid p; ...``, or that no holder has recorded itself yet (it is starting)."""
    said = [(f"task {r['task']} of {r['tasks']}, " if r.get("tasks", 1) > 1 else "")
            + f"host {r['host']}, pid {r['pid']}" for r in found]
    return "; ".join(said) or "a holder that has not recorded itself yet"


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


# ---- the folder lock: one contract for every command --------------------------------------------------------

class FolderInUseError(RuntimeError):
    """Another live process holds the folder; ``holders`` names it (``describe``'s words)."""

    def __init__(self, folder: Path, holders: str, lock: Path):
        super().__init__(f"{folder} is in use by another run ({holders}; lock {lock}): one run per folder. Wait for it "
                         "to end, or choose another folder.")
        self.folder, self.holders, self.lock = folder, holders, lock


class FolderLock:
    """What ``lock_folder`` took; ``release`` gives it back, once however often it is called."""

    def __init__(self, held: list[HeldLock]):
        self.held = held

    def release(self) -> None:
        for lock in reversed(self.held):
            lock.release()


def task_lock_file(task: int, tasks: int) -> str:
    return f"{LOCK_PREFIX}.task-{task:05d}-of-{tasks:05d}.lock"


def lock_folder(folder: Path, task: int = 0, tasks: int = 1,
                waiting: Callable[[FolderInUseError], object] | None = None) -> FolderLock:
    """Make this process the folder's one owner (or, with ``tasks`` > 1, task ``task`` of the one array that shares
    it) until the lock is released or the process ends, however it ends. A run holds ``.moe-lightning.lock``
    exclusively; each task of an array holds it shared and its own task lock exclusively, so a second run, or the
    same task twice, is refused. A refusal raises ``FolderInUseError`` naming the holders (host, pid, and task);
    with ``waiting`` it is passed there instead (to say so) and the lock is waited for. Taken again by the process
    that holds it (a second fit in one process); ``NoFlockError`` where the file system cannot lock."""
    folder.mkdir(parents=True, exist_ok=True)
    about = {"task": task, "tasks": tasks} if tasks > 1 else {}
    held = []
    try:
        held.append(_take(folder, LOCK_FILE, tasks > 1, about, waiting))
        if tasks > 1:
            held.append(_take(folder, task_lock_file(task, tasks), False, about, waiting))
    except BaseException:
        for lock in held:
            lock.release()
        raise
    return FolderLock(held)


def _take(folder: Path, name: str, shared: bool, about: dict, waiting) -> HeldLock:
    path = folder / name
    try:
        return acquire(path, shared=shared, about=about)
    except FolderLockedError as error:
        found = error.holders if name != LOCK_FILE else describe(holders(  # a run, or the tasks of an array
            [record_path(path), *sorted(folder.glob(f"{LOCK_PREFIX}.task-*.lock{HOLDER_SUFFIX}"))]))
        refused = FolderInUseError(folder, found, path)
    if waiting is None:
        raise refused
    waiting(refused)
    return acquire(path, shared=shared, about=about, wait=True)


def take_turn(folder: Path, about: dict, waiting: Callable[[FolderLockedError], object]) -> HeldLock:
    """One at a time of the processes sharing ``folder`` (the tasks of an array writing a file any of them may
    write): waited for, after ``waiting`` is told who holds the turn."""
    try:
        return acquire(folder / TURN_FILE, about=about)
    except FolderLockedError as error:
        waiting(error)
    return acquire(folder / TURN_FILE, about=about, wait=True)
