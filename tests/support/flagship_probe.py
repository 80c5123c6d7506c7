"""A test-only callback added to a CLI run by class_path: records losses, saves checkpoints, dies on cue.

    moe-lightning fit --config configs/1t-mini.yaml --trainer.callbacks+=tests.support.flagship_probe.FlagshipProbe \
        --trainer.callbacks.out=run.json --trainer.callbacks.save_at_steps=[2,4] --trainer.callbacks.kill_at_step=5
"""

import json
import os
import signal
from pathlib import Path
from typing import Optional

import lightning as L
import torch


class FlagshipProbe(L.Callback):
    """Writes the world-mean loss of every optimizer step (rank 0, after each step, so a killed run keeps its
    record), saves a checkpoint after the steps in ``save_at_steps``, and SIGKILLs every rank at the start of
    step ``kill_at_step``."""

    def __init__(self, out: str, save_at_steps: Optional[list[int]] = None, kill_at_step: Optional[int] = None):
        self.out, self.save_at_steps, self.kill_at_step = Path(out), save_at_steps or [], kill_at_step
        self.rows: list[dict] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.kill_at_step:
            os.kill(os.getpid(), signal.SIGKILL)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        loss = outputs["loss"].detach().float().clone()
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(loss)
            loss /= torch.distributed.get_world_size()
        self.rows.append({"step": trainer.global_step, "loss": loss.item()})
        if trainer.is_global_zero:
            self.out.write_text(json.dumps(self.rows))
        if trainer.global_step in self.save_at_steps:
            trainer.save_checkpoint(self.out.with_name(f"step={trainer.global_step}.ckpt"))
