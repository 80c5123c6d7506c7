"""A run on a shared cluster: preemption, resuming by itself, run folders, and clean-up of only our own leftovers.

- **Preemption**, the package's one signal path. SIGINT (Ctrl-C), SIGTERM and SLURM's requeue signal (SIGUSR1
  by default, when ``SLURMEnvironment`` requeues) make every rank finish the current optimizer step, write one
  checkpoint through ``trainer.save_checkpoint`` (the path periodic saves take, so sharded or single-file and
  atomic alike) and exit with ``128 + signal``, printing ``preempted at step N, checkpoint at PATH``. It replaces
  Lightning's signal handling, which exits 0 after SIGTERM and, with several processes, broadcasts from inside
  the signal handler (a hang).
- **Exit status.** 0: finished; ``128 + signal``: preempted or interrupted (the checkpoint is written);
  ``EXIT_MAX_TIME`` (75): ``trainer.max_time`` stopped it (the final checkpoint is written); 1: an error.
- **Resume by itself.** ``--ckpt_path last`` resumes from the newest complete checkpoint of *any* earlier run of
  the same logger name (``<save_dir>/<name>/version_*/checkpoints``, or the checkpoint callbacks' own
  ``dirpath``), so a requeued job running the identical command continues; with none it starts fresh and says so.
  A candidate that cannot be read or fails ``checkpoint.verify_checkpoint`` is skipped, saying which and why; the
  ranks check that they chose the same (``AgreedResume``).
- **Run folders** (``version_N``) are created with an exclusive ``mkdir``: two jobs starting at once in one
  folder get different versions. A fixed checkpoint folder (and the one ``last`` continues from) has one owner at a
  time: ``lock_folder`` takes the package's one lock (``locks``: flock on ``.moe-lightning.lock``, which the kernel
  releases when the owner dies; a second run is told the owner's host and pid).
- **Clean-up** of unfinished saves touches only ``*.partial`` directories that carry the marker file the sharded
  checkpointer writes into every directory it creates, never the path the user passed, never anything else: a
  complete one (killed before its commit) is committed, the others are removed.
"""

import os
import re
import signal
import subprocess
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import LightningEnvironment, SLURMEnvironment
from lightning.pytorch.callbacks import Callback, ModelCheckpoint, Timer
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only

from moe_lightning.run import locks
from moe_lightning.training.lightning_internals import cluster_environment, install_signal_handlers, optimizer_step_ends, write_step_metrics
from moe_lightning.checkpoint import sharded as ckpt

# ---- run folders --------------------------------------------------------------------------------------------


def allocate_run_folder(logger) -> Path | None:
    """Create this run's ``version_N`` folder exclusively (rank 0) and pin the logger to it; return the folder
    if this call created it, ``None`` if it existed (a fixed ``version`` reused) or the logger has no versions.

    Lightning's loggers pick ``max(existing) + 1`` without creating it, so two jobs starting together both
    chose ``version_0`` (and the loser's clean-up removed the winner's folder). ``mkdir`` fails for the second.
    """
    if not isinstance(logger, (CSVLogger, TensorBoardLogger)) or rank_zero_only.rank != 0:
        return None
    root = Path(logger.root_dir)
    root.mkdir(parents=True, exist_ok=True)
    if logger._version is not None:  # the user fixed it: ours only if it did not exist yet
        folder = Path(logger.log_dir)
        try:
            folder.mkdir(parents=True)
        except FileExistsError:
            return None
        return folder
    version = logger._get_next_version()
    while True:
        try:
            (root / f"version_{version}").mkdir()
        except FileExistsError:  # another job took it between the listing and now
            version += 1
            continue
        logger._version = version
        return root / f"version_{version}"


def remove_empty_run_folder(log_dir: Path, release: Callable[[], object] = lambda: None) -> bool:
    """Delete a failed run's logger folder if it holds nothing but the config it was started with and the lock of
    its folders with this run's own holder record (call it only for a folder this run created,
    ``allocate_run_folder``'s, while still holding its lock: a process waiting for the lock then finds its file gone
    and locks a new one, ``locks.acquire``). ``release`` gives the lock back after the files are gone; the folders
    follow (on NFS a removed file still open stays as ``.nfs*`` until closed, so they can only go after it)."""
    if not log_dir.is_dir():
        return False
    entries = list(log_dir.rglob("*"))
    for path in entries:
        if path.is_dir():
            continue
        if path.name in ("config.yaml", "hparams.yaml", LOCK_FILE, LOCK_FILE + locks.HOLDER_SUFFIX):
            continue
        if path.name == "metrics.csv" and len(path.read_text().splitlines()) <= 1:
            continue
        return False
    try:  # only what was checked: a file that appeared since stops the removal (rmdir of a non-empty folder)
        for path in entries:
            if not path.is_dir():
                path.unlink()
    except OSError:
        return False
    finally:
        release()
    try:
        for path in sorted((p for p in entries if p.is_dir()), reverse=True):
            path.rmdir()
        log_dir.rmdir()
    except OSError:
        return False
    return True


