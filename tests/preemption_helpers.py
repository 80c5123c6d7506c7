"""Callbacks the preemption tests add from the command line (``--trainer.callbacks+=tests.preemption_helpers.X``)."""

import os
import signal
import sys
import time

from lightning.pytorch.callbacks import Callback


class SignalAtStep(Callback):
    """Send ``signal`` to this process (``times`` times, ``gap_s`` apart) when optimizer step ``step`` starts,
    only in a run that started from step 0: a relaunch of the same command that resumes is left alone."""

    def __init__(self, step: int, signal: str = "SIGTERM", times: int = 1, gap_s: float = 0.0, rank: int = 0):
        self.step, self.signum, self.times, self.gap_s, self.rank = step, getattr(signal_module, signal), times, gap_s, rank
        self.armed = False

    def on_train_start(self, trainer, pl_module):
        self.armed = trainer.global_step == 0 and trainer.global_rank == self.rank

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.armed and trainer.global_step == self.step:
            self.armed = False
            for i in range(self.times):
                if i:
                    time.sleep(self.gap_s)
                os.kill(os.getpid(), self.signum)


class SignalDuringSave(Callback):
    """Send ``signal`` again once the checkpoint save of a preemption has started (the repeat must exit at once)."""

    def __init__(self, signal: str = "SIGTERM"):
        self.signum = getattr(signal_module, signal)

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        if trainer.is_global_zero and any(isinstance(c, Callback) and type(c).__name__ == "Preemption"
                                          and c.signum is not None for c in trainer.callbacks):
            os.kill(os.getpid(), self.signum)
            time.sleep(5)  # the kernel's default action ends the process here


class PrintSteps(Callback):
    """One line per optimizer step on stdout (rank 0), so a test knows training is under way."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.is_global_zero:
            print(f"trained step {trainer.global_step}", flush=True)
            sys.stdout.flush()


signal_module = signal
