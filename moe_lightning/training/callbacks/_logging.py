"""What the monitoring callbacks share: their own step interval, writing straight to the loggers, and what every
rank holds (under pipeline stages each rank holds some layers of the model)."""

import lightning as L
import torch.distributed as dist

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


def every_rank(local: list) -> list[list]:
    """Every rank's ``local`` list, in rank order (one ``all_gather_object``: call it on every rank, at fit start);
    ``[local]`` in one process."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return [local]
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, local)
    return everyone