# ---- resuming by itself -------------------------------------------------------------------------------------


def checkpoint_folders(trainer) -> list[Path]:
    """Where this run's checkpoints go and earlier runs of the same command left theirs: each checkpoint
    callback's ``dirpath`` if given, else every version of the logger (``<save_dir>/<name>/*/checkpoints``)."""
    folders, by_logger = [], False
    for callback in trainer.checkpoint_callbacks:
        if isinstance(callback, ModelCheckpoint) and callback.dirpath is not None:
            folders.append(Path(callback.dirpath))
        else:
            by_logger = True
    if by_logger or not folders:  # a preemption save without a ModelCheckpoint goes to the logger's folder too
        if trainer.loggers:
            logger = trainer.loggers[0]
            root = Path(logger.save_dir or trainer.default_root_dir) / str(logger.name or "")
            folders += sorted(p for p in root.glob("*/checkpoints") if p.is_dir())
        else:
            folders.append(Path(trainer.default_root_dir) / "checkpoints")
    return list(dict.fromkeys(folders))


def _checkpoint_step(path: Path) -> int:
    """The ``global_step`` a checkpoint (file, or sharded directory with ``meta.pt``) was saved at; raises if it
    cannot be read (the caller reports which and why)."""
    return int(ckpt.checkpoint_metadata(path)["global_step"])


def _warn(message: str) -> None:
    """A warning from whichever rank saw it (``rank_zero_warn`` would hide another rank's skipped candidate)."""
    warnings.warn(message if rank_zero_only.rank == 0 else f"[rank {rank_zero_only.rank}] {message}", stacklevel=2)


def _reason(error: BaseException) -> str:
    lines = str(error).strip().splitlines() or [""]
    return f"{type(error).__name__}: {lines[0][:300]}"


def newest_checkpoint(folders: list[Path]) -> tuple[Path, int] | None:
    """The complete checkpoint with the highest step in ``folders`` (ties: the most recently written).

    Complete: a ``*.ckpt`` file or directory (saves write ``*.partial`` and rename), or ``*.ckpt.old`` when a crash
    fell between the two renames of a sharded commit and ``*.ckpt`` is missing, that passes
    ``checkpoint.verify_checkpoint`` (zip structure and CRCs of a file; every shard file present and as long as the
    DCP metadata says). Every candidate passed over is reported with the reason, whatever the exception.
    """
    found = []
    for folder in folders:
        for path in folder.glob("*.ckpt*") if folder.is_dir() else ():
            old_only = path.name.endswith(".ckpt" + ckpt.OLD_SUFFIX) \
                and not path.with_name(path.name[:-len(ckpt.OLD_SUFFIX)]).exists()
            if not (path.name.endswith(".ckpt") or old_only):
                continue
            if path.is_dir() and not (path / ckpt.METADATA_FILE).is_file():
                continue  # a folder that is no checkpoint
            try:
                found.append((_checkpoint_step(path), path.stat().st_mtime, path))
            except Exception as error:  # EIO, a stale handle, a damaged or unsafe file: said, never silent
                _warn(f"resume: skipping {path}: its step cannot be read ({_reason(error)}).")
    for step, _, path in sorted(found, key=lambda item: item[:2], reverse=True):
        try:
            ckpt.verify_checkpoint(path)
        except Exception as error:
            _warn(f"resume: skipping {path} (step {step}): it is incomplete or damaged ({_reason(error)}); "
                  "trying the next newest.")
            continue
        return path, step
    return None


