"""One picture of a run: loss, learning rate, speed and expert balance against tokens seen, saved in the run folder."""

import time
from pathlib import Path

import lightning as L
from lightning.pytorch.loggers import TensorBoardLogger

from moe_lightning.run.durable import write_with
from moe_lightning.training.callbacks._logging import StepInterval, check_interval
from moe_lightning.training.callbacks.expert_load import ExpertLoadMonitor
from moe_lightning.training.lightning_internals import logs_written


class TrainingCurves(L.Callback):
    """Records a few numbers every ``record_every_n_steps`` and draws ``<log_dir>/training_curves.png``.

    Panels (x axis: tokens seen): train and validation loss; learning rate; tokens/s (this process, training
    time only); expert imbalance (busiest expert over mean, per step); and, when an ``ExpertLoadMonitor`` runs,
    the share of dead experts and the entropy of its windows' load shares. Drawn every ``plot_every_n_steps``
    (0: only when fit ends) and at the end of fit; also sent to TensorBoard when it logs there.

    With several processes the train loss and the expert imbalance are recorded only on the recorded steps whose
    logs are written (``trainer.log_every_n_steps``): only there are they the whole model's over the global batch
    (between them a rank holds its own batch's loss, and the imbalance stays the last logged value). Choose
    ``record_every_n_steps`` dividing ``log_every_n_steps`` (or a multiple of it) to get a point on every log step.

    Args:
        record_every_n_steps: Optimizer steps between recorded points (reading them syncs with the GPU).
        plot_every_n_steps: Steps between redraws during training; 0 draws only at the end.
    """

    def __init__(self, record_every_n_steps: int = 10, plot_every_n_steps: int = 0):
        self.record = StepInterval(check_interval("TrainingCurves", "record_every_n_steps", record_every_n_steps))
        if not isinstance(plot_every_n_steps, int) or plot_every_n_steps < 0:
            raise ValueError(f"TrainingCurves(plot_every_n_steps={plot_every_n_steps!r}): must be 0 (only at the end) "
                             "or a positive number of steps.")
        self.plot_every_n_steps = plot_every_n_steps
        self.history: dict[str, list[tuple[float, float]]] = {}
        self.path: Path | None = None
        self._clock: tuple[float, float] | None = None  # (time, tokens) at the last recorded point

    def _add(self, name: str, tokens: float, value: float) -> None:
        self.history.setdefault(name, []).append((tokens, value))

    def on_train_start(self, trainer, pl_module) -> None:
        tokens = float(getattr(pl_module, "tokens_seen", trainer.global_step))
        self._clock = (time.perf_counter(), tokens)
        if trainer.optimizers:  # the LR the first step uses: the warmup's start is drawn, not its 10th step
            self._add("learning rate", tokens, trainer.optimizers[0].param_groups[0]["lr"])

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if not self.record.due(trainer):
            return
        tokens = float(getattr(pl_module, "tokens_seen", trainer.global_step))
        metrics = trainer.callback_metrics
        if trainer.world_size == 1 or logs_written(trainer):  # else a rank's own batch (and stage), or stale
            for name, key in (("train loss", "train/loss"), ("expert imbalance", "train/expert_imbalance")):
                if key in metrics:
                    self._add(name, tokens, float(metrics[key]))
        self._add("learning rate", tokens, trainer.optimizers[0].param_groups[0]["lr"])
        now = time.perf_counter()
        if self._clock is not None and now > self._clock[0] and tokens > self._clock[1]:
            self._add("tokens/s", tokens, (tokens - self._clock[1]) / trainer.world_size / (now - self._clock[0]))
        self._clock = (now, tokens)
        self._collect_expert_window(trainer)
        if self.plot_every_n_steps and trainer.global_step % self.plot_every_n_steps == 0:
            self.draw(trainer)

    def _collect_expert_window(self, trainer: L.Trainer) -> None:
        """The ExpertLoadMonitor's latest window, once (it may run after this callback in the same step)."""
        for callback in trainer.callbacks:
            if isinstance(callback, ExpertLoadMonitor) and callback.last_tokens_seen is not None \
                    and callback.last_tokens_seen > max((t for t, _ in self.history.get("dead experts", [])),
                                                        default=-1.0):
                self._add("dead experts", callback.last_tokens_seen, callback.last_metrics["expert_load/dead_fraction"])
                self._add("load entropy", callback.last_tokens_seen,
                          callback.last_metrics["expert_load/load_entropy"])

    def on_validation_end(self, trainer, pl_module) -> None:
        if not trainer.sanity_checking and "val/loss" in trainer.callback_metrics:
            self._add("val loss", float(getattr(pl_module, "tokens_seen", trainer.global_step)),
                      float(trainer.callback_metrics["val/loss"]))
        self._clock = (time.perf_counter(), self._clock[1]) if self._clock else None  # validation is not training

    def on_fit_end(self, trainer, pl_module) -> None:
        self.draw(trainer)

    def figure(self, step: int):
        from matplotlib.figure import Figure  # only when drawing: keeps matplotlib off the GPU benchmarks' imports
        from matplotlib.ticker import FuncFormatter

        fig = Figure(figsize=(15, 8), dpi=100, layout="constrained")
        axes = fig.subplots(2, 3, sharex=True).flatten()  # a panel with no data still shows the run's tokens
        panels = [("loss", ["train loss", "val loss"], "cross-entropy (nats/token)"),
                  ("learning rate", ["learning rate"], "learning rate"),
                  ("throughput", ["tokens/s"], "tokens/s per process"),
                  ("expert imbalance", ["expert imbalance"], "busiest expert / mean (1 = even)"),
                  ("dead experts", ["dead experts"], "share of experts with no token"),
                  ("load entropy", ["load entropy"], "entropy of the load shares / log E")]
        for ax, (title, names, ylabel) in zip(axes, panels):
            for name in names:
                points = self.history.get(name, [])
                if points:
                    ax.plot(*zip(*points), marker="o" if name == "val loss" or len(points) < 3 else None,
                            markersize=4, label=name)
            if not any(self.history.get(name) for name in names):
                ax.text(0.5, 0.5, "not recorded", ha="center", va="center", transform=ax.transAxes, color="gray")
            if len(names) > 1 and ax.get_legend_handles_labels()[0]:  # an empty legend is a matplotlib warning
                ax.legend()
            if title == "dead experts":  # a share: 0 at the bottom even when nothing died
                top = max([0.1] + [1.1 * v for _, v in self.history.get("dead experts", [])])
                ax.set_ylim(-0.02 * top, top)
            ax.xaxis.set_major_formatter(FuncFormatter(token_count))
            ax.set_title(title)
            ax.set_xlabel("tokens seen")
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3)
        fig.suptitle(f"Training curves at step {step}")
        return fig

    def draw(self, trainer: L.Trainer) -> None:
        log_dir = trainer.log_dir  # every rank asks: under a distributed strategy it is a broadcast
        if not trainer.is_global_zero:
            return
        self._collect_expert_window(trainer)
        fig = self.figure(trainer.global_step)
        self.path = Path(log_dir or trainer.default_root_dir) / "training_curves.png"
        write_with(self.path, lambda file: fig.savefig(file, format="png"))
        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger):
                logger.experiment.add_figure("training_curves", fig, trainer.global_step, close=False)


def token_count(tokens: float, _position: int | None = None) -> str:
    """A tick label for a token count in plain units: 0, 950, 20k, 1.5M, 2.1B (never milli-tokens)."""
    tokens = float(f"{tokens:.3g}")  # 999,999 is "1M", not "1e+03k"
    for size, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if abs(tokens) >= size:
            return f"{tokens / size:.3g}{suffix}"
    return f"{tokens:.3g}"
