"""Every fit that ends keeps its final weights: one checkpoint at the last step, unless checkpointing is off."""

import signal
import threading

import torch

from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn


class FinalCheckpoint(Callback):
    """Saves through the trainer's ``ModelCheckpoint`` when training ends at a step it has not saved, and says
    where the final weights are.

    Lightning's default checkpoint is written only after a validation or at an epoch's end, so a run that reaches
    ``max_steps`` before its first validation, or is stopped by a callback (``trainer.should_stop``), would end
    with no weights at all. Ctrl-C in one process finishes the current optimizer step and then ends the fit the
    same way (a second Ctrl-C stops at once, without saving); under several processes the ranks could not agree
    on the step, so Ctrl-C there keeps Lightning's behaviour and says so. ``MoELanguageModel`` adds this callback.
    """

    def __init__(self):
        self._start_step = 0
        self._stepped_from = 0
        self._epoch = 0  # of the last batch: the loop has counted the epoch as done when max_steps ends it
        self._interrupted = False
        self._previous_handler = None
        self._saved_step, self._saved_path = -1, ""

    def on_train_start(self, trainer, pl_module) -> None:
        self._start_step, self._interrupted = trainer.global_step, False
        if trainer.world_size == 1 and threading.current_thread() is threading.main_thread() \
                and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            self._previous_handler = signal.signal(signal.SIGINT, self._on_ctrl_c)

    def _on_ctrl_c(self, signum, frame) -> None:
        signal.signal(signal.SIGINT, self._previous_handler)  # a second Ctrl-C interrupts at once
        self._previous_handler, self._interrupted = None, True
        print("\nCtrl-C: finishing this optimizer step, then saving the weights (Ctrl-C again stops at once, "
              "without saving)", flush=True)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._stepped_from = trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self._stepped_from:  # inside an accumulation: not a step boundary
            return
        self._epoch = trainer.current_epoch
        trainer.should_stop |= self._interrupted
        if trainer.should_stop or 0 <= trainer.max_steps <= trainer.global_step:
            self._save(trainer)  # here, mid-epoch, a resume continues the epoch with exactly the next batches

    def on_train_end(self, trainer, pl_module) -> None:
        self._restore_handler()
        if trainer.fast_dev_run or trainer.global_step == self._start_step:
            return
        checkpoint = self._save(trainer)  # nothing left to save unless the run ended at an epoch's end
        if checkpoint is None:
            rank_zero_warn(f"checkpointing is off (trainer.enable_checkpointing=false): the weights of step "
                           f"{trainer.global_step} were not saved.")
            return
        why = "interrupted by Ctrl-C" if self._interrupted else "training ended"
        rank_zero_info(f"{why} at step {trainer.global_step}; final weights: {self._saved_path}")
        if self._interrupted:
            raise KeyboardInterrupt  # the run did not finish: exit non-zero, as Ctrl-C does

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

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        self._restore_handler()
        if isinstance(exception, KeyboardInterrupt) and trainer.world_size > 1:
            rank_zero_warn(f"Ctrl-C under {trainer.world_size} processes: no final checkpoint (the ranks cannot "
                           "agree on a step to save at); the newest periodic checkpoint is the run's last.")

    def _restore_handler(self) -> None:
        if self._previous_handler is not None:
            signal.signal(signal.SIGINT, self._previous_handler)
            self._previous_handler = None