def resolve_last(trainer) -> str | None:
    """``--ckpt_path last``: the newest complete checkpoint of this command's runs, or ``None`` (a fresh start).

    Every rank resolves it from the files (the process group does not exist yet); ``AgreedResume`` then checks,
    once the ranks can talk, that they chose the same, and stops every rank with one line if not."""
    folders = checkpoint_folders(trainer)
    newest = newest_checkpoint(folders)
    where = ", ".join(map(str, folders)) or "(no checkpoint folder)"
    trainer.callbacks.append(AgreedResume(str(newest[0]) if newest else None))
    if newest is None:
        rank_zero_info(f"resume: ckpt_path=last found no complete checkpoint in {where}: starting from scratch")
        return None
    path, step = newest
    rank_zero_info(f"resume: ckpt_path=last -> {path} (step {step}), the newest complete checkpoint in {where}")
    return str(path)


def agree_on_resume(path: str | None) -> None:
    """Raise the same one line on every rank unless all ranks resolved ``--ckpt_path last`` to ``path``."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    chosen = [None] * dist.get_world_size()
    dist.all_gather_object(chosen, path)
    if len(set(chosen)) > 1:
        listed = ", ".join(f"rank {rank} -> {choice or 'nothing (a fresh start)'}" for rank, choice in enumerate(chosen))
        raise ckpt.CheckpointError(f"--ckpt_path last resolved differently on the ranks ({listed}): they see "
                                   "different files (see the warnings above for what each skipped and why). Pass "
                                   "--ckpt_path explicitly, or fix the file system and relaunch.")


class AgreedResume(Callback):
    """Added by ``resolve_last``: at ``setup`` (the process group exists, nothing is loaded yet) the ranks compare
    what ``--ckpt_path last`` meant to each."""

    def __init__(self, path: str | None):
        self.path = path

    def setup(self, trainer, pl_module, stage: str) -> None:
        agree_on_resume(self.path)


# ---- one owner per folder -----------------------------------------------------------------------------------

LOCK_FILE = ".moe-lightning.lock"


class FolderInUseError(RuntimeError):
    """Another live run holds the folder's lock."""


def lock_folder(folder: Path) -> locks.HeldLock:
    """Make this process the folder's one owner until the lock is released or the process ends, however it ends
    (``locks``: flock on ``<folder>/.moe-lightning.lock``, the holder's host and pid recorded beside it). Refused
    with one line naming the holder; taken again by the process that holds it (a second fit in one process)."""
    folder.mkdir(parents=True, exist_ok=True)
    try:
        return locks.acquire(folder / LOCK_FILE)
    except locks.FolderLockedError as error:
        raise FolderInUseError(f"{folder} is in use by another run ({error.holders}; lock {error.path}): one run per "
                               "folder. Wait for it to end, or choose another folder.") from None


def lock_run_folders(trainer, resumed: str | None = None) -> list[locks.HeldLock]:
    """Rank 0 locks the folders this run writes checkpoints into (each ``ModelCheckpoint``'s ``dirpath``, and where
    Lightning puts those without one: ``<version_N>/checkpoints``), its ``version_N`` when that is pinned (by the
    user, or by ``allocate_run_folder``) and, with ``--ckpt_path last``, the folder it continues from
    (``resumed``): a relaunch that continues a run still writing takes the lock that run holds, and is refused."""
    if rank_zero_only.rank != 0:
        return []
    logger = trainer.logger
    pinned = isinstance(logger, (CSVLogger, TensorBoardLogger)) and logger._version is not None
    default = default_checkpoint_folder(trainer)
    checkpoints = [Path(cb.dirpath) if cb.dirpath is not None else default for cb in trainer.checkpoint_callbacks
                   if isinstance(cb, ModelCheckpoint) and (cb.dirpath is not None or default is not None)]
    folders = checkpoints + ([Path(logger.log_dir)] if pinned and logger.log_dir else [])
    folders += [Path(resumed).parent] if resumed else []
    held = []
    try:
        for folder in dict.fromkeys(f.resolve() for f in folders):
            held.append(lock_folder(folder))
            if folder in {c.resolve() for c in checkpoints} and {p.name for p in folder.iterdir()} <= {
                    LOCK_FILE, LOCK_FILE + locks.HOLDER_SUFFIX}:  # Lightning counts our lock as a checkpoint
                warnings.filterwarnings("ignore", message=rf"Checkpoint directory (.*{os.sep})?"
                                        rf"{re.escape(os.sep.join(folder.parts[-2:]))} exists and is not empty")
    except BaseException:
        for lock in held:  # refused on a later folder: the earlier ones go back now
            lock.release()
        raise
    trainer.callbacks.append(ReleaseLocks(held))
    return held


