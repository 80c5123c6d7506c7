"""``StallWatchdog``: a fit's phases on this rank's heartbeat, and the watchdog thread that names a stalled rank.

The hooks only assign the phase and step (``run/heartbeat.py``); the thread (``run/watchdog.py``) publishes them
through the rendezvous store, judges and ends the job with ``EXIT_STALLED`` when a rank stops making progress for
``timeout_s``. It watches from the end of every rank's first training batch (building the model, loading a
checkpoint, a first step's compile and the data loader's start-up are not judged) until the fit's teardown (the
final save is watched), on every rank of a job of two or more processes.

It also names a straggler (``run/stragglers.py``): every ``straggler_every`` steps the ranks exchange their busy
time (wall time minus the time blocked in recorded collectives' waits) once over a gloo side channel; rank 0 logs
``train/busy_time_spread`` (max / median within each pipeline stage) and warns when one rank stays
``straggler_factor`` times busier than the others for ``straggler_windows`` windows in a row. Recorded
collectives: the package's own (expert all-to-alls) and each FSDP unit's pre-forward, where it waits for its
parameters' all-gather.
"""

import os
import socket
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn
from torch.distributed.fsdp import FSDPModule

from moe_lightning.parallel import mesh
from moe_lightning.run import heartbeat as heartbeats
from moe_lightning.run.exits import EXIT_STALLED, Preempted
from moe_lightning.run.heartbeat import Heartbeat
from moe_lightning.run.stragglers import (DEFAULT_STRAGGLER_EVERY, DEFAULT_STRAGGLER_FACTOR,
                                          DEFAULT_STRAGGLER_WINDOWS, StragglerJudge, WindowClock,
                                          check_straggler_settings, straggler_message)
from moe_lightning.run.watchdog import DEFAULT_STALL_TIMEOUT_S, RankWatchdog, check_stall_timeout
from moe_lightning.training.callbacks.preemption import exit_status

SPREAD_METRIC = "train/busy_time_spread"
"""Max / median of the busy time in the last straggler window, the largest over pipeline stages (1.0: every rank
equally busy). Busy time, not step time: in lockstep every rank's step takes the same wall time."""

_generation = 0  # fits started in this process: each watches under its own store keys


def coordinates_of(strategy, rank: int) -> dict[str, int]:
    layout = getattr(strategy, "layout", None)
    return layout.coordinates(rank) if layout is not None and hasattr(layout, "coordinates") else {}


def group_names(strategy) -> Callable | None:
    """The names of the process groups by their mesh dimension: ``strategy.parallel.name_of``, else
    ``parallel.mesh.name_of`` (every group the mesh module made), when there is one."""
    return getattr(getattr(strategy, "parallel", None), "name_of", None) or getattr(mesh, "name_of", None)


def mark_fsdp_unshards(model: torch.nn.Module) -> list:
    """Record each FSDP unit's pre-forward as a collective on the heartbeat (``all_gather(fsdp)``): FSDP waits there
    for the unit's parameters' all-gather, where a fast rank waits for a slow one. Returns the hooks' handles."""
    return [handle for module in model.modules() if isinstance(module, FSDPModule)
            for handle in mark_blocking_pre_forward(module, "all_gather", "fsdp")]


def mark_blocking_pre_forward(module: torch.nn.Module, op: str, dim: str) -> tuple:
    """Two hooks around the pre-forward hooks ``module`` already has (``prepend`` puts the first before them): the
    collective is entered, and its time is waited, from one to the other. Each call keeps its own start (a stack
    per module), so an exchange in flight or a nested unit neither shares nor overwrites it."""
    started: list[float] = []

    def before(*_):
        heartbeats.entered(op, dim=dim)
        started.append(time.perf_counter())

    def after(*_):
        heartbeats.waited(time.perf_counter() - started.pop())
        heartbeats.finished()

    return module.register_forward_pre_hook(before, prepend=True), module.register_forward_pre_hook(after)


