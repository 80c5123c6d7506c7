"""One rank of the FSDP2 offload check (launched by tests/training/test_activation_offload.py through ``run_ranks``).

Trains the same tiny MoE twice under ``MoEFSDPStrategy`` (gloo, CPU, expert parallel): once plain, once
with ActivationOffload applied at ``on_fit_start`` after sharding. Prints one JSON line: whether every
step's loss and every final parameter shard match bit for bit, the offload order, and the expert-load
metrics (synchronised across ranks by torchmetrics).
"""

import json
import sys

import lightning as L
import torch

from moe_lightning import MoEConfig, MoELanguageModel
from moe_lightning.training.callbacks import ActivationOffload, ExpertLoadMonitor
from moe_lightning.training.strategy import MoEFSDPStrategy

# A large bias_update_rate makes routing change every step: recomputation must still match the forward.
CONFIG = MoEConfig(vocab_size=64, dim=32, n_layers=3, n_heads=4, n_kv_heads=2, max_seq_len=16, ffn_hidden=64,
                   n_dense_layers=1, num_experts=4, top_k=2, expert_hidden=32, aux_loss_coef=0.01,
                   bias_update_rate=0.05)


class Losses(L.Callback):
    def __init__(self):
        self.losses = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(outputs["loss"].detach().clone())


def fit(callbacks: list[L.Callback], expert_parallel_size: int) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    L.seed_everything(0, verbose=False)
    losses = Losses()
    strategy = MoEFSDPStrategy(expert_parallel_size=expert_parallel_size)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=2, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                        callbacks=[losses, *callbacks], precision="32-true")
    model = MoELanguageModel(CONFIG)
    generator = torch.Generator().manual_seed(trainer.global_rank)
    data = torch.randint(0, CONFIG.vocab_size, (4, 17), generator=generator)
    trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=2))
    return losses.losses, {name: p.to_local().clone() for name, p in model.named_parameters()}


def main() -> None:
    torch.set_num_threads(1)
    ep = int(sys.argv[1])
    reference_losses, reference_params = fit([], ep)
    offload = ActivationOffload(prefetch=1, min_offload_bytes=0, blocks=[0, 1, 2])
    expert_load = ExpertLoadMonitor(log_every_n_steps=2, image_every_n_steps=0)
    losses, params = fit([offload, expert_load], ep)
    print(json.dumps({
        "rank": torch.distributed.get_rank(), "steps": len(losses),
        "losses_equal": len(losses) == len(reference_losses) and all(map(torch.equal, losses, reference_losses)),
        "params_equal": params.keys() == reference_params.keys()
        and all(torch.equal(params[k], reference_params[k]) for k in params),
        "order": offload.order, "tensors_out": offload.tensors_offloaded, "expert_load": expert_load.last_metrics}))


if __name__ == "__main__":
    main()
