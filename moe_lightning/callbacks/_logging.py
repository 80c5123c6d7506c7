"""What the monitoring callbacks share: their own step interval, and writing straight to the loggers."""

import lightning as L


def check_interval(owner: str, name: str, value: int) -> int:
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"{owner}({name}={value!r}): must be a positive integer.")
    return value


class StepInterval:
    """True once per optimizer step that is a multiple of ``every`` (not once per accumulated micro-batch)."""

    def __init__(self, every: int):
        self.every = every
        self._last_step = 0

    def due(self, trainer: L.Trainer) -> bool:
        step = trainer.global_step
        if step == self._last_step:
            return False
        self._last_step = step
        return step % self.every == 0


def log_to_loggers(trainer: L.Trainer, metrics: dict[str, float]) -> None:
    """Bypasses ``self.log``: Lightning would drop values logged off its own ``log_every_n_steps`` grid."""
    for logger in trainer.loggers:
        logger.log_metrics(metrics, step=trainer.global_step)


def logs_written(trainer: L.Trainer) -> bool:
    """Whether Lightning writes what ``self.log`` receives in this training batch: the optimizer step's last
    micro-batch on the ``log_every_n_steps`` grid (its ``update_train_step_metrics``). Log per-step numbers only
    then: each Python number logged becomes a device tensor through a blocking host-to-device copy."""
    return not trainer.fit_loop._should_accumulate() and bool(trainer._logger_connector.should_update_logs
                                                              or trainer.fast_dev_run)
