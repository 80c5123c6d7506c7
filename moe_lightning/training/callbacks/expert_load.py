"""Expert load per MoE layer: imbalance, dead experts and load entropy (torchmetrics), and a heatmap figure."""

import math
from pathlib import Path

import lightning as L
import torch
import torchmetrics
from lightning.pytorch.loggers import TensorBoardLogger

from moe_lightning.model import MoELayer
from moe_lightning.training.callbacks._logging import StepInterval, check_interval, every_rank, log_to_loggers
from moe_lightning.training.callbacks.activation_offload import find_blocks

class ExpertLoad(torchmetrics.Metric):
    """Sums ``[layers, experts]`` token counts (across ranks too); computes per-layer balance, each ``[layers]``:

    - ``max_over_mean``: busiest expert's load over the mean (1 is perfect balance, ``E / top_k`` full collapse);
    - ``cv``: coefficient of variation (population std over mean);
    - ``dead_fraction``: share of experts that received no token in the window;
    - ``load_entropy``: entropy of the window's load shares ``p_e = n_e / sum(n)`` over ``log E`` (1 uniform,
      0 one expert; 1 when ``E == 1``, where one expert is all the balance there is).
    """

    full_state_update = False

    def __init__(self, num_layers: int, num_experts: int, **kwargs):
        super().__init__(**kwargs)
        self.add_state("counts", torch.zeros(num_layers, num_experts, dtype=torch.long), dist_reduce_fx="sum")

    def update(self, counts_LE: torch.Tensor) -> None:
        self.counts += counts_LE.to(self.counts)

    def compute(self) -> dict[str, torch.Tensor]:
        counts_LE = self.counts.double()
        mean_L = counts_LE.mean(-1).clamp_min(1e-12)
        share_LE = counts_LE / counts_LE.sum(-1, keepdim=True).clamp_min(1e-12)
        entropy_L = -torch.where(share_LE > 0, share_LE * share_LE.log(), 0.0).sum(-1)
        num_experts = counts_LE.shape[-1]
        load_entropy_L = entropy_L / math.log(num_experts) if num_experts > 1 else torch.ones_like(entropy_L)
        return {"counts": self.counts.clone(), "max_over_mean": counts_LE.max(-1).values / mean_L,
                "cv": counts_LE.std(-1, correction=0) / mean_L, "dead_fraction": (self.counts == 0).double().mean(-1),
                "load_entropy": load_entropy_L}


def model_moe_blocks(local: list[int]) -> list[int]:
    """Block indices of the whole model's MoE layers: the union of every rank's (one ``all_gather_object``, at fit
    start). Under pipeline stages each rank holds some blocks, under their indices in the whole model."""
    return sorted({index for held in every_rank(local) for index in held})


def load_figure(counts_LE: torch.Tensor, layer_ids: list[int], step: int):
    """Layers × experts, coloured by load / mean load on a log scale (red over, blue under, white balanced, clipped
    at 4×); experts that got no token are crossed out. At least 800 px wide at its 100 dpi."""
    from matplotlib.colors import LogNorm  # only when drawing: keeps matplotlib off the GPU benchmarks' imports
    from matplotlib.figure import Figure
    from matplotlib.ticker import FixedFormatter, FixedLocator, NullLocator

    counts_LE = counts_LE.double().cpu()
    num_layers, num_experts = counts_LE.shape
    ratio_LE = counts_LE / counts_LE.mean(-1, keepdim=True).clamp_min(1e-12)
    fig = Figure(figsize=(max(8.0, 2.5 + 0.22 * num_experts), max(3.0, 1.6 + 0.35 * num_layers)), dpi=100,
                 layout="constrained")
    ax = fig.add_subplot()
    image = ax.imshow(ratio_LE.clamp(0.25, 4).numpy(), cmap="RdBu_r", norm=LogNorm(0.25, 4), aspect="auto",
                      interpolation="nearest")
    dead = (counts_LE == 0).nonzero().tolist()
    if dead:
        ax.scatter([e for _, e in dead], [l for l, _ in dead], marker="x", color="black", s=30)
    bar = fig.colorbar(image, ax=ax)
    bar.ax.yaxis.set_major_locator(FixedLocator([0.25, 0.5, 1, 2, 4]))
    bar.ax.yaxis.set_major_formatter(FixedFormatter(["≤¼", "½", "1", "2", "≥4"]))
    bar.ax.yaxis.set_minor_locator(NullLocator())
    bar.set_label("load / mean load")
    ax.set_xlabel("expert")
    ax.set_ylabel("MoE layer (block index)")
    ax.set_yticks(range(num_layers), [str(i) for i in layer_ids])
    if num_experts <= 64:
        ax.set_xticks(range(num_experts))
    ax.set_title(f"Expert load at step {step} (tokens per expert over the logging window; × = no token)")
    return fig


