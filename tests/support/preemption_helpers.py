"""Callbacks the preemption tests add from the command line (``--trainer.callbacks+=tests.support.preemption_helpers.X``)."""

import os
import signal as signals
import sys
import time

from lightning.pytorch.callbacks import Callback


class SignalAtStep(Callback):
    """Send ``signal`` to this process ``times`` times in a row (as ``timeout`` does: to the process, then to its
    group) when optimizer step ``step`` starts, only in a run that started from step 0: a relaunch of the same
    command that resumes is left alone."""

    def __init__(self, step: int, signal: str = "SIGTERM", times: int = 1):
        self.step, self.signum, self.times = step, getattr(signals, signal), times
        self.armed = False

    def on_train_start(self, trainer, pl_module):
        self.armed = trainer.global_step == 0 and trainer.is_global_zero

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.armed and trainer.global_step == self.step:
            self.armed = False
            for _ in range(self.times):
                os.kill(os.getpid(), self.signum)


class SignalAtFitStart(Callback):
    """Send ``signal`` to this process once the model is built, before any step (a checkpoint may load next)."""

    def __init__(self, signal: str = "SIGTERM"):
        self.signum = getattr(signals, signal)

    def on_fit_start(self, trainer, pl_module):
        os.kill(os.getpid(), self.signum)
        time.sleep(5)  # still setting up when the signal is handled


class SignalDuringSave(Callback):
    """Send ``signal`` again once the checkpoint save of a preemption has started (the repeat must exit at once)."""

    def __init__(self, signal: str = "SIGTERM"):
        self.signum = getattr(signals, signal)

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

