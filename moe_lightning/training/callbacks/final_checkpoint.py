"""Every fit that ends keeps its final weights: one checkpoint at the last step, unless checkpointing is off."""

import torch

from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from moe_lightning.training.lightning_internals import optimizer_step_ends
from moe_lightning.checkpoint.discovery import checkpoint_step
from moe_lightning.training.callbacks.preemption import Preemption, stopped_by_max_time


class FinalCheckpoint(Callback):
    """Saves through the trainer's ``ModelCheckpoint`` when training ends at a step it has not saved, and says
    where the final weights are.

    Lightning's default checkpoint is written only after a validation or at an epoch's end, so a run that reaches
    ``max_steps`` before its first validation, or is stopped by a callback (``trainer.should_stop``, e.g.
    ``max_time``), would end with no weights at all. Signals (Ctrl-C, SIGTERM) are ``Preemption``'s: it
    saves the step it stops at and ends the fit before this callback's step-end hook runs.
    ``MoELanguageModel`` adds both callbacks.
    """

    def __init__(self):
        self._start_step = 0
        self._epoch = 0  # of the last batch: the loop has counted the epoch as done when max_steps ends it
        self._saved_step, self._saved_path = -1, ""

    def on_train_start(self, trainer, pl_module) -> None:
        self._start_step = trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if not optimizer_step_ends(trainer):  # inside an accumulation
            return
        self._epoch = trainer.current_epoch
        if trainer.should_stop or 0 <= trainer.max_steps <= trainer.global_step:
            self._save(trainer)  # here, mid-epoch, a resume continues the epoch with exactly the next batches

    def on_train_end(self, trainer, pl_module) -> None:
        if trainer.fast_dev_run or trainer.global_step == self._start_step:
            return
        checkpoint = self._save(trainer)  # nothing left to save unless the run ended at an epoch's end
        if checkpoint is None:
            rank_zero_warn(f"checkpointing is off (trainer.enable_checkpointing=false): the weights of step "
                           f"{trainer.global_step} were not saved.")
            return
        why = "trainer.max_time reached" if stopped_by_max_time(trainer) else "training ended"
        rank_zero_info(f"{why} at step {trainer.global_step}; final weights: {self._saved_path}")
        self._say_if_last_is_older(trainer, checkpoint)

    def _say_if_last_is_older(self, trainer, checkpoint: ModelCheckpoint) -> None:
        """A ``last.ckpt`` this callback's checkpointer does not keep (``save_last`` off) that an earlier run's
        preemption wrote stays at that run's step: say which file is newest, as ``generate``/``export`` of
        ``last.ckpt`` would read older weights."""
        last = Preemption.checkpoint_path(trainer)
        if checkpoint.save_last or not trainer.is_global_zero or str(last) == self._saved_path or not last.exists():
            return
        try:
            step = checkpoint_step(last)
        except Exception:  # unreadable: not ours to judge here (a resume would skip it, saying why)
            return
        if step < trainer.global_step:
            rank_zero_warn(f"{last} holds step {step} (saved when an earlier run was stopped); the newest weights "
                           f"are {self._saved_path} (step {trainer.global_step}): pass that file to generate or "
                           "export.")

    def _save(self, trainer) -> ModelCheckpoint | None:
        """Save through the trainer's ``ModelCheckpoint`` unless it already saved this step."""
        checkpoint = trainer.checkpoint_callback
        if not isinstance(checkpoint, ModelCheckpoint) or trainer.fast_dev_run:
            return None
        if trainer.global_step in (checkpoint._last_global_step_saved, self._saved_step):
            if checkpoint._last_global_step_saved == trainer.global_step:
                self._saved_step, self._saved_path = trainer.global_step, checkpoint._last_checkpoint_saved
            return checkpoint
        candidates = {**checkpoint._monitor_candidates(trainer), "epoch": torch.tensor(self._epoch)}
        if checkpoint.monitor is None and checkpoint.save_top_k != 0:
            checkpoint._save_topk_checkpoint(trainer, candidates)  # named and rotated as Lightning's own saves
        else:  # ranked by a metric this step may not have: saved beside the ranking, never replacing a ranked one,
            previous = checkpoint._last_global_step_saved  # and a validation after this step still ranks it
            checkpoint._save_checkpoint(trainer, self._unused_name(trainer, checkpoint, candidates))
            checkpoint._last_global_step_saved = previous
        self._saved_step, self._saved_path = trainer.global_step, checkpoint._last_checkpoint_saved
        checkpoint._save_last_checkpoint(trainer, candidates)
        return checkpoint

    @staticmethod
    def _unused_name(trainer, checkpoint: ModelCheckpoint, candidates: dict) -> str:
        """The callback's file name for this step, with Lightning's ``-vN`` suffix while that name is taken: a
        ``filename`` without ``{step}`` names the ranked checkpoint too, which the final save must not replace
        (even with ``enable_version_counter=False``)."""
        path, version = checkpoint.format_checkpoint_name(candidates), checkpoint.STARTING_VERSION
        while checkpoint.file_exists(path, trainer):
            path, version = checkpoint.format_checkpoint_name(candidates, ver=version), version + 1
        return path