def load_metrics(result: dict[str, torch.Tensor], layers: list[int]) -> dict[str, float]:
    """``expert_load/layer<i>/<statistic>`` per MoE layer and ``expert_load/<statistic>`` over them, read from the
    device in one sync. torchmetrics squeezes a one-element result, so one MoE layer's statistics arrive as
    scalars: each is flattened back to one value per layer."""
    names = ("max_over_mean", "cv", "dead_fraction", "load_entropy")
    values_NL = torch.stack([result[name].reshape(-1) for name in names])
    values_NL = torch.cat([values_NL, values_NL.mean(-1, keepdim=True)], dim=-1).tolist()
    metrics = {}
    for name, values in zip(names, values_NL):
        metrics.update({f"expert_load/layer{index}/{name}": v for index, v in zip(layers, values)})
        metrics[f"expert_load/{name}"] = values[-1]
    return metrics


class ExpertLoadMonitor(L.Callback):
    """Logs how evenly each MoE layer spreads its tokens, and pictures it.

    Scalars every ``log_every_n_steps``, per block ``i`` of ``model.layers`` and as means over layers:
    ``expert_load/layer{i}/max_over_mean``, ``.../cv``, ``.../dead_fraction`` and ``.../load_entropy`` (see
    ``ExpertLoad``). Every ``image_every_n_steps`` a heatmap figure (rows: MoE layers, columns: experts) goes to
    TensorBoard when it logs there and to ``<log_dir>/expert_load/step_<step>.png``. Under pipeline stages the
    scalars and the one heatmap still cover every MoE layer of the model: each rank counts into its own layers'
    rows of a whole-model ``[layers, experts]`` table, zero elsewhere, and the metric's sum over every rank fills
    each row from the ranks of the stage that holds it.

    Args:
        log_every_n_steps: Optimizer steps per interval; counts are summed over the interval.
        image_every_n_steps: Steps between heatmaps; a multiple of ``log_every_n_steps`` (0 disables).
    """

    def __init__(self, log_every_n_steps: int = 50, image_every_n_steps: int = 500):
        self.interval = StepInterval(check_interval("ExpertLoadMonitor", "log_every_n_steps", log_every_n_steps))
        if not isinstance(image_every_n_steps, int) or image_every_n_steps < 0 \
                or image_every_n_steps % log_every_n_steps:
            raise ValueError(f"ExpertLoadMonitor(image_every_n_steps={image_every_n_steps!r}): must be 0 (no images) "
                             f"or a multiple of log_every_n_steps={log_every_n_steps}.")
        self.image_every_n_steps = image_every_n_steps
        self.metric: ExpertLoad | None = None
        self._moe_layers: list[tuple[int, MoELayer]] = []  # (block index in the whole model, layer) of this rank
        self._model_blocks: list[int] = []  # block indices of the whole model's MoE layers
        self._rows: torch.Tensor | None = None  # each local MoE layer's row among them
        self.last_image_path: Path | None = None
        self.last_metrics: dict[str, float] = {}
        self.last_tokens_seen: float | None = None  # the module's tokens_seen when last_metrics were computed

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # a ModuleList's keys are the block indices, and so are a pipeline stage's (parallel.pipeline.StageBlocks)
        self._moe_layers = [(int(key), m) for key, block in find_blocks(pl_module).named_children()
                            for m in block.modules() if isinstance(m, MoELayer)]
        self._model_blocks = model_moe_blocks([index for index, _ in self._moe_layers])
        if not self._model_blocks:
            raise ValueError("ExpertLoadMonitor: the model has no MoELayer in model.layers; remove the callback "
                             "or set n_dense_layers below n_layers.")
        self._rows = torch.tensor([self._model_blocks.index(i) for i, _ in self._moe_layers], dtype=torch.long,
                                  device=pl_module.device)
        num_experts = pl_module.config.num_experts if not self._moe_layers else self._moe_layers[0][1].num_experts
        self.metric = ExpertLoad(len(self._model_blocks), num_experts).to(pl_module.device)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        model_counts_LE = torch.zeros_like(self.metric.counts)  # a stage of dense blocks only adds nothing
        if self._moe_layers:
            counts_LE = torch.stack([moe.tokens_per_expert for _, moe in self._moe_layers])
            model_counts_LE.index_copy_(0, self._rows, counts_LE.to(model_counts_LE))
        self.metric.update(model_counts_LE)
        if not self.interval.due(trainer):
            return
        result = self.metric.compute()
        self.metric.reset()
        metrics = load_metrics(result, self._model_blocks)
        log_to_loggers(trainer, metrics)
        self.last_metrics = metrics
        self.last_tokens_seen = float(getattr(pl_module, "tokens_seen", trainer.global_step))
        if self.image_every_n_steps and trainer.global_step % self.image_every_n_steps == 0:
            log_dir = trainer.log_dir  # every rank asks: under a distributed strategy it is a broadcast
            if trainer.is_global_zero:
                self._write_figure(trainer, log_dir, load_figure(result["counts"], self._model_blocks,
                                                                 trainer.global_step))

    def _write_figure(self, trainer: L.Trainer, log_dir: str | None, fig) -> None:
        folder = Path(log_dir or trainer.default_root_dir) / "expert_load"
        folder.mkdir(parents=True, exist_ok=True)
        self.last_image_path = folder / f"step_{trainer.global_step:07d}.png"
        fig.savefig(self.last_image_path)
        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger):
                logger.experiment.add_figure("expert_load/heatmap", fig, trainer.global_step, close=False)
