"""``--ckpt_path last``: resume by itself from the newest complete checkpoint of *any* earlier run of the same
logger name (``<save_dir>/<name>/version_*/checkpoints``, or the checkpoint callbacks' own ``dirpath``), so a
requeued job running the identical command continues; with none it starts fresh and says so. A candidate that
cannot be read or fails the completeness check is skipped, saying which and why (``checkpoint.discovery``); the
ranks check that they chose the same (``AgreedResume``)."""

import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from moe_lightning.checkpoint.discovery import checkpoint_folders, newest_checkpoint
from moe_lightning.checkpoint.safe_load import CheckpointError


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
        raise CheckpointError(f"--ckpt_path last resolved differently on the ranks ({listed}): they see different "
                              "files (see the warnings above for what each skipped and why). Pass --ckpt_path "
                              "explicitly, or fix the file system and relaunch.")


class AgreedResume(Callback):
    """Added by ``resolve_last``: at ``setup`` (the process group exists, nothing is loaded yet) the ranks compare
    what ``--ckpt_path last`` meant to each."""

    def __init__(self, path: str | None):
        self.path = path

    def setup(self, trainer, pl_module, stage: str) -> None:
        agree_on_resume(self.path)
