"""What the monitoring callbacks share: their own step interval, and writing straight to the loggers."""

import lightning as L

from moe_lightning.training.lightning_internals import optimizer_step_ends


def check_interval(owner: str, name: str, value: int) -> int:
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"{owner}({name}={value!r}): must be a positive integer.")
    return value


class StepInterval:
    """True once per optimizer step that is a multiple of ``every`` (not once per accumulated micro-batch)."""

    def __init__(self, every: int):
        self.every = every

    def due(self, trainer: L.Trainer) -> bool:
        return optimizer_step_ends(trainer) and trainer.global_step % self.every == 0


def log_to_loggers(trainer: L.Trainer, metrics: dict[str, float]) -> None:
    """Bypasses ``self.log``: Lightning would drop values logged off its own ``log_every_n_steps`` grid."""
    for logger in trainer.loggers:
        logger.log_metrics(metrics, step=trainer.global_step)
