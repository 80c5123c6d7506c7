"""Learning-rate schedule: linear warmup then cosine decay to a floor."""

import math

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR


class WarmupCosineLR(LambdaLR):
    """Linear warmup over ``warmup_steps``, cosine decay to ``min_lr_ratio`` × base LR at ``total_steps``.

    Args:
        optimizer: The wrapped optimizer.
        warmup_steps: Steps of linear warmup from 0.
        total_steps: Step at which the floor is reached; ``None`` lets the LightningModule fill in the
            trainer's estimated number of optimizer steps before training starts.
        min_lr_ratio: Final LR as a fraction of the base LR.
    """

    def __init__(self, optimizer: Optimizer, warmup_steps: int = 100, total_steps: int | None = None,
                 min_lr_ratio: float = 0.1):
        if warmup_steps < 0:
            raise ValueError(f"WarmupCosineLR.warmup_steps={warmup_steps} must be >= 0.")
        if not 0 <= min_lr_ratio <= 1:
            raise ValueError(f"WarmupCosineLR.min_lr_ratio={min_lr_ratio} must be in [0, 1].")
        self.warmup_steps, self.total_steps, self.min_lr_ratio = warmup_steps, total_steps, min_lr_ratio
        super().__init__(optimizer, self.lr_factor)

    def lr_factor(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        total = self.total_steps if self.total_steps is not None else step + 1
        progress = min(1.0, (step - self.warmup_steps) / max(1, total - self.warmup_steps))
        return self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
