"""What a fit shows on the console: a progress bar in optimizer steps, and a model summary without a FLOPs count.

``moe-lightning fit`` adds both unless the config names its own progress bar or model summary (or turns them off).
"""

import logging
import time
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import ModelSummary, TQDMProgressBar
from lightning.pytorch.callbacks.progress.tqdm_progress import _update_n
from lightning.pytorch.utilities.model_summary.model_summary import _format_summary_table

from moe_lightning.training.lightning_internals import logs_written

log = logging.getLogger("lightning.pytorch.callbacks.model_summary")  # where Lightning's own summary goes


def human(count: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if count >= scale:
            return f"{count / scale:.3g}{unit}"
    return f"{count:.3g}"


class StepProgressBar(TQDMProgressBar):
    """Training progress as a pretraining run counts it: ``global_step / max_steps`` across epochs and resumes
    (Lightning's bar counts batches of the current epoch against ``max_epochs``: ``Epoch 0/-2 ... 320/19``), the
    time left at the rate since this process started, tokens per second and the last logged ``train/loss``.

    Everything it shows is already on the host: the step counter, the module's ``tokens_seen`` (a Python int), and
    the loss only on steps whose logs are written, where Lightning reads the logged values back anyway.
    """

    def __init__(self, refresh_rate: int = 1):
        super().__init__(refresh_rate=refresh_rate)
        self._loss: float | None = None
        self._start: tuple[float, int] | None = None  # (time, tokens seen) when this process began training

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        self._start = (time.monotonic(), getattr(pl_module, "tokens_seen", 0))
        total = trainer.estimated_stepping_batches  # the smaller of max_steps and max_epochs' steps
        bar = self.train_progress_bar
        bar.reset(total=None if total == float("inf") else int(total))
        bar.initial = trainer.global_step  # the rate (and the time left) counts this process's steps only
        _update_n(bar, trainer.global_step)
        bar.set_description("step")

    def on_train_epoch_start(self, trainer: L.Trainer, *_: Any) -> None:
        """One bar for the whole run (``on_train_start`` set it up), not one per epoch."""

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch: Any,
                           batch_idx: int) -> None:
        if logs_written(trainer):  # Lightning reads the logged values back on this step anyway
            loss = trainer.callback_metrics.get("train/loss")
            self._loss = self._loss if loss is None else float(loss)
        step = trainer.global_step
        if self.train_progress_bar is not None and self._should_update(step, self.train_progress_bar.total or 0):
            _update_n(self.train_progress_bar, step)
            self.train_progress_bar.set_postfix(self.get_metrics(trainer, pl_module))

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self.train_progress_bar.disable:
            self.train_progress_bar.set_postfix(self.get_metrics(trainer, pl_module))

    def get_metrics(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, int | str | float]:
        metrics = {k: v for k, v in super().get_metrics(trainer, pl_module).items() if k != "v_num"}
        shown: dict[str, int | str | float] = {}
        if self._loss is not None:
            shown["loss"] = f"{self._loss:.4g}"
        if self._start is not None and hasattr(pl_module, "tokens_seen"):
            elapsed = time.monotonic() - self._start[0]
            if elapsed > 0 and pl_module.tokens_seen > self._start[1]:
                shown["tok/s"] = human((pl_module.tokens_seen - self._start[1]) / elapsed)
        return {**shown, **metrics}


class SummaryWithoutFlops(ModelSummary):
    """Lightning's summary less its FLOPs column and "Total Flops" line: Lightning counts FLOPs only given an
    ``example_input_array`` and never counts the grouped expert matmuls, so it would print 0. The analytic count
    is ``MoEThroughputMonitor``'s (``moe_lightning.planner.flops``)."""

    @staticmethod
    def summarize(summary_data: list[tuple[str, list[str]]], total_parameters: int, trainable_parameters: int,
                  model_size: float, total_training_modes: dict[str, int], total_flops: int,
                  **summarize_kwargs: Any) -> None:
        columns = [column for column in summary_data if column[0] != "FLOPs"]
        table = _format_summary_table(total_parameters, trainable_parameters, model_size, total_training_modes,
                                      total_flops, *columns)
        log.info("\n" + "\n".join(line for line in table.splitlines() if not line.endswith("Total Flops")))
