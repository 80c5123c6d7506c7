"""A test-only callback for ``moe-lightning fit`` runs of several expert-parallel groups (added by class_path):
records the world-mean loss of every optimizer step, saves checkpoints after chosen steps, and after the first step
the bytes each rank actually holds of sharded parameters, gradients and optimizer state.

    moe-lightning fit ... --trainer.callbacks+=tests.launchers.ep_fit_probe.EPFitProbe \\
        --trainer.callbacks.out=run.json --trainer.callbacks.save_at_steps=[2]
"""

import json
from pathlib import Path
from typing import Optional

import lightning as L
import torch
import torch.distributed as dist


def local_bytes(tensor: torch.Tensor | None) -> int:
    """Bytes of this rank's piece: a DTensor's local shard, else the tensor."""
    if tensor is None:
        return 0
    tensor = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return tensor.numel() * tensor.element_size()


class EPFitProbe(L.Callback):
    """Rank 0 writes ``{"rows": [{"step", "loss"}...], "held": [per rank {"parameters", "gradients",
    "optimizer_state", "messages"}]}`` after every step (a killed run keeps its record)."""

    def __init__(self, out: str, save_at_steps: Optional[list[int]] = None):
        self.out, self.save_at_steps = Path(out), save_at_steps or []
        self.rows: list[dict] = []
        self.held: list[dict] | None = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        loss = outputs["loss"].detach().float().clone()
        world = dist.get_world_size() if dist.is_initialized() else 1
        if world > 1:
            dist.all_reduce(loss)
        self.rows.append({"step": trainer.global_step, "loss": loss.item() / world})
        if self.held is None:  # after the first optimizer step: its gradients are still there
            params = [p for p in pl_module.parameters()]
            state = [t for s in trainer.optimizers[0].state.values() for t in s.values()
                     if isinstance(t, torch.Tensor) and t.dim() > 0]  # AdamW's moments (not its step counts)
            mine = {"parameters": sum(local_bytes(p) for p in params),
                    "gradients": sum(local_bytes(p.grad) for p in params),
                    "optimizer_state": sum(local_bytes(t) for t in state)}
            self.held = [None] * world
            if world > 1:
                dist.all_gather_object(self.held, mine)
            else:
                self.held = [mine]
        if trainer.is_global_zero:
            self.out.write_text(json.dumps({"rows": self.rows, "held": self.held}))
        if trainer.global_step in self.save_at_steps:
            trainer.save_checkpoint(self.out.with_name(f"step={trainer.global_step}.ckpt"))
