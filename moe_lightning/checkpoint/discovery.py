"""Finding checkpoints: what a checkpoint path holds besides tensors, its step, and the newest complete checkpoint
in a run's folders (what ``--ckpt_path last`` resumes)."""

import os
import warnings
from pathlib import Path
from typing import Any

import torch.distributed as dist

from moe_lightning.checkpoint.commit import METADATA_FILE, OLD_SUFFIX, metadata_file, resolve_checkpoint, verify_checkpoint
from moe_lightning.checkpoint.safe_load import load_metadata


def checkpoint_metadata(path: str | Path) -> dict[str, Any]:
    """The non-tensor state of a single-file or sharded checkpoint (``meta.pt``), tensors mapped, not read."""
    return load_metadata(metadata_file(resolve_checkpoint(Path(path))), mmap=True)


def checkpoint_folders(trainer) -> list[Path]:
    """Where this run's checkpoints go and earlier runs of the same command left theirs: each checkpoint
    callback's ``dirpath`` if given, else every version of the logger (``<save_dir>/<name>/*/checkpoints``)."""
    folders, by_logger = [], False
    for callback in trainer.checkpoint_callbacks:
        if getattr(callback, "dirpath", None) is not None:  # a ModelCheckpoint given its folder
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


def checkpoint_step(path: Path) -> int:
    """The ``global_step`` a checkpoint (file, or sharded directory with ``meta.pt``) was saved at; raises if it
    cannot be read (the caller reports which and why)."""
    return int(checkpoint_metadata(path)["global_step"])


def _warn(message: str) -> None:
    """A warning from whichever rank saw it (a rank-zero warning would hide another rank's skipped candidate): the
    process group's rank, or before it exists the launcher's."""
    rank = dist.get_rank() if dist.is_initialized() else \
        int(next((os.environ[k] for k in ("RANK", "LOCAL_RANK", "SLURM_PROCID") if k in os.environ), "0"))
    warnings.warn(message if rank == 0 else f"[rank {rank}] {message}", stacklevel=2)


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
            old_only = path.name.endswith(".ckpt" + OLD_SUFFIX) \
                and not path.with_name(path.name[:-len(OLD_SUFFIX)]).exists()
            if not (path.name.endswith(".ckpt") or old_only):
                continue
            if path.is_dir() and not (path / METADATA_FILE).is_file():
                continue  # a folder that is no checkpoint
            try:
                found.append((checkpoint_step(path), path.stat().st_mtime, path))
            except Exception as error:  # EIO, a stale handle, a damaged or unsafe file: said, never silent
                _warn(f"resume: skipping {path}: its step cannot be read ({_reason(error)}).")
    for step, _, path in sorted(found, key=lambda item: item[:2], reverse=True):
        try:
            verify_checkpoint(path)
        except Exception as error:
            _warn(f"resume: skipping {path} (step {step}): it is incomplete or damaged ({_reason(error)}); "
                  "trying the next newest.")
            continue
        return path, step
    return None

