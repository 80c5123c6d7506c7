"""One rank of two MoEFSDPStrategy checks (launched by tests/training/test_strategy.py through ``run_ranks``); rank 0 prints
one JSON line.

``accumulate``: one optimizer step of 2 micro-batches (1 row each per rank), default strategy and then
``accumulate_unsharded_grads=True``. Records, after the first micro-batch's backward, whether every parameter's
``.grad`` is its local shard and how many bytes of unsharded gradient FSDP holds; before the optimizer step, the
largest error of the accumulated gradients against plain autograd on one model over the concatenated global batch.

``validate-fit``: ``trainer.validate`` then ``trainer.fit`` on the same trainer, with Lightning's backend test made
to answer "not gloo", as it does on NCCL (then Lightning picks ``torch.inference_mode`` for a standalone validate).
"""

import json
import sys

import lightning as L
import lightning.pytorch.loops.utilities as loop_utilities
import torch
from torch.distributed.fsdp import FSDPModule
from torch.utils.data import DataLoader

from moe_lightning import MoEConfig, MoELanguageModel
from moe_lightning.training.strategy import MoEFSDPStrategy

CONFIG = MoEConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=16, ffn_hidden=48,
                   n_dense_layers=1, num_experts=4, top_k=2, expert_hidden=40, init_std=0.3)
ROWS = torch.randint(0, CONFIG.vocab_size, (4, 17), generator=torch.Generator().manual_seed(0))  # the global batch


def unsharded_grad_bytes(model: torch.nn.Module) -> int:
    """Bytes of unsharded gradient FSDP2 holds between backwards (the accumulation buffers of ``no_sync``)."""
    total = 0
    for module in model.modules():
        group = module._get_fsdp_state()._fsdp_param_group if isinstance(module, FSDPModule) else None
        for fsdp_param in group.fsdp_params if group is not None else []:
            grads = [fsdp_param.unsharded_accumulated_grad]
            if hasattr(fsdp_param, "_unsharded_param"):
                grads.append(fsdp_param._unsharded_param.grad)
            total += sum(g.numel() * g.element_size() for g in grads if g is not None)
    return total


class Accumulation(L.Callback):
    def on_train_start(self, trainer, pl_module):
        model = pl_module.model
        self.initial = {name: p.full_tensor() for name, p in model.named_parameters()} | dict(model.named_buffers())

    def on_after_backward(self, trainer, pl_module):
        if trainer.fit_loop.epoch_loop.batch_idx == 0:  # between the two micro-batches
            params = list(pl_module.model.parameters())
            self.local_grads = sum(p.grad is not None and p.grad.to_local().shape == p.to_local().shape
                                   for p in params)
            self.params, self.unsharded_bytes = len(params), unsharded_grad_bytes(pl_module.model)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        grads = {name: p.grad.full_tensor() for name, p in pl_module.model.named_parameters()}
        reference = MoELanguageModel(CONFIG)  # one process, plain autograd, the whole global batch at once
        reference.configure_model()
        reference.model.load_state_dict(self.initial)
        reference._loss(ROWS).backward()
        self.max_error = max(((grads[name] - p.grad).abs().max() / p.grad.abs().max()).item()
                             for name, p in reference.model.named_parameters())


def accumulate(unsharded: bool) -> dict:
    L.seed_everything(0, verbose=False)
    record = Accumulation()
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=MoEFSDPStrategy(accumulate_unsharded_grads=unsharded),
                        max_steps=1, accumulate_grad_batches=2, use_distributed_sampler=False, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                        limit_val_batches=0, num_sanity_val_steps=0, callbacks=[record], precision="32-true")
    rank = trainer.global_rank
    trainer.fit(MoELanguageModel(CONFIG), DataLoader(ROWS[2 * rank:2 * rank + 2], batch_size=1))
    return {"local_grads": record.local_grads, "params": record.params, "unsharded_bytes": record.unsharded_bytes,
            "max_error": record.max_error}


class InferenceModeSeen(L.Callback):
    def __init__(self):
        self.seen = []

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        self.seen.append(torch.is_inference_mode_enabled())


def validate_then_fit() -> dict:
    loop_utilities._distributed_is_initialized = lambda: False  # the backend test answers "not gloo"
    L.seed_everything(0, verbose=False)
    seen = InferenceModeSeen()
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=MoEFSDPStrategy(), max_steps=3, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                        val_check_interval=2, limit_val_batches=1, num_sanity_val_steps=0, callbacks=[seen],
                        precision="32-true")
    model = MoELanguageModel(CONFIG)
    loader = DataLoader(ROWS, batch_size=1)
    validated = trainer.validate(model, loader, verbose=False)[0]["val/loss"]
    trainer.fit(model, loader, loader)  # trains after the validation, validates (inside fit) and trains on
    return {"validated_loss": validated, "global_step": trainer.global_step, "inference_mode": seen.seen,
            "train_loss": trainer.callback_metrics["train/loss"].item()}


def main() -> None:
    torch.set_num_threads(1)
    mode = sys.argv[1]
    if mode == "accumulate":
        out = {"sharded": accumulate(False), "unsharded": accumulate(True)}
    else:
        out = validate_then_fit()
    if torch.distributed.get_rank() == 0:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
