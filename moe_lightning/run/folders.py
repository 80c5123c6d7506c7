"""Run folders: created exclusively, and removed only when a failed run created them and left nothing.

- **Run folders** (``version_N``) are created with an exclusive ``mkdir``: two jobs starting at once in one
  folder get different versions. Only a folder this run created may later be removed
  (``remove_empty_run_folder``). Pinning a Lightning logger to it is ``training/callbacks/run_folders.py``'s.
- Settling the unfinished saves inside them is ``checkpoint/commit.py``'s ``remove_unfinished_saves``.
"""

from collections.abc import Callable
from pathlib import Path

from moe_lightning.run.locks import HOLDER_SUFFIX, LOCK_FILE


def create_new_folder(folder: Path) -> Path | None:
    """``folder``, if this call created it (its parents as needed); ``None`` if it existed: not this run's."""
    try:
        folder.mkdir(parents=True)
    except FileExistsError:
        return None
    return folder


def create_version_folder(root: Path, version: int) -> tuple[Path, int]:
    """``root/version_N`` created exclusively, ``N`` the first free from ``version`` on. Lightning's loggers pick
    ``max(existing) + 1`` without creating it, so two jobs starting together both chose ``version_0`` (and the
    loser's clean-up removed the winner's folder); ``mkdir`` fails for the second, which takes the next."""
    root.mkdir(parents=True, exist_ok=True)
    while True:
        try:
            (root / f"version_{version}").mkdir()
        except FileExistsError:  # another job took it between the listing and now
            version += 1
            continue
        return root / f"version_{version}", version


def remove_empty_run_folder(log_dir: Path, release: Callable[[], object] = lambda: None) -> bool:
    """Delete a failed run's logger folder if it holds nothing but the config it was started with and the lock of
    its folders with this run's own holder record (call it only for a folder this run created, while still holding
    its lock: a process waiting for the lock then finds its file gone and locks a new one, ``locks.acquire``).
    ``release`` gives the lock back after the files are gone; the folders follow (on NFS a removed file still open
    stays as ``.nfs*`` until closed, so they can only go after it)."""
    if not log_dir.is_dir():
        return False
    entries = list(log_dir.rglob("*"))
    for path in entries:
        if path.is_dir():
            continue
        if path.name in ("config.yaml", "hparams.yaml", LOCK_FILE, LOCK_FILE + HOLDER_SUFFIX):
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