def default_checkpoint_folder(trainer) -> Path | None:
    """Where a ``ModelCheckpoint`` without ``dirpath`` writes, as Lightning resolves it: the first logger's
    ``<save_dir>/<name>/<version>/checkpoints`` (``None`` while its version is not pinned, or for a logger whose
    version means starting it), ``<default_root_dir>/checkpoints`` without a logger."""
    if not trainer.loggers:
        return Path(trainer.default_root_dir) / "checkpoints"
    logger = trainer.loggers[0]
    if not isinstance(logger, (CSVLogger, TensorBoardLogger)) or logger._version is None:
        return None
    version = logger.version if isinstance(logger.version, str) else f"version_{logger.version}"
    return Path(logger.save_dir or trainer.default_root_dir) / str(logger.name) / version / "checkpoints"


class ReleaseLocks(Callback):
    """Gives the folders back when the fit has ended. After an exception Lightning runs callbacks'
    ``on_exception`` before the strategy commits a background save and before its teardown, so the lock is kept
    then: the CLI releases it once the run has unwound (``release``), and a process that dies loses it anyway."""

    def __init__(self, held: list[locks.HeldLock]):
        self.held = held

    def release(self) -> None:
        for lock in self.held:
            lock.release()  # once, however often it is called

    def teardown(self, trainer, pl_module, stage: str) -> None:
        self.release()


# ---- clean-up of unfinished saves ---------------------------------------------------------------------------


def remove_unfinished_saves(folders: set[Path], keep: Path | None = None) -> list[Path]:
    """Settle ``*.partial`` directories that carry the marker our checkpointer writes (saves of a run stopped
    while writing): one whose write completed (a background save killed before its commit, possibly the only copy
    left after a rotation) is committed under its name; the others, never loadable, are deleted. Files, unmarked
    directories and ``keep`` (the path the user passed) stay. Returns the deleted ones."""
    removed = []
    for folder in folders:
        for partial in sorted(folder.glob(f"*{ckpt.PARTIAL_SUFFIX}")) if folder.is_dir() else ():
            if partial.is_symlink() or not partial.is_dir() or not ckpt.written_by_us(partial):
                continue
            if keep is not None and partial.resolve() == keep.resolve():
                continue
            try:
                ckpt.verify_checkpoint(partial)
            except Exception:
                ckpt.remove(partial)
                removed.append(partial)
                rank_zero_info(f"removed {partial}: an unfinished checkpoint of a run stopped while saving")
                continue
            final = partial.with_name(partial.name[:-len(ckpt.PARTIAL_SUFFIX)])
            ckpt.commit_directory(partial, final)
            rank_zero_info(f"committed {final}: its save was complete when the run stopped (before its commit)")
    return removed


# ---- preemption and the exit status -------------------------------------------------------------------------

EXIT_MAX_TIME = 75
"""Exit status of a ``fit`` that ``trainer.max_time`` stopped before ``max_steps``: sysexits.h's ``EX_TEMPFAIL``
("temporary failure, try again": the run is not finished), distinct from 0 (finished), 1 (an error), 2 (bad
usage) and ``128 + signal`` (preempted). A requeue script relaunches the same command on 75 and on 128 + n."""


class Preempted(SystemExit):
    """Raised on every rank once the preemption checkpoint is written; the process exits with ``code``."""

    def __init__(self, code: int, message: str):
        super().__init__(code)
        self.message = message

    def __str__(self) -> str:
        return self.message


def _say(text: str) -> None:
    os.write(2, (text.rstrip("\n") + "\n").encode())  # unbuffered: in order with Lightning's stderr, every rank


def _requeue_slurm_job() -> str:
    array = os.environ.get("SLURM_ARRAY_JOB_ID")
    job = f"{array}_{os.environ['SLURM_ARRAY_TASK_ID']}" if array else os.environ.get("SLURM_JOB_ID", "")
    try:
        result = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"; `scontrol requeue {job}` failed ({error}): resubmit the job"
    if result.returncode != 0:
        return f"; `scontrol requeue {job}` failed ({(result.stderr or result.stdout).strip()}): resubmit the job"
    return f"; SLURM job {job} requeued"


def _stopped(signum: int) -> str:
    return "interrupted" if signum == signal.SIGINT else "preempted"


def exit_status(trainer, code: int) -> int:
    """``code`` on every rank but those Lightning started as children of the main process, which exit 0: its
    observer thread kills the main process (SIGKILL) as soon as a child exits non-zero, and the main process's
    status is the job's."""
    spawned_child = isinstance(cluster_environment(trainer), LightningEnvironment) and trainer.local_rank > 0
    return 0 if spawned_child else code


