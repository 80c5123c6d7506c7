"""``StallWatchdog``: a fit's phases on this rank's heartbeat, and the watchdog thread that names a stalled rank.

The hooks only assign the phase and step (``run/heartbeat.py``); the thread (``run/watchdog.py``) publishes them
through the rendezvous store, judges and ends the job with ``EXIT_STALLED`` when a rank stops making progress for
``timeout_s``. It watches from the end of every rank's first training batch (building the model, loading a
checkpoint, a first step's compile and the data loader's start-up are not judged) until the fit's teardown (the
final save is watched), on every rank of a job of two or more processes.
"""

from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist
from lightning.pytorch.callbacks import Callback

from moe_lightning.parallel import mesh
from moe_lightning.run import heartbeat as heartbeats
from moe_lightning.run.exits import EXIT_STALLED, Preempted
from moe_lightning.run.heartbeat import Heartbeat
from moe_lightning.run.watchdog import DEFAULT_STALL_TIMEOUT_S, RankWatchdog, check_stall_timeout
from moe_lightning.training.callbacks.preemption import exit_status

_generation = 0  # fits started in this process: each watches under its own store keys


def coordinates_of(strategy, rank: int) -> dict[str, int]:
    layout = getattr(strategy, "layout", None)
    return layout.coordinates(rank) if layout is not None and hasattr(layout, "coordinates") else {}


def group_names(strategy) -> Callable | None:
    """The names of the process groups by their mesh dimension: ``strategy.parallel.name_of``, else
    ``parallel.mesh.name_of`` (every group the mesh module made), when there is one."""
    return getattr(getattr(strategy, "parallel", None), "name_of", None) or getattr(mesh, "name_of", None)


class StallWatchdog(Callback):
    """Name a rank that stops making progress for ``timeout_s`` and end every live rank with ``EXIT_STALLED`` (69).

    Args:
        timeout_s: Seconds without progress (a phase change or a recorded collective) before a rank is stalled;
            0 turns it off. It must exceed the longest stretch a healthy rank spends without either.
        name_of: Maps a process group to its mesh dimension's name (default: the strategy's ``parallel.name_of``).
    """

    def __init__(self, timeout_s: float = DEFAULT_STALL_TIMEOUT_S, name_of: Callable | None = None):
        self.timeout_s = check_stall_timeout(timeout_s, f"{type(self).__name__}.timeout_s")
        self.name_of = name_of
        self.heartbeat: Heartbeat | None = None
        self.watchdog: RankWatchdog | None = None

    def on_train_start(self, trainer, pl_module) -> None:
        global _generation
        if self.timeout_s == 0 or trainer.world_size < 2 or not dist.is_initialized() or self.watchdog is not None:
            return
        strategy = trainer.strategy
        self.heartbeat = Heartbeat(self.name_of or group_names(strategy))
        self.heartbeat.enter("data", step=trainer.global_step)
        rank = trainer.global_rank
        folder = trainer.log_dir or trainer.default_root_dir
        self.watchdog = RankWatchdog(
            self.heartbeat, rank, trainer.world_size, self.timeout_s,
            identity={"coordinates": coordinates_of(strategy, rank)}, report_dir=Path(folder),
            spawned_child=exit_status(trainer, EXIT_STALLED) == 0, generation=_generation)
        _generation += 1
        heartbeats.activate(self.heartbeat)
        self.watchdog.start()
        if rank == 0:
            self.watchdog.publish_report_dir(Path(folder))

    def _enter(self, phase: str, step: int | None = None) -> None:
        if self.heartbeat is not None:
            self.heartbeat.enter(phase, step)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._enter("forward", trainer.global_step)

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        self._enter("backward")

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self._enter("optimizer")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.heartbeat is not None:
            self.heartbeat.batch_done()
        self._enter("data", trainer.global_step)  # the next batch is fetched next

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        self._enter("checkpoint")

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        self._enter("validation")

    def on_validation_end(self, trainer, pl_module) -> None:
        self._enter("data")

    def _stop(self, failed: bool = False) -> None:
        if self.watchdog is not None:
            self.watchdog.stop(failed=failed)  # exits with EXIT_STALLED when another rank's verdict is stored
            heartbeats.activate(None)
            self.watchdog = self.heartbeat = None

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        self._stop(failed=not isinstance(exception, Preempted))  # a preempted rank has saved and ends on purpose

    def teardown(self, trainer, pl_module, stage: str) -> None:
        self._stop()
