"""A test-only callback for tests/launchers/pipeline_fit_run.py (``--record``): what each rank sees of a step, to
compare pipeline stages with one stage. Every rank writes ``<out>.rank<r>.json``: per optimizer step the gradient
norm before clipping (over every rank's local gradient shards: no replicas and no embedding copy in these runs),
the logged ``train/`` and ``attention/`` values, and the QKClip and ExpertLoadMonitor callbacks' last results."""

import json
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist

from moe_lightning.training.callbacks import ExpertLoadMonitor, QKClip


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


class StageMetricsProbe(L.Callback):
    def __init__(self, out: str):
        self.out = Path(out)
        self.rows: list[dict] = []
        self._grad_norm: float | None = None

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        copy = trainer.strategy._embedding_copy()  # the last stage's embedding copy: its gradient is the first's
        squares = sum((_local(p.grad).double() ** 2).sum() for p in pl_module.parameters()
                      if p.grad is not None and p is not copy)
        squares = torch.as_tensor(squares, dtype=torch.float64)
        if dist.is_initialized():
            dist.all_reduce(squares)
        self._grad_norm = squares.sqrt().item()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        row = {"step": trainer.global_step, "grad_norm": self._grad_norm,
               "logged": {k: float(v) for k, v in trainer.callback_metrics.items()
                          if k.startswith(("train/", "attention/"))}}
        for callback in trainer.callbacks:
            if isinstance(callback, QKClip):
                row["max_logits"] = callback.last_max_logits.tolist()
                row["gamma"] = callback.last_gamma.tolist()
            if isinstance(callback, ExpertLoadMonitor):
                row["expert_load"] = dict(callback.last_metrics)
                row["heatmap"] = str(callback.last_image_path) if callback.last_image_path else None
        self.rows.append(row)
        rank = dist.get_rank() if dist.is_initialized() else 0
        self.out.with_name(f"{self.out.name}.rank{rank}.json").write_text(json.dumps(self.rows))
