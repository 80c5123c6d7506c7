"""Tokens/s per device and MFU from the analytic MoE FLOPs count, logged every N steps from the first."""

import time
from typing import Optional

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_warn

from ..flops import PEAK_BF16_FLOPS, peak_bf16_flops, training_flops_per_token  # noqa: F401 (re-exported)
from ..model import MoEConfig
from ._logging import StepInterval, check_interval, log_to_loggers

class MoEThroughputMonitor(L.Callback):
    """Tokens/s per device and model FLOPs utilisation for MoE models.

    Lightning's ``ThroughputMonitor`` needs ``flops_per_batch`` (``measure_flops`` counts 0 for the
    grouped expert matmuls), a device it knows, and a 100-batch window; this one counts FLOPs from the
    config (6 × active parameters + attention) and reports from the first interval on.

    Args:
        log_every_n_steps: Optimizer steps per measurement interval.
        peak_flops: Peak FLOP/s of one device; ``None`` looks the GPU up in ``PEAK_BF16_FLOPS`` (dense
            bf16). Set it for other precisions or devices; without it no MFU is logged.
    """

    def __init__(self, log_every_n_steps: int = 10, peak_flops: Optional[float] = None):
        self.interval = StepInterval(check_interval("MoEThroughputMonitor", "log_every_n_steps", log_every_n_steps))
        if peak_flops is not None and peak_flops <= 0:
            raise ValueError(f"MoEThroughputMonitor(peak_flops={peak_flops!r}): must be > 0 FLOP/s per device "
                             "(e.g. 989e12 for H100/H200 bf16), or null to look the GPU up.")
        self.peak_flops = peak_flops
        self._config: Optional[MoEConfig] = None
        self._flops_per_token: dict[int, float] = {}
        self._tokens = 0
        self._flops = 0.0
        self._started: Optional[float] = None
        self._paused: Optional[float] = None
        self.last_metrics: dict[str, float] = {}

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._config = getattr(pl_module, "config", None)
        self._flops_per_token.clear()  # a reused callback may see another model
        if not isinstance(self._config, MoEConfig):
            raise ValueError(f"MoEThroughputMonitor needs {type(pl_module).__name__}.config to be a MoEConfig "
                             "(the FLOPs count is analytic).")
        if self.peak_flops is None and pl_module.device.type == "cuda":
            name = torch.cuda.get_device_name(pl_module.device)
            self.peak_flops = peak_bf16_flops(name)
            if self.peak_flops is None:
                rank_zero_warn(f"MoEThroughputMonitor: no peak FLOP/s known for {name!r}; MFU is not logged. "
                               "Set peak_flops (FLOP/s per device) to log it.")

    def flops_per_token(self, seq_len: int) -> float:
        if seq_len not in self._flops_per_token:
            self._flops_per_token[seq_len] = training_flops_per_token(self._config, seq_len)
        return self._flops_per_token[seq_len]

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self._started is None:
            self._started = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if not isinstance(batch, torch.Tensor) or batch.ndim != 2:
            raise ValueError("MoEThroughputMonitor expects token batches of shape [batch, seq_len + 1] "
                             f"(inputs and shifted targets); got {type(batch).__name__}.")
        tokens = batch.shape[0] * (batch.shape[1] - 1)
        self._tokens += tokens
        self._flops += tokens * self.flops_per_token(batch.shape[1] - 1)
        if not self.interval.due(trainer):
            return
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)
        now = time.perf_counter()
        seconds = now - self._started
        metrics = {"perf/tokens_per_sec_per_device": self._tokens / seconds,
                   "perf/tokens_per_sec": self._tokens * trainer.world_size / seconds,
                   "perf/tflops_per_device": self._flops / seconds / 1e12}
        if self.peak_flops is not None:
            metrics["perf/mfu"] = self._flops / seconds / self.peak_flops
        log_to_loggers(trainer, metrics)
        self.last_metrics = metrics
        self._tokens, self._flops, self._started = 0, 0.0, now

    def on_validation_start(self, trainer, pl_module) -> None:
        if self._started is not None:
            self._paused = time.perf_counter()

    def on_validation_end(self, trainer, pl_module) -> None:
        if self._paused is not None:  # validation time is not training throughput
            self._started += time.perf_counter() - self._paused
            self._paused = None
