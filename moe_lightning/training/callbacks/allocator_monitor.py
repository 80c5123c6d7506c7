"""CUDA caching-allocator health: peaks, fragmentation, retries and OOMs per logging interval."""

from typing import Optional

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_warn

from moe_lightning.training.callbacks._logging import StepInterval, check_interval, log_to_loggers

GIB = float(1 << 30)
RETRY_ADVICE = (
    "the CUDA caching allocator had to free its cache and retry ({retries} times in the last {steps} steps): "
    "memory is fragmented or nearly full, which stalls every step. Remedies, cheapest first: let FSDP2's "
    "all-gathers allocate from the compute stream's pool (MoEFSDPStrategy unshard_async_op: true; plain "
    "fully_shard modules: _set_unshard_async_op(True)); add moe_lightning.training.callbacks.ActivationOffload; lower "
    "data.batch_size (micro-batch) and raise trainer.accumulate_grad_batches; set "
    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True."
)


def read_cuda_memory_stats(device: torch.device) -> Optional[dict[str, int]]:
    """The allocator's counters for ``device``, or None when it is not a CUDA device."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return torch.cuda.memory_stats(device)


class AllocatorMonitor(L.Callback):
    """Logs the CUDA allocator's state every ``log_every_n_steps`` and warns once when it starts retrying.

    Per interval: ``memory/peak_allocated_gib``, ``memory/peak_reserved_gib`` (peaks are reset after each
    log), ``memory/reserved_minus_allocated_gib`` (cached but unused now: fragmentation and side-stream
    pools), ``memory/alloc_retries`` and ``memory/ooms`` (new in the interval). Without CUDA it does nothing.

    Args:
        log_every_n_steps: Optimizer steps per interval.
    """

    def __init__(self, log_every_n_steps: int = 10):
        self.interval = StepInterval(check_interval("AllocatorMonitor", "log_every_n_steps", log_every_n_steps))
        self._retries = self._ooms = 0
        self.warned = False

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if pl_module.device.type != "cuda" or not self.interval.due(trainer):
            return  # read the allocator's ~100 statistics only when a log is due
        stats = read_cuda_memory_stats(pl_module.device)
        if stats is None:
            return
        retries, ooms = stats.get("num_alloc_retries", 0), stats.get("num_ooms", 0)
        new_retries, new_ooms = retries - self._retries, ooms - self._ooms
        self._retries, self._ooms = retries, ooms
        log_to_loggers(trainer, {
            "memory/peak_allocated_gib": stats.get("allocated_bytes.all.peak", 0) / GIB,
            "memory/peak_reserved_gib": stats.get("reserved_bytes.all.peak", 0) / GIB,
            "memory/reserved_minus_allocated_gib": (stats.get("reserved_bytes.all.current", 0)
                                                    - stats.get("allocated_bytes.all.current", 0)) / GIB,
            "memory/alloc_retries": float(new_retries),
            "memory/ooms": float(new_ooms)})
        torch.cuda.reset_peak_memory_stats(pl_module.device)
        if new_retries > 0 and not self.warned:
            self.warned = True
            rank_zero_warn("AllocatorMonitor: " + RETRY_ADVICE.format(retries=new_retries, steps=self.interval.every))
