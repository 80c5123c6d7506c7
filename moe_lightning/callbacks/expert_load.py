"""Expert load per MoE layer: imbalance metrics through torchmetrics and a layers × experts heatmap."""

from pathlib import Path

import lightning as L
import numpy as np
import torch
import torchmetrics
from lightning.pytorch.loggers import TensorBoardLogger

from ..model import MoELayer
from ._logging import StepInterval, check_interval, log_to_loggers
from .activation_offload import find_blocks


class ExpertLoad(torchmetrics.Metric):
    """Sums ``[layers, experts]`` token counts (across ranks too); computes per-layer imbalance.

    ``compute`` returns ``max_over_mean`` (1 is perfect balance, ``E / top_k`` is full collapse) and
    ``cv`` (coefficient of variation, population std over mean), both of shape ``[layers]``.
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
        return {"counts": self.counts.clone(), "max_over_mean": counts_LE.max(-1).values / mean_L,
                "cv": counts_LE.std(-1, correction=0) / mean_L}


def load_heatmap(counts_LE: torch.Tensor, cell_pixels: int = 8) -> np.ndarray:
    """RGB ``uint8 [layers·cell, experts·cell, 3]``: white = mean load, red = over, blue = under.

    Colour scales with log2 of load / mean and saturates at 4× over or under.
    """
    counts_LE = counts_LE.double().cpu()
    ratio_LE = counts_LE / counts_LE.mean(-1, keepdim=True).clamp_min(1e-12)
    t_LE = (ratio_LE.clamp_min(1 / 16).log2() / 2).clamp(-1, 1).numpy()
    white, red, blue = np.array([255.0, 255, 255]), np.array([200.0, 30, 30]), np.array([30.0, 60, 200])
    over, under = np.clip(t_LE, 0, 1)[..., None], np.clip(-t_LE, 0, 1)[..., None]
    rgb_LE3 = white + over * (red - white) + under * (blue - white)
    return np.repeat(np.repeat(rgb_LE3, cell_pixels, axis=0), cell_pixels, axis=1).round().astype(np.uint8)


class ExpertLoadMonitor(L.Callback):
    """Logs how evenly each MoE layer spreads its tokens, and pictures it.

    Scalars every ``log_every_n_steps``: ``expert_load/layer{i}/max_over_mean`` and ``.../cv`` per block
    ``i`` of ``model.layers``, plus their means over layers. Every ``image_every_n_steps`` a heatmap (rows:
    MoE layers, columns: experts) goes to TensorBoard as an image, or, with other loggers, to
    ``<log_dir>/expert_load/step_<step>.png``.

    Args:
        log_every_n_steps: Optimizer steps per interval; counts are summed over the interval.
        image_every_n_steps: Steps between heatmaps; a multiple of ``log_every_n_steps`` (0 disables).
        cell_pixels: Side of one layer × expert cell in the picture.
    """

    def __init__(self, log_every_n_steps: int = 50, image_every_n_steps: int = 500, cell_pixels: int = 8):
        self.interval = StepInterval(check_interval("ExpertLoadMonitor", "log_every_n_steps", log_every_n_steps))
        if not isinstance(image_every_n_steps, int) or image_every_n_steps < 0 \
                or image_every_n_steps % log_every_n_steps:
            raise ValueError(f"ExpertLoadMonitor(image_every_n_steps={image_every_n_steps!r}): must be 0 (no images) "
                             f"or a multiple of log_every_n_steps={log_every_n_steps}.")
        self.image_every_n_steps = image_every_n_steps
        self.cell_pixels = check_interval("ExpertLoadMonitor", "cell_pixels", cell_pixels)
        self.metric: ExpertLoad | None = None
        self._moe_layers: list[tuple[int, MoELayer]] = []
        self.last_image_path: Path | None = None
        self.last_metrics: dict[str, float] = {}

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._moe_layers = [(i, m) for i, block in enumerate(find_blocks(pl_module))
                            for m in block.modules() if isinstance(m, MoELayer)]
        if not self._moe_layers:
            raise ValueError("ExpertLoadMonitor: the model has no MoELayer in model.layers; remove the callback "
                             "or set n_dense_layers below n_layers.")
        self.metric = ExpertLoad(len(self._moe_layers), self._moe_layers[0][1].num_experts).to(pl_module.device)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.metric.update(torch.stack([moe.tokens_per_expert for _, moe in self._moe_layers]))
        if not self.interval.due(trainer):
            return
        result = self.metric.compute()
        self.metric.reset()
        metrics = {}
        for row, (index, _) in enumerate(self._moe_layers):
            metrics[f"expert_load/layer{index}/max_over_mean"] = result["max_over_mean"][row].item()
            metrics[f"expert_load/layer{index}/cv"] = result["cv"][row].item()
        metrics["expert_load/max_over_mean"] = result["max_over_mean"].mean().item()
        metrics["expert_load/cv"] = result["cv"].mean().item()
        log_to_loggers(trainer, metrics)
        self.last_metrics = metrics
        if self.image_every_n_steps and trainer.global_step % self.image_every_n_steps == 0 \
                and trainer.is_global_zero:
            self._write_image(trainer, load_heatmap(result["counts"], self.cell_pixels))

    def _write_image(self, trainer: L.Trainer, image_HW3: np.ndarray) -> None:
        tensorboard = [lg for lg in trainer.loggers if isinstance(lg, TensorBoardLogger)]
        for logger in tensorboard:
            logger.experiment.add_image("expert_load/heatmap", image_HW3.transpose(2, 0, 1), trainer.global_step,
                                        dataformats="CHW")
        if not tensorboard:
            from PIL import Image  # only for PNGs: keeps Pillow off the import path of the GPU benchmarks

            folder = Path(trainer.log_dir or trainer.default_root_dir) / "expert_load"
            folder.mkdir(parents=True, exist_ok=True)
            self.last_image_path = folder / f"step_{trainer.global_step:07d}.png"
            Image.fromarray(image_HW3).save(self.last_image_path)
