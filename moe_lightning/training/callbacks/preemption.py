"""Preemption: every rank finishes its optimizer step, saves once and exits non-zero; and ``max_time``'s own exit.

SIGINT (Ctrl-C), SIGTERM and SLURM's requeue signal (SIGUSR1 by default, when ``SLURMEnvironment`` requeues) make
every rank finish the current optimizer step, write one checkpoint through ``trainer.save_checkpoint`` (the path
periodic saves take, so sharded or single-file and atomic alike) and exit with ``128 + signal``, printing
``preempted at step N, checkpoint at PATH``. It replaces Lightning's signal handling, which exits 0 after SIGTERM
and, with several processes, broadcasts from inside the signal handler (a hang). The signals are taken by the
package's one helper, ``run.signals.StopSignals`` (record now, act at the step boundary); the exit statuses are
``run.exits``'.
"""

import signal
from pathlib import Path

import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import LightningEnvironment, SLURMEnvironment
from lightning.pytorch.callbacks import Callback, ModelCheckpoint, Timer
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from moe_lightning.parallel.mesh import world_side_channel
from moe_lightning.run.exits import EXIT_MAX_TIME, Preempted, requeue_slurm_job, say, stopped_word
from moe_lightning.run.signals import StopSignals, end_startup
from moe_lightning.training.lightning_internals import cluster_environment, install_signal_handlers, \
    optimizer_step_ends, write_step_metrics


def exit_status(trainer, code: int) -> int:
    """``code`` on every rank but those Lightning started as children of the main process, which exit 0: its
    observer thread kills the main process (SIGKILL) as soon as a child exits non-zero, and the main process's
    status is the job's."""
    spawned_child = isinstance(cluster_environment(trainer), LightningEnvironment) and trainer.local_rank > 0
    return 0 if spawned_child else code


def stopped_by_max_time(trainer) -> bool:
    """Whether ``trainer.max_time`` (Lightning's ``Timer``) ended the fit before ``max_steps``."""
    timer = next((c for c in trainer.callbacks if isinstance(c, Timer)), None)
    left = timer.time_remaining() if timer is not None else None
    return left is not None and left <= 0 and not 0 <= trainer.max_steps <= trainer.global_step


def exit_if_stopped_by_max_time(trainer) -> None:
    """After ``fit``: exit with ``EXIT_MAX_TIME`` when ``max_time`` stopped the run, so that a requeue script can
    tell an unfinished run from a finished one (``FinalCheckpoint`` has saved the step it stopped at)."""
    if not stopped_by_max_time(trainer):
        return
    if trainer.is_global_zero:
        say(f"trainer.max_time reached at step {trainer.global_step} of {trainer.max_steps}: exit status "
            f"{EXIT_MAX_TIME}, the run is not finished (the same command with --ckpt_path last continues it)")
    raise SystemExit(exit_status(trainer, EXIT_MAX_TIME))