class StallWatchdog(Callback):
    """Name a rank that stops making progress for ``timeout_s`` and end every live rank with ``EXIT_STALLED`` (69).

    Args:
        timeout_s: Seconds without progress (a phase change or a recorded collective) before a rank is stalled;
            0 turns it off (the straggler check still runs). It must exceed the longest stretch a healthy rank
            spends without either. The strategy inserts this callback only when its ``stall_timeout`` is not 0: a
            strategy with ``stall_timeout=0`` has no straggler check either unless this callback is configured.
        name_of: Maps a process group to its mesh dimension's name (default: the strategy's ``parallel.name_of``).
        straggler_every: Steps per straggler window (one gather of three floats per rank each); 0 turns the
            straggler check off.
        straggler_factor: A rank busier than this times the other ranks' median busy time is slow in a window.
        straggler_windows: Windows in a row a rank must be slow before the warning names it.
    """

    def __init__(self, timeout_s: float = DEFAULT_STALL_TIMEOUT_S, name_of: Callable | None = None,
                 straggler_every: int = DEFAULT_STRAGGLER_EVERY, straggler_factor: float = DEFAULT_STRAGGLER_FACTOR,
                 straggler_windows: int = DEFAULT_STRAGGLER_WINDOWS):
        owner = type(self).__name__
        self.timeout_s = check_stall_timeout(timeout_s, f"{owner}.timeout_s")
        self.straggler_every, self.straggler_factor, self.straggler_windows = check_straggler_settings(
            straggler_every, straggler_factor, straggler_windows, owner)
        self.name_of = name_of
        self.heartbeat: Heartbeat | None = None
        self.watchdog: RankWatchdog | None = None
        self._hooks: list = []
        self._stragglers: StragglerJudge | None = None
        self._straggler_group: dist.ProcessGroup | None = None
        self._clock: WindowClock | None = None  # this rank's current window, from the end of its first step
        self._identities: list | None = None  # every rank's (host, pid), gathered with the first window
        self._last_step = -1

    def on_train_start(self, trainer, pl_module) -> None:
        global _generation
        if trainer.world_size < 2 or not dist.is_initialized() or self.heartbeat is not None:
            return
        if self.timeout_s == 0 and self.straggler_every == 0:
            return
        strategy = trainer.strategy
        self.heartbeat = Heartbeat(self.name_of or group_names(strategy))
        self.heartbeat.enter("data", step=trainer.global_step)
        heartbeats.activate(self.heartbeat)
        self._hooks = mark_fsdp_unshards(pl_module)
        if self.straggler_every:
            parallel = getattr(strategy, "parallel", None)
            self._straggler_group = (parallel.side_channel("stragglers") if parallel is not None
                                     else mesh.world_side_channel())
            self._stragglers = StragglerJudge(self.straggler_factor, self.straggler_windows)
            self._clock, self._identities, self._last_step = None, None, trainer.global_step
        if self.timeout_s == 0:
            return
        rank = trainer.global_rank
        folder = trainer.log_dir or trainer.default_root_dir
        self.watchdog = RankWatchdog(
            self.heartbeat, rank, trainer.world_size, self.timeout_s,
            identity={"coordinates": coordinates_of(strategy, rank)}, report_dir=Path(folder),
            spawned_child=exit_status(trainer, EXIT_STALLED) == 0, generation=_generation)
        _generation += 1
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
            if self._stragglers is not None and trainer.global_step != self._last_step:  # an optimizer step ended
                self._last_step = trainer.global_step
                self._straggler_window(trainer)
        self._enter("data", trainer.global_step)  # the next batch is fetched next

    def _straggler_window(self, trainer) -> None:
        """At every ``straggler_every``-th step: one gather of every rank's busy time, judged on every rank (the
        same data, the same verdict), logged and warned by rank 0; then the next window starts."""
        if self._clock is None:  # the first step (compile, the data loader's start-up) is not measured
            self._clock = WindowClock()
            self._clock.restart(time.perf_counter(), self.heartbeat.waited_s)
            return
        step = trainer.global_step
        if step % self.straggler_every:
            return
        local = torch.tensor(self._clock.lap(time.perf_counter(), self.heartbeat.waited_s), dtype=torch.float64)
        with heartbeats.collective("all_gather", dim="stragglers"):  # its wait is outside both windows
            if self._identities is None:
                self._identities = [None] * trainer.world_size
                dist.all_gather_object(self._identities, (socket.gethostname(), os.getpid()),
                                       group=self._straggler_group)
            windows_R_3 = [torch.empty_like(local) for _ in range(trainer.world_size)]
            dist.all_gather(windows_R_3, local, group=self._straggler_group)
        self._clock.restart(time.perf_counter(), self.heartbeat.waited_s)
        stages = [coordinates_of(trainer.strategy, rank).get("pipeline", 0) for rank in range(trainer.world_size)]
        window = self._stragglers.observe([float(w[0]) for w in windows_R_3], peers=stages)
        if not trainer.is_global_zero:
            return
        for logger in trainer.loggers:
            logger.log_metrics({SPREAD_METRIC: window.spread}, step=step)
        for rank, ratio in window.named.items():
            host, pid = self._identities[rank]
            rank_zero_warn(straggler_message(rank, host, pid, coordinates_of(trainer.strategy, rank), ratio,
                                             self.straggler_factor, self.straggler_windows, self.straggler_every,
                                             step))

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        self._enter("checkpoint")

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        self._enter("validation")

    def on_validation_end(self, trainer, pl_module) -> None:
        self._enter("data")

    def _stop(self, failed: bool = False) -> None:
        if self.watchdog is not None:
            self.watchdog.stop(failed=failed)  # exits with EXIT_STALLED when another rank's verdict is stored
        if self.heartbeat is not None:
            heartbeats.activate(None)
            for handle in self._hooks:
                handle.remove()
            self._hooks, self._stragglers = [], None
            self.watchdog = self.heartbeat = None

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        self._stop(failed=not isinstance(exception, Preempted))  # a preempted rank has saved and ends on purpose

    def teardown(self, trainer, pl_module, stage: str) -> None:
        self._stop()
