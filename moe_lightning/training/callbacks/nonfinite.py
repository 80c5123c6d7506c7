"""Stop a diverging run: a NaN/Inf loss ends training with the step and the fixes, and is never checkpointed."""

import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from torch.distributed.tensor import DTensor

from moe_lightning.training.lightning_internals import optimizer_step_ends
from moe_lightning.training.callbacks._logging import check_interval

FIXES = ("lower the learning rate (model.init_args.optimizer.init_args.lr), clip gradients "
         "(trainer.gradient_clip_val: 1.0), or train in bf16-mixed rather than 16-mixed")


class NonFiniteLossError(RuntimeError):
    """Training produced a NaN or infinite loss (or weights)."""


class NonFiniteGuard(Callback):
    """Counts non-finite training losses on the device (no host sync per step) and looks at the count every
    ``check_every_n_steps`` optimizer steps, at the end of training and before every checkpoint save; a save
    also checks every tensor it would write. Any of these raises ``NonFiniteLossError`` on all ranks.

    ``MoELanguageModel`` adds one automatically. ``ModelCheckpoint(save_weights_only=True)`` gives callbacks
    no hook before its save, so with one present the count is read every step.

    Args:
        check_every_n_steps: Steps between checks; ``None``: the trainer's ``log_every_n_steps``.
    """

    def __init__(self, check_every_n_steps: int | None = None):
        self.check_every_n_steps = None if check_every_n_steps is None else \
            check_interval("NonFiniteGuard", "check_every_n_steps", check_every_n_steps)
        self._bad: torch.Tensor | None = None  # on device: [non-finite losses seen, -(first step with one)]
        self._step, self._last_save_step = 0, None

    def on_train_start(self, trainer, pl_module) -> None:
        self._bad = torch.tensor([0, _NONE], dtype=torch.long, device=pl_module.device)
        self._every = self.check_every_n_steps or max(1, trainer.log_every_n_steps)
        if any(getattr(cb, "save_weights_only", False) for cb in trainer.checkpoint_callbacks):
            self._every = 1

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._step = trainer.global_step  # optimizer steps taken before this micro-batch (as train/loss logs it)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        if loss is None:
            return
        bad = ~torch.isfinite(loss.detach()).all()
        self._bad[0] += bad
        self._bad[1].masked_fill_(bad & (self._bad[1] == _NONE), -self._step)  # all on device: no host sync
        if optimizer_step_ends(trainer) and trainer.global_step % self._every == 0:  # just stepped
            self._raise_if_bad(trainer)

    def on_train_end(self, trainer, pl_module) -> None:
        self._raise_if_bad(trainer)

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        self._raise_if_bad(trainer, " before a checkpoint was saved")
        tensors = [t for t in _tensors([checkpoint.get("state_dict"), checkpoint.get("optimizer_states")])
                   if t.is_floating_point()]
        bad = torch.stack([(~torch.isfinite(t)).any().to(pl_module.device) for t in tensors]).any().long() if tensors \
            else torch.zeros((), dtype=torch.long, device=pl_module.device)
        if _max_over_ranks(bad.reshape(1))[0]:
            raise NonFiniteLossError(
                f"Not saving the checkpoint of step {trainer.global_step}: it holds NaN or infinite weights or "
                f"optimizer state although the losses checked were finite (a gradient overflowed). "
                f"{self._kept()}Fix: {FIXES}.")
        self._last_save_step = trainer.global_step

    def _raise_if_bad(self, trainer, when: str = "") -> None:
        if self._bad is None:
            return
        count, neg_first = (int(v) for v in _max_over_ranks(self._bad.clone()))
        if count:
            raise NonFiniteLossError(
                f"The training loss became NaN or infinite at step {-neg_first}{when} ({count} non-finite "
                f"micro-batch loss(es) by step {trainer.global_step}): the run diverged. {self._kept()}"
                f"Fix: {FIXES}; then resume from the last good checkpoint.")

    def _kept(self) -> str:
        if self._last_save_step is None:
            return "No checkpoint of this run was written. "
        return f"The checkpoints saved up to step {self._last_save_step}, before it, are kept. "


_NONE = -(2 ** 62)  # "no non-finite loss yet" in the negated first-step slot (a MAX over ranks keeps the earliest)


def _tensors(tree) -> list[torch.Tensor]:
    if isinstance(tree, DTensor):
        return [tree.to_local()]
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        return [t for v in tree.values() for t in _tensors(v)]
    if isinstance(tree, (list, tuple)):
        return [t for v in tree for t in _tensors(v)]
    return []


def _max_over_ranks(values: torch.Tensor) -> list[int]:
    """Element-wise max over all ranks, read back to the host: the one sync (and one collective) of a check."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return values.tolist()