class Preemption(Callback):
    """Save and exit non-zero on SIGINT (Ctrl-C), SIGTERM and SLURM's requeue signal, every rank at one step.

    ``MoELanguageModel`` adds this callback to every fit. Its ``StopSignals`` only records the signal; the
    training hooks act on it. A signal may reach one rank only (``kill`` of the main process), or ranks in
    different steps. The ranks agree through a flag all-reduced over a gloo group of CPU tensors: started
    asynchronously when an optimizer step begins and read when it ends, so there is no device sync, and the host
    waits only if a tiny all-reduce took longer than a whole step. Ranks stop after the first step at whose start
    any rank had seen a signal (one step later than the signalled rank's own step when it came mid-step), write
    ``last.ckpt`` through ``trainer.save_checkpoint`` and exit with ``128 + signal`` (130 for Ctrl-C, 143 for
    SIGTERM). One process reads its own flag.

    Before the first step (the model is being built or a checkpoint loaded) there is nothing to save: the signal
    raises ``Preempted`` at once ("preempted before the first step: nothing to save", the same exit status). A
    repeat more than ``repeat_grace_s`` after the first exits at once, keeping the previous checkpoint. During the
    save a repeat is left to the kernel (default action), so it works even inside a collective.

    Args:
        repeat_grace_s: A repeat within this many seconds of the first signal is the same request.
    """

    def __init__(self, repeat_grace_s: float = 1.0):
        if not repeat_grace_s >= 0:
            raise ValueError(f"Preemption.repeat_grace_s={repeat_grace_s!r} must be >= 0 (seconds).")
        self.signals = StopSignals([signal.SIGINT, signal.SIGTERM], self._before_first_step, repeat_grace_s)
        self.requeue_signal: int | None = None
        self._said = False
        self._spawned_child = False
        self._group = None
        self._pending = None  # (work, flags) of the all-reduce of the step in progress

    @property
    def signum(self) -> int | None:
        """The first signal this process received."""
        return self.signals.signum

    def _before_first_step(self, signum: int) -> Preempted:
        return Preempted(0 if self._spawned_child else 128 + signum,
                         f"{stopped_word(signum)} before the first step: nothing to save")

    # ---- signals ------------------------------------------------------------------------------------------
    def setup(self, trainer, pl_module, stage: str) -> None:
        if stage != "fit":
            return
        environment = cluster_environment(trainer)
        if isinstance(environment, SLURMEnvironment) and environment.auto_requeue:
            self.requeue_signal = int(environment.requeue_signal or signal.SIGUSR1)
            self.signals.signals = [signal.SIGINT, signal.SIGTERM, self.requeue_signal]
        self.signals.reset()
        self._said = False
        self._spawned_child = exit_status(trainer, 1) == 0
        end_startup()  # the CLI's start-up guard gives back what it took: the handlers restored at teardown
        install_signal_handlers(trainer, self.signals.signals, self.signals.handle)  # now: the model is built next

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        if isinstance(exception, Preempted) and not self.signals.started and not exception.said:
            if trainer.is_global_zero:
                say(str(exception))  # raised by the handler, which prints nothing
            exception.said = True

    def _say_received(self) -> None:
        if self.signum is not None and not self._said:
            self._said = True
            name = signal.Signals(self.signum).name
            say(f"[rank {rank_zero_only.rank}] {name} received: finishing the current step, then saving a "
                f"checkpoint (send it again to stop at once)")

    # ---- agreement ----------------------------------------------------------------------------------------
    def on_train_start(self, trainer, pl_module) -> None:
        if trainer.world_size > 1 and dist.is_initialized() and self._group is None:  # CPU flags: never a device sync
            parallel = getattr(trainer.strategy, "parallel", None)
            self._group = parallel.side_channel("preemption") if parallel is not None else world_side_channel()
        self.signals.started = True

    def _flags(self) -> list[int]:
        """[terminate, requeue, interrupt] as this rank saw them."""
        requeue = self.signum is not None and self.signum == self.requeue_signal
        interrupt = self.signum == signal.SIGINT
        return [int(self.signum is not None and not requeue and not interrupt), int(requeue), int(interrupt)]

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._say_received()
        if self._group is not None and self._pending is None:  # the first micro-batch of a step
            flags = torch.tensor(self._flags(), dtype=torch.int32)
            self._pending = (dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self._group, async_op=True), flags)

    def _agreed(self) -> list[int]:
        if self._pending is None:
            return self._flags()
        work, flags = self._pending
        self._pending = None
        work.wait()
        return flags.tolist()  # a CPU tensor: no device sync

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._say_received()
        if not optimizer_step_ends(trainer):
            return
        terminate, requeue, interrupt = self._agreed()
        if (terminate or requeue or interrupt) and not 0 <= trainer.max_steps <= trainer.global_step:
            signum = signal.SIGTERM if terminate else self.requeue_signal if requeue else signal.SIGINT
            self._preempt(trainer, signum, bool(requeue))

    def on_train_end(self, trainer, pl_module) -> None:
        if self._pending is not None:  # the flag of a last step that ended the run
            self._pending[0].wait()
            self._pending = None

    # ---- the save ---------------------------------------------------------------------------------------
    @staticmethod
    def _checkpointer(trainer) -> ModelCheckpoint | None:
        """The first ``ModelCheckpoint`` with a folder: the one whose ``last.ckpt`` a preemption writes."""
        return next((c for c in trainer.checkpoint_callbacks if isinstance(c, ModelCheckpoint)
                     and c.dirpath is not None), None)

    @classmethod
    def checkpoint_path(cls, trainer) -> Path:
        """``last.ckpt`` (the first ``ModelCheckpoint``'s ``CHECKPOINT_NAME_LAST``) in its folder, where
        ``--ckpt_path last`` looks; without a ``ModelCheckpoint``, ``<log_dir>/checkpoints/last.ckpt``."""
        callback = cls._checkpointer(trainer)
        if callback is not None:
            metrics = {"epoch": torch.tensor(trainer.current_epoch), "step": torch.tensor(trainer.global_step)}
            return Path(callback.format_checkpoint_name(metrics, filename=callback.CHECKPOINT_NAME_LAST))
        return Path(trainer.log_dir or trainer.default_root_dir) / "checkpoints" / "last.ckpt"

    def _preempt(self, trainer, signum: int, requeue: bool) -> None:
        step, path = trainer.global_step, self.checkpoint_path(trainer)
        name = signal.Signals(signum).name
        what = stopped_word(signum)
        if trainer.is_global_zero:
            say(f"{what} ({name}): saving step {step} to {path}; a second {name} now stops at once and keeps the "
                "previous checkpoint")
        self.signals.exit_on_repeat()
        callback = self._checkpointer(trainer)
        if callback is not None and callback.save_last:
            # The save is the callback's last checkpoint, recorded in the state saved with it: the resumed run's
            # callback then replaces last.ckpt (otherwise, finding a file it did not write, it would write
            # last-v1.ckpt and leave last.ckpt at this step).
            callback.last_model_path = str(path)
        trainer.save_checkpoint(path, weights_only=False)  # what periodic saves write: a full resume state
        checkpointer = getattr(trainer.strategy, "checkpointer", None)
        if checkpointer is not None:
            checkpointer.wait()  # a background (async) save is committed before we say where it is
        trainer.strategy.barrier("preempted")
        # The step's logged metrics, which Lightning writes after this hook: the step is done, its row belongs in
        # this run's log (the resumed run starts after it).
        write_step_metrics(trainer)
        message = f"{what} at step {step}, checkpoint at {path}"
        if requeue and trainer.is_global_zero:
            message += requeue_slurm_job()
        if trainer.is_global_zero:
            say(message)
        raise Preempted(exit_status(trainer, 128 + signum), message, said=True)
