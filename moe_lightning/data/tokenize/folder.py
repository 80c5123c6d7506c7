"""``tokenize_to_folder``: a corpus into a folder of shards and a manifest, this task's share of it, continued where
a stopped run left it; one run (or the tasks of one array) per folder (``run.locks.lock_folder``), stop signals
taken by ``run.signals.StopSignals``. ``fit`` calls it for text sources."""

import errno
import json
import os
import re
import signal
import sys
from contextlib import contextmanager
from pathlib import Path

from moe_lightning.data.sources import MANIFEST
from moe_lightning.data.tokenize.errors import Stopped, TokenizeError, one_line
from moe_lightning.data.tokenize.files import remove_partials, summary, unit_record, write_manifest
from moe_lightning.data.tokenize.plan import PLAN, PLAN_FORMAT, SHARD_TOKENS, checked_plan, document_tokens, new_plan
from moe_lightning.data.tokenize.reading import input_files
from moe_lightning.data.tokenize.tasks import cores, task_from_environment
from moe_lightning.data.tokenize.workers import run_units
from moe_lightning.data.tokenizer import load_tokenizer, tokenizer_identity
from moe_lightning.run import locks
from moe_lightning.run.durable import PARTIAL_SUFFIX
from moe_lightning.run.signals import StopSignals


