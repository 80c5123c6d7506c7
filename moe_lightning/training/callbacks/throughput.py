"""Tokens/s per device and MFU from the analytic MoE FLOPs count, logged every N steps from the first."""

import time
from typing import Optional

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_warn

from moe_lightning.planner.flops import (attended_pairs_BS, attention_flops_per_pair, cp_key_upprojection_flops_per_token,
                                         dense_flops_per_token, peak_bf16_flops)
from moe_lightning.model import MoEConfig
from moe_lightning.training.callbacks._logging import StepInterval, check_interval, log_to_loggers

class MoEThroughputMonitor(L.Callback):
    """Tokens/s per device and model FLOPs utilisation for MoE models.

    Lightning's ``ThroughputMonitor`` needs ``flops_per_batch`` (``measure_flops`` counts 0 for the
    grouped expert matmuls), a device it knows, and a 100-batch window; this one counts FLOPs from the
    config (6 × active parameters + attention) and reports from the first interval on.

    Attention is counted over the (query, key) pairs each batch actually scores: with document masking only
    within documents (``flops.attended_pairs_BS``). The count is summed on the batch's device and read once
    per logging interval, where the timing synchronizes anyway: no host read per step.

    Under context parallelism (``trainer.strategy.context_parallel_size`` N) the N ranks of a group read the same
    batch and each computes 1/N of its tokens and attended pairs: a device counts its share, so a token is counted
    once in the world's tokens/s. Each rank also up-projects every gathered key (MLA's ``wkv_b``), the FLOPs ``plan``
    adds for CP (``flops.cp_key_upprojection_flops_per_token``): counted too, so the MFU measured is the one planned.
    A pipeline's P stages also read one batch, each running about 1/P of the layers: a device counts 1/(N·P) of
    the batch, so tokens are counted once and the FLOPs per device are the world's mean (stages are not equal).

    Args:
        log_every_n_steps: Optimizer steps per measurement interval.
        peak_flops: Peak FLOP/s of one device; ``None`` looks the GPU up in ``flops.PEAK_BF16_FLOPS`` (dense
            bf16). Set it for other precisions or devices; without it no MFU is logged.
    """

    def __init__(self, log_every_n_steps: int = 10, peak_flops: Optional[float] = None):
        self.interval = StepInterval(check_interval("MoEThroughputMonitor", "log_every_n_steps", log_every_n_steps))
        if peak_flops is not None and peak_flops <= 0:
            raise ValueError(f"MoEThroughputMonitor(peak_flops={peak_flops!r}): must be > 0 FLOP/s per device "
                             "(e.g. 989e12 for H100/H200 bf16), or null to look the GPU up.")
        self.peak_flops = peak_flops
        self._config: Optional[MoEConfig] = None
        self._dense_per_token = 0
        self._per_pair = 0
        self._cp = 1  # ranks sharing each sequence
        self._share = 1  # ranks reading each batch: a CP group, times a pipeline's stages
        self._tokens = 0
        self._pairs: Optional[torch.Tensor] = None  # attended pairs since the last log, on the batch's device
        self._started: Optional[float] = None
        self._paused: Optional[float] = None
        self.last_metrics: dict[str, float] = {}

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._config = getattr(pl_module, "config", None)
        if not isinstance(self._config, MoEConfig):
            raise ValueError(f"MoEThroughputMonitor needs {type(pl_module).__name__}.config to be a MoEConfig "
                             "(the FLOPs count is analytic).")
        self._cp = getattr(trainer.strategy, "context_parallel_size", 1)
        self._share = self._cp * getattr(trainer.strategy, "pipeline_parallel_size", 1)  # ranks reading each batch
        # a reused callback may see another model
        self._dense_per_token = dense_flops_per_token(self._config) + cp_key_upprojection_flops_per_token(
            self._config, self._cp)
        self._per_pair = attention_flops_per_pair(self._config)
        if self.peak_flops is None and pl_module.device.type == "cuda":
            name = torch.cuda.get_device_name(pl_module.device)
            self.peak_flops = peak_bf16_flops(name)
            if self.peak_flops is None:
                rank_zero_warn(f"MoEThroughputMonitor: no peak FLOP/s known for {name!r}; MFU is not logged. "
                               "Set peak_flops (FLOP/s per device) to log it.")

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self._started is None:
            self._started = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if not isinstance(batch, torch.Tensor) or batch.ndim != 2:
            raise ValueError("MoEThroughputMonitor expects token batches of shape [batch, seq_len + 1] "
                             f"(inputs and shifted targets); got {type(batch).__name__}.")
        self._tokens += batch.shape[0] * (batch.shape[1] - 1) // self._share  # this rank's share of its batch
        eod = self._config.eod_token_id if self._config.document_masking else None
        pairs = attended_pairs_BS(batch[:, :-1], eod).sum()
        self._pairs = pairs if self._pairs is None else self._pairs + pairs
        if not self.interval.due(trainer):
            return
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)
        now = time.perf_counter()
        seconds = now - self._started
        flops = self._tokens * self._dense_per_token + self._per_pair * int(self._pairs.item()) / self._share
        metrics = {"perf/tokens_per_sec_per_device": self._tokens / seconds,
                   "perf/tokens_per_sec": self._tokens * trainer.world_size / seconds,
                   "perf/tflops_per_device": flops / seconds / 1e12}
        if self.peak_flops is not None:
            metrics["perf/mfu"] = flops / seconds / self.peak_flops
        log_to_loggers(trainer, metrics)
        self.last_metrics = metrics
        self._tokens, self._pairs, self._started = 0, None, now

    def on_validation_start(self, trainer, pl_module) -> None:
        if self._started is not None:
            self._paused = time.perf_counter()

    def on_validation_end(self, trainer, pl_module) -> None:
        if self._paused is not None:  # validation time is not training throughput
            self._started += time.perf_counter() - self._paused
            self._paused = None
