"""The one folder lock (``run/locks.py``): one ``lock_folder`` for ``fit`` and ``tokenize`` alike, one contract
(a run exclusive, the tasks of one array shared), refusals naming the holder, waiting when asked to; and
``take_turn`` for a file any task of an array may write. (Holders killed, races, NFS: tests/checkpoint.)"""

import os
import socket
import subprocess
import sys

import pytest

from moe_lightning.run import locks
from tests.support.distributed import clean_env

HOLD = """
import sys
from pathlib import Path
from moe_lightning.run import locks
folder, how = Path(sys.argv[1]), sys.argv[2]
if how == "turn":
    held = locks.take_turn(folder, {"task": 3, "tasks": 8}, print)
else:
    held = locks.lock_folder(folder, *map(int, how.split("/")))  # "task/tasks"
print("holding", flush=True)
sys.stdin.read()  # until the test closes stdin
held.release()
"""


def hold(folder, how: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(folder), how], env=clean_env(), stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "holding"
    return proc


def stop(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.wait()
    for stream in (proc.stdin, proc.stdout):
        stream.close()


def test_a_run_and_an_arrays_tasks_exclude_each_other_through_one_lock_and_a_waiter_gets_it_once_free(tmp_path):
    folder = tmp_path / "f"
    run = hold(folder, "0/1")  # what fit takes for a checkpoint folder, and a plain tokenize for its output
    try:
        with pytest.raises(locks.FolderInUseError) as refused:
            locks.lock_folder(folder, 2, 4)  # a task of an array: refused by the run
        host = socket.gethostname()
        assert str(refused.value).startswith(f"{folder} is in use by another run (host {host}, pid {run.pid}; lock ")
        told = []

        def waiting(error: locks.FolderInUseError) -> None:
            told.append(error.holders)
            run.stdin.close()  # the holder ends: the wait that follows finds the folder free

        lock = locks.lock_folder(folder, waiting=waiting)
        assert told == [f"host {host}, pid {run.pid}"] and run.wait(timeout=60) == 0
        lock.release()
        lock.release()  # once, however often
    finally:
        stop(run)
    task = hold(folder, "1/4")
    try:
        mine = locks.lock_folder(folder, 0, 4)  # another task of the same array: shared
        with pytest.raises(locks.FolderInUseError, match=f"task 1 of 4, host {host}, pid {task.pid}"):
            locks.lock_folder(folder, 1, 4)  # the same task twice
        mine.release()
        with pytest.raises(locks.FolderInUseError, match=f"task 1 of 4, host {host}, pid {task.pid}"):
            locks.lock_folder(folder)  # a run while a task writes
    finally:
        stop(task)
    assert sorted(p.name for p in folder.iterdir() if not p.name.endswith(locks.HOLDER_SUFFIX)) == [
        locks.LOCK_FILE, locks.task_lock_file(0, 4), locks.task_lock_file(1, 4)]  # the package's names, nothing else


def test_take_turn_tells_who_holds_the_turn_then_waits_for_it(tmp_path):
    turn = hold(tmp_path, "turn")
    try:
        told = []

        def waiting(error: locks.FolderLockedError) -> None:
            told.append(error.holders)
            turn.stdin.close()

        locks.take_turn(tmp_path, {"task": 0, "tasks": 8}, waiting).release()
        assert told == [f"task 3 of 8, host {socket.gethostname()}, pid {turn.pid}"]
    finally:
        stop(turn)


@pytest.mark.parametrize("kind", ["directory", "fifo", "holder record a directory"])
def test_a_lock_path_that_is_not_the_packages_file_is_refused_in_one_line_naming_it(tmp_path, kind):
    """Issue 33, item 4. Before: a directory at ``.moe-lightning.lock`` raised ``IsADirectoryError`` (a traceback);
    a directory at its holder record failed the same way once the lock was taken (and kept it)."""
    folder = tmp_path / "run"
    folder.mkdir()
    lock = folder / locks.LOCK_FILE
    odd = locks.record_path(lock) if kind == "holder record a directory" else lock
    os.mkfifo(odd) if kind == "fifo" else odd.mkdir()
    what = "a FIFO" if kind == "fifo" else "a directory"
    with pytest.raises(locks.NotALockFileError) as refused:
        locks.lock_folder(folder)
    message = str(refused.value)
    assert message.startswith(f"{odd} is {what}, not the package's lock file") and "\n" not in message
    assert message.endswith("move it away, or choose another folder.")
    odd.rmdir() if kind != "fifo" else odd.unlink()
    locks.lock_folder(folder).release()  # refused without keeping anything: the folder locks once it is cleared