def tokenize_to_folder(sources: list[str], out: str, tokenizer_path: str | None = None, text_field: str = "text",
                       workers: int | None = None, shard_tokens: int = SHARD_TOKENS, resume: bool = False,
                       task_index: int | None = None, num_tasks: int | None = None, wait: bool = False) -> dict | None:
    """Tokenize ``sources`` into the shard folder ``out`` (this task's share of it); return the manifest's
    ``summary``, or ``None`` when other tasks of the array still have units to finish. ``wait``: a folder another
    run is writing is waited for, then continued or found complete (``fit``: two runs of a sweep sharing a corpus)."""
    folder, workers = Path(out), workers or cores()
    if workers < 1 or shard_tokens < 1:
        raise TokenizeError(f"tokenize: --workers={workers} and --shard-tokens={shard_tokens} must be positive.")
    try:
        planned = json.loads((folder / PLAN).read_text())
    except (OSError, ValueError):
        planned = None  # none yet (or unreadable: said below)
    task, tasks, first_id = task_from_environment(task_index, num_tasks, planned)
    tokenizer = load_tokenizer(tokenizer_path)
    identity = {"format": PLAN_FORMAT, "sources": sources, "tokenizer": tokenizer_identity(tokenizer.spec()),
                "text_field": text_field, "shard_tokens": shard_tokens, **document_tokens(tokenizer)}
    if folder.exists() and not (folder / PLAN).exists() and any(
            not p.name.startswith(("tokenize", locks.LOCK_PREFIX)) for p in folder.iterdir()):
        raise FileExistsError(f"tokenize: --out {folder} exists and is not a tokenize folder (no {PLAN}); choose "
                              "another folder.")
    signals = StopSignals([signal.SIGTERM, signal.SIGINT], _stopped)  # at once until the units run (workers.py)
    if (folder / MANIFEST).exists():
        # a finished corpus: nothing writes it again (a run either finds it complete or is refused), so it is
        # checked and read without a lock, which a read-only mount or a FUSE one could not give
        with signals.installed():
            _existing_plan(folder, identity, sources, resume, task, tasks)
            return _complete(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with signals.installed():  # a signal while waiting for the lock stops the wait too
            held = locks.lock_folder(folder, task, tasks, waiting=_say_waiting if wait else None)
    except locks.FolderInUseError as error:
        raise TokenizeError(f"tokenize: another tokenize is writing {folder} ({error.holders}); wait for it to "
                            "finish, or stop it, then rerun with --resume.") from None
    except locks.NoFlockError as error:
        raise TokenizeError(f"tokenize: {error}") from None
    except OSError as error:
        if error.errno in (errno.EACCES, errno.EPERM, errno.EROFS):  # a read-only mount, another user's folder
            raise TokenizeError(f"tokenize: cannot write {error.filename or folder} ({error.strerror}), and {folder} "
                                f"holds no finished corpus (no {MANIFEST}); tokenize into a folder you can write.") \
                from None
        if isinstance(error, PermissionError):  # worded by ``locks``, with its fix
            raise TokenizeError(f"tokenize: {one_line(error)}") from None
        raise
    try:
        with signals.installed():
            plan = None
            if not (folder / PLAN).exists():
                if resume and not wait:  # said to a user who asked to resume (fit always continues a folder)
                    print(f"tokenize: {folder} holds no run yet; starting from the beginning.", file=sys.stderr)
                # one task of an array plans, the rest wait for its plan
                with _writing_shared_file(folder, PLAN, {"task": task, "tasks": tasks}):
                    if not (folder / PLAN).exists():
                        plan = new_plan(folder, identity, input_files(sources), tokenizer, tasks, first_id)
            if plan is None:
                plan = _existing_plan(folder, identity, sources, resume, task, tasks)
                if (folder / MANIFEST).exists():
                    return _complete(folder)
            if tasks > 1 and plan.get("tasks", tasks) != tasks:  # a plain run (exclusive lock) may finish any plan
                raise TokenizeError(f"tokenize: {folder} is tokenized by an array of {plan['tasks']} tasks, this task "
                                    f"counts {tasks}; rerun it with --num-tasks {plan['tasks']}, or finish the folder "
                                    "with one plain run (--resume --num-tasks 1).")
            mine = [u for u in plan["units"] if u["index"] % tasks == task]
            remove_partials(folder, mine)
            pending = [u for u in mine if not unit_record(folder, u["index"]).exists()]
            run_units(pending, mine, plan, folder, tokenizer_path, workers, signals)
            return _finish(folder, plan, tokenizer, tokenizer_path, task, tasks)
    finally:
        held.release()


def _stopped(signum: int) -> Stopped:
    return Stopped(f"tokenize: stopped by {signal.Signals(signum).name}; finished units are kept: rerun the same "
                   "command with --resume to finish.", signum)


def _say_waiting(refused: locks.FolderInUseError) -> None:
    print(f"tokenize: another run is tokenizing into {refused.folder} ({refused.holders}); waiting for it to finish.",
          file=sys.stderr, flush=True)


def _existing_plan(folder: Path, identity: dict, sources: list[str], resume: bool, task: int, tasks: int) -> dict:
    """The plan of a folder a run has written, if this run may continue it: asked to (``--resume``, or a task of
    an array), with the same arguments and inputs."""
    if not resume and tasks == 1:
        done = "holds a tokenized corpus" if (folder / MANIFEST).exists() else "holds an unfinished run"
        raise FileExistsError(f"tokenize: --out {folder} already {done}; pass --resume to continue the run that "
                              "wrote it, or choose another folder.")
    # a task of an array checks its own units' files; a plain run (the array's last step) the listing
    return checked_plan(folder, identity, input_files(sources) if tasks == 1 else None, task, tasks)


def _complete(folder: Path) -> dict:
    print(f"tokenize: {folder} is already complete ({MANIFEST} written, same arguments and inputs); nothing to do.",
          file=sys.stderr)
    return summary(folder)


def _finish(folder: Path, plan: dict, tokenizer, tokenizer_path: str | None, task: int, tasks: int) -> dict | None:
    """The manifest, once every unit of every task is done (so the last task to finish writes it)."""
    missing = [u["index"] for u in plan["units"] if not unit_record(folder, u["index"]).exists()]
    if missing:
        owners = sorted({i % tasks for i in missing})
        print(f"tokenize: task {task} of {tasks} finished its units; {len(missing)} unit(s) of task(s) "
              f"{', '.join(map(str, owners[:10]))}{' ...' if len(owners) > 10 else ''} are not done yet. The last task "
              "to finish writes the manifest (a task that failed: rerun it with --resume).", file=sys.stderr)
        return None
    with _writing_shared_file(folder, MANIFEST, {"task": task, "tasks": tasks}):
        if (folder / MANIFEST).exists():  # another task of the array finished too and wrote it
            return summary(folder)
        return write_manifest(folder, plan, tokenizer, tokenizer_path)


@contextmanager
def _writing_shared_file(folder: Path, name: str, about: dict):
    """The plan and the manifest, which any task of an array may write, are written by one task at a time (the
    others wait, saying for whom); under that lock a partial copy of either (a task killed while writing it) is
    stale and goes, except where flock is local to each node and a writer on another node may be live."""
    held = locks.take_turn(folder, about, lambda refused: print(
        f"tokenize: waiting for {refused.holders} to write {folder / name}.", file=sys.stderr, flush=True))
    try:
        if locks.local_only_flock(folder) is None:
            for entry in os.scandir(folder):
                copy = _PARTIAL_COPY.fullmatch(entry.name)
                if copy and copy.group(1) == name:
                    Path(entry.path).unlink(missing_ok=True)
        yield
    finally:
        held.release()


_PARTIAL_COPY = re.compile(r"(.+)\.[a-z0-9_]{8}" + re.escape(PARTIAL_SUFFIX))  # atomic_write's (mkstemp's) name
