"""A fit's folders on Lightning's side: the logger pinned to the ``version_N`` this run created, and one owner per
folder it writes checkpoints into (``run.locks.lock_folder``), given back by ``ReleaseLocks``."""

import os
import re
import warnings
from pathlib import Path

from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from moe_lightning.run.folders import create_new_folder, create_version_folder
from moe_lightning.run.locks import HOLDER_SUFFIX, LOCK_FILE, FolderLock, lock_folder


def allocate_run_folder(logger) -> Path | None:
    """Create this run's ``version_N`` folder exclusively (rank 0) and pin the logger to it; return the folder
    if this call created it, ``None`` if it existed (a fixed ``version`` reused) or the logger has no versions."""
    if not isinstance(logger, (CSVLogger, TensorBoardLogger)) or rank_zero_only.rank != 0:
        return None
    if logger._version is not None:  # the user fixed it: ours only if it did not exist yet
        Path(logger.root_dir).mkdir(parents=True, exist_ok=True)
        return create_new_folder(Path(logger.log_dir))
    folder, logger._version = create_version_folder(Path(logger.root_dir), logger._get_next_version())
    return folder


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


def lock_run_folders(trainer, resumed: str | None = None) -> list[FolderLock]:
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
                    LOCK_FILE, LOCK_FILE + HOLDER_SUFFIX}:  # Lightning counts our lock as a checkpoint
                warnings.filterwarnings("ignore", message=rf"Checkpoint directory (.*{os.sep})?"
                                        rf"{re.escape(os.sep.join(folder.parts[-2:]))} exists and is not empty")
    except BaseException:
        for lock in held:  # refused on a later folder: the earlier ones go back now
            lock.release()
        raise
    trainer.callbacks.append(ReleaseLocks(held))
    return held


class ReleaseLocks(Callback):
    """Gives the folders back when the fit has ended. After an exception Lightning runs callbacks'
    ``on_exception`` before the strategy commits a background save and before its teardown, so the lock is kept
    then: the CLI releases it once the run has unwound (``release``), and a process that dies loses it anyway."""

    def __init__(self, held: list[FolderLock]):
        self.held = held

    def release(self) -> None:
        for lock in self.held:
            lock.release()  # once, however often it is called

    def teardown(self, trainer, pl_module, stage: str) -> None:
        self.release()
