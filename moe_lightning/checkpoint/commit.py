"""A checkpoint on disk: its file names, the single-file writer, the atomic commit of a sharded directory, removal,
the cheap completeness check (``verify_checkpoint``) that choosing ``--ckpt_path last`` relies on, and the
settling of saves a stopped run left unfinished.

A sharded save is written into ``<path>.partial`` (which holds ``MARKER_FILE`` first: clean-up removes only folders
that carry it) and renamed over ``path`` once complete; the previous one is moved to ``<path>.old`` for the moment
between the two renames. A full disk is raised as ``durable.DiskFullError``, the package's one disk-full error.
"""

import os
import shutil
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from moe_lightning.checkpoint.safe_load import CheckpointError, SafeReader
from moe_lightning.run import durable

METADATA_FILE = "meta.pt"  # Lightning's name for the non-tensor part of a sharded checkpoint
PARTIAL_SUFFIX = durable.PARTIAL_SUFFIX
OLD_SUFFIX = ".old"
MARKER_FILE = ".written-by-moe-lightning"  # in every checkpoint directory we create: clean-up removes only these


def written_by_us(directory: Path) -> bool:
    return (directory / MARKER_FILE).is_file()


def is_disk_full(error: BaseException) -> bool:
    """ENOSPC/EDQUOT anywhere in ``error``'s chain or DCP's per-rank failures; torch's zip writer reports a short
    write as "unexpected pos"."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if getattr(error, "errno", None) in durable.DISK_FULL or "unexpected pos" in str(error):
            return True
        if isinstance(error, dcp.api.CheckpointException):
            return any(is_disk_full(e) for e, _ in error.failures.values())
        error = error.__cause__ or error.__context__
    return False


def save_file(obj: Any, path: Path) -> None:
    """``torch.save`` streamed into ``path`` through ``durable.write_with`` (beside, synced, renamed, folder
    synced): never a truncated file under ``path``, never a whole-checkpoint buffer in memory."""
    try:
        durable.write_with(path, lambda file: torch.save(obj, durable.ProgressingFile(file)))  # a long save progresses
    except Exception as error:  # torch's zip writer reports a full disk as a RuntimeError ("unexpected pos")
        if is_disk_full(error):
            raise durable.disk_full_error(path) from None
        raise


def commit_directory(partial: Path, path: Path) -> None:
    """Replace ``path`` by the fully written ``partial``; a crash at any point leaves a loadable checkpoint, and
    once this returns the new directory survives a power loss. Its files were synced by their writers
    (``durable``, DCP's ``sync_files``); here its entries and the renames are."""
    durable.fsync_directory(partial)
    old = path.with_name(path.name + OLD_SUFFIX)
    remove(old)
    if os.path.lexists(path):  # a symlink (``save_last="link"``) is moved aside as a link, never followed
        os.replace(path, old)
    os.replace(partial, path)
    durable.fsync_directory(path.parent)
    remove(old)


def remove(path: Path) -> None:
    """Delete a checkpoint file or directory; a symlink is unlinked, never followed (its target is another save)."""
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)


def resolve_checkpoint(path: Path) -> Path:
    """``path``, or its previous version if a crash fell between the two renames of a commit."""
    old = path.with_name(path.name + OLD_SUFFIX)
    if not path.exists() and old.exists():
        return old
    if not path.exists():
        raise FileNotFoundError(f"ckpt_path={str(path)!r} does not exist.")
    return path


def verify_checkpoint(path: Path) -> None:
    """Raise ``CheckpointError`` saying what is wrong unless ``path`` is complete as far as can be checked without
    loading it. A file: its zip directory and every entry's CRC-32 (reads the file once). A sharded directory:
    ``meta.pt`` likewise, DCP's ``.metadata`` readable, and every shard file it names present and at least as long
    as the items it holds there (sizes only: no tensor is read)."""
    if not path.is_dir():
        _verify_zip(path)
        return
    _verify_zip(path / METADATA_FILE)
    needed: dict[str, int] = {}
    for item in SafeReader(path).read_metadata().storage_data.values():
        needed[item.relative_path] = max(needed.get(item.relative_path, 0), item.offset + item.length)
    for name, size in sorted(needed.items()):
        shard = path / name
        if not shard.is_file():
            raise CheckpointError(f"{shard} is missing: its DCP metadata lists it.")
        if (actual := shard.stat().st_size) < size:
            raise CheckpointError(f"{shard} holds {actual:,} bytes; its DCP metadata needs {size:,}: truncated.")


def _verify_zip(path: Path) -> None:
    try:
        with zipfile.ZipFile(path) as archive:
            damaged = archive.testzip()
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as error:
        raise CheckpointError(f"{path} is not a complete checkpoint file ({type(error).__name__}: {error}).") from None
    if damaged is not None:
        raise CheckpointError(f"{path}: its entry {damaged} fails its CRC-32 check: the file is damaged.")



def metadata_file(path: Path) -> Path:
    """The file holding a checkpoint's non-tensor state: ``path`` itself, or a sharded directory's ``meta.pt``.
    A directory that is no checkpoint is refused here, before anything is built."""
    if not path.is_dir():
        return path
    if not (path / METADATA_FILE).is_file():
        inside = sorted(p.name for p in path.iterdir() if p.name.endswith(".ckpt"))[:3]
        hint = f" It holds {', '.join(inside)}: pass one of those." if inside else ""
        raise ValueError(f"ckpt_path={str(path)!r} is a directory but not a checkpoint (a sharded checkpoint "
                         f"directory holds {METADATA_FILE} and DCP's .metadata).{hint}")
    return path / METADATA_FILE


def _to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def remove_unfinished_saves(folders: set[Path], keep: Path | None = None,
                            say: Callable[[str], object] = _to_stderr) -> list[Path]:
    """Settle ``*.partial`` directories that carry the marker our checkpointer writes (saves of a run stopped
    while writing): one whose write completed (a background save killed before its commit, possibly the only copy
    left after a rotation) is committed under its name; the others, never loadable, are deleted, each ``say``-ing
    so. Files, unmarked directories and ``keep`` (the path the user passed) stay. Returns the deleted ones."""
    removed = []
    for folder in folders:
        for partial in sorted(folder.glob(f"*{PARTIAL_SUFFIX}")) if folder.is_dir() else ():
            if partial.is_symlink() or not partial.is_dir() or not written_by_us(partial):
                continue
            if keep is not None and partial.resolve() == keep.resolve():
                continue
            try:
                verify_checkpoint(partial)
            except Exception:
                remove(partial)
                removed.append(partial)
                say(f"removed {partial}: an unfinished checkpoint of a run stopped while saving")
                continue
            final = partial.with_name(partial.name[:-len(PARTIAL_SUFFIX)])
            commit_directory(partial, final)
            say(f"committed {final}: its save was complete when the run stopped (before its commit)")
    return removed