def stopped_by_max_time(trainer) -> bool:
    """Whether ``trainer.max_time`` (Lightning's ``Timer``) ended the fit before ``max_steps``."""
    timer = next((c for c in trainer.callbacks if isinstance(c, Timer)), None)
    left = timer.time_remaining() if timer is not None else None
    return left is not None and left <= 0 and not 0 <= trainer.max_steps <= trainer.global_step


def exit_if_stopped_by_max_time(trainer) -> None:
    """After ``fit``: exit with ``EXIT_MAX_TIME`` when ``max_time`` stopped the run, so that a requeue script can
    tell an unfinished run from a finished one (``FinalCheckpoint`` has saved the step it stopped at)."""
    if not stopped_by_max_time(trainer):
        return
    if trainer.is_global_zero:
        _say(f"trainer.max_time reached at step {trainer.global_step} of {trainer.max_steps}: exit status "
             f"{EXIT_MAX_TIME}, the run is not finished (the same command with --ckpt_path last continues it)")
    raise SystemExit(exit_status(trainer, EXIT_MAX_TIME))


class Preemption(Callback):
    """Save and exit non-zero on SIGINT (Ctrl-C), SIGTERM and SLURM's requeue signal, every rank at one step.

    The package's one signal handler (``MoELanguageModel`` adds this callback to every fit). The handler only
    records the signal; the training hooks act on it. A signal may reach one rank only (``kill`` of the main
    process), or ranks in different steps. The ranks agree through a flag all-reduced over a gloo group of CPU
    tensors: started asynchronously when an optimizer step begins and read when it ends, so there is no device
    sync, and the host waits only if a tiny all-reduce took longer than a whole step. Ranks stop after the first
    step at whose start any rank had seen a signal (one step later than the signalled rank's own step when it
    came mid-step), write ``last.ckpt`` through ``trainer.save_checkpoint`` and exit with ``128 + signal``
    (130 for Ctrl-C, 143 for SIGTERM). One process reads its own flag.

    Two cases cannot wait for a step's end, and the handler acts itself: before the first step (the model is
    being built or a checkpoint loaded) there is nothing to save, so it raises ``Preempted`` at once
    ("preempted before the first step: nothing to save", the same exit status); a repeat of the signal more than
    ``repeat_grace_s`` after the first exits at once, keeping the previous checkpoint (``timeout`` and
    process-group delivery send one signal twice at once). During the save a repeat is left to the kernel
    (default action), so it works even inside a collective.

    Args:
        repeat_grace_s: A repeat within this many seconds of the first signal is the same request.
    """

    def __init__(self, repeat_grace_s: float = 1.0):
        if not repeat_grace_s >= 0:
            raise ValueError(f"Preemption.repeat_grace_s={repeat_grace_s!r} must be >= 0 (seconds).")
        self.repeat_grace_s = repeat_grace_s
        self.signals: list[int] = [signal.SIGINT, signal.SIGTERM]
        self.requeue_signal: int | None = None
        self.signum: int | None = None  # the first signal this process received
        self.training = False  # False until the first step: a signal then stops at once (nothing to save)
        self._first_at = 0.0
        self._said = False
        self._spawned_child = False
        self._group = None
        self._pending = None  # (work, flags) of the all-reduce of the step in progress

    # ---- signals ------------------------------------------------------------------------------------------
    def setup(self, trainer, pl_module, stage: str) -> None:
        if stage != "fit":
            return
        environment = cluster_environment(trainer)
        if isinstance(environment, SLURMEnvironment) and environment.auto_requeue:
            self.requeue_signal = int(environment.requeue_signal or signal.SIGUSR1)
            self.signals = [signal.SIGINT, signal.SIGTERM, self.requeue_signal]
        self.signum, self.training, self._said = None, False, False
        self._spawned_child = exit_status(trainer, 1) == 0
        install_signal_handlers(trainer, self.signals, self.handle)  # now: the model is built after this hook

    def handle(self, signum: int, frame) -> None:
        """Records the signal, nothing else (it runs between any two bytecodes, a print or a log call included);
        before the first step and on a late repeat it stops the process (see the class docstring)."""
        now = time.monotonic()
        if self.signum is None:
            self.signum, self._first_at = signum, now
            if not self.training:
                raise Preempted(0 if self._spawned_child else 128 + signum,
                                f"{_stopped(signum)} before the first step: nothing to save")
        elif now - self._first_at >= self.repeat_grace_s:
            os._exit(128 + signum)

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        if isinstance(exception, Preempted) and not self.training and trainer.is_global_zero:
            _say(str(exception))  # raised by the handler, which prints nothing

    def _say_received(self) -> None:
        if self.signum is not None and not self._said:
            self._said = True
            name = signal.Signals(self.signum).name
            _say(f"[rank {rank_zero_only.rank}] {name} received: finishing the current step, then saving a "
                 f"checkpoint (send it again to stop at once)")

    # ---- agreement ----------------------------------------------------------------------------------------
    def on_train_start(self, trainer, pl_module) -> None:
        if trainer.world_size > 1 and dist.is_initialized() and self._group is None:
            self._group = dist.new_group(backend="gloo")  # CPU flags: never a device sync
        self.training = True

    def _flags(self) -> list[int]:
        """[terminate, requeue, interrupt] as this rank saw them."""
        requeue = self.signum is not None and self.signum == self.requeue_signal
        interrupt = self.signum == signal.SIGINT
        return [int(self.signum is not None and not requeue and not interrupt), int(requeue), int(interrupt)]

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._say_received()
        if self._group is not None and self._pending is None:  # the first micro-batch of a step
            flags = torch.tensor(self._flags(), dtype=torch.int32)
            self._pending = (dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self._group, async_op=True), flags)

    def _agreed(self) -> list[int]:
        if self._pending is None:
            return self._flags()
        work, flags = self._pending
        self._pending = None
        work.wait()
        return flags.tolist()  # a CPU tensor: no device sync

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._say_received()
        if not optimizer_step_ends(trainer):
            return
        terminate, requeue, interrupt = self._agreed()
        if (terminate or requeue or interrupt) and not 0 <= trainer.max_steps <= trainer.global_step:
            signum = signal.SIGTERM if terminate else self.requeue_signal if requeue else signal.SIGINT
            self._preempt(trainer, signum, bool(requeue))

    def on_train_end(self, trainer, pl_module) -> None:
        if self._pending is not None:  # the flag of a last step that ended the run
            self._pending[0].wait()
            self._pending = None

    # ---- the save ---------------------------------------------------------------------------------------
    @staticmethod
    def checkpoint_path(trainer) -> Path:
        """``last.ckpt`` (the first ``ModelCheckpoint``'s ``CHECKPOINT_NAME_LAST``) in its folder, where
        ``--ckpt_path last`` looks; without a ``ModelCheckpoint``, ``<log_dir>/checkpoints/last.ckpt``."""
        for callback in trainer.checkpoint_callbacks:
            if isinstance(callback, ModelCheckpoint) and callback.dirpath is not None:
                metrics = {"epoch": torch.tensor(trainer.current_epoch), "step": torch.tensor(trainer.global_step)}
                return Path(callback.format_checkpoint_name(metrics, filename=callback.CHECKPOINT_NAME_LAST))
        return Path(trainer.log_dir or trainer.default_root_dir) / "checkpoints" / "last.ckpt"

    def _arm_immediate_exit(self) -> None:
        """From now on a repeat of the signal this rank received kills it at once, even inside a collective."""
        if self.signum is None:
            return  # this rank's first signal may still come: it must not kill the save
        time.sleep(max(0.0, self._first_at + self.repeat_grace_s - time.monotonic()))
        for signum in self.signals:
            signal.signal(signum, signal.SIG_DFL)

    def _preempt(self, trainer, signum: int, requeue: bool) -> None:
        step, path = trainer.global_step, self.checkpoint_path(trainer)
        name = signal.Signals(signum).name
        what = _stopped(signum)
        if trainer.is_global_zero:
            _say(f"{what} ({name}): saving step {step} to {path}; a second {name} now stops at once and "
                 "keeps the previous checkpoint")
        self._arm_immediate_exit()
        trainer.save_checkpoint(path, weights_only=False)  # what periodic saves write: a full resume state
        checkpointer = getattr(trainer.strategy, "checkpointer", None)
        if checkpointer is not None:
            checkpointer.wait()  # a background (async) save is committed before we say where it is
        trainer.strategy.barrier("preempted")
        # The step's logged metrics, which Lightning writes after this hook: the step is done, its row belongs in
        # this run's log (the resumed run starts after it).
        write_step_metrics(trainer)
        message = f"{what} at step {step}, checkpoint at {path}"
        if requeue and trainer.is_global_zero:
            message += _requeue_slurm_job()
        if trainer.is_global_zero:
            _say(message)
        raise Preempted(exit_status(trainer, 128 + signum), message)
