"""One rank of the all-gather count (launched by tests/parallel/test_fsdp.py through ``run_ranks``).

Trains the tiny MoE for 2 steps under ``MoEFSDPStrategy`` (gloo, CPU) with expert parallelism and
ActivationOffload (every block checkpointed and recomputed in backward), and counts FSDP2's all-gathers in each
step's forward and backward. Rank 0 prints one JSON line: per step, the payload bytes of each all-gather in
forward and in backward, and the all-gather payload of every FSDP unit (to name what was gathered).
With ``validate`` as the second argument, the model has one MTP module and rank 0 reports the all-gathers of one
``trainer.validate`` batch instead (MTP runs in training only).
"""

import json
import sys
from contextlib import contextmanager
from dataclasses import replace

import lightning as L
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from moe_lightning import MoEConfig, MoELanguageModel
from moe_lightning.training.callbacks import ActivationOffload
from moe_lightning.training.strategy import MoEFSDPStrategy

CONFIG = MoEConfig(vocab_size=64, dim=32, n_layers=4, n_heads=4, n_kv_heads=2, max_seq_len=16, ffn_hidden=48,
                   n_dense_layers=1, num_experts=4, top_k=2, expert_hidden=40, aux_loss_coef=0.01)
GATHERS = ("all_gather_into_tensor", "all_gather_single")  # what FSDP2 calls, by backend and version


class CountGathers(L.Callback):
    """Payload bytes of every all-gather, split into each step's forward (batch start to ``backward``) and
    backward (``backward`` to its end)."""

    def __init__(self):
        self.steps, self._sizes = [], []

    @contextmanager
    def installed(self):
        originals = {name: getattr(dist, name) for name in GATHERS if hasattr(dist, name)}

        def counted(fn):
            def gather(*args, **kwargs):
                tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
                self._sizes.append(max(t.numel() * t.element_size() for t in tensors))
                return fn(*args, **kwargs)
            return gather
        for name, fn in originals.items():
            setattr(dist, name, counted(fn))
        try:
            yield
        finally:
            for name, fn in originals.items():
                setattr(dist, name, fn)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._sizes = []

    def on_before_backward(self, trainer, pl_module, loss):
        self._forward, self._sizes = self._sizes, []

    def on_after_backward(self, trainer, pl_module):
        self.steps.append({"forward": sorted(self._forward), "backward": sorted(self._sizes)})

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        self._sizes = []

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        self.steps.append({"validation": sorted(self._sizes)})


def unit_sizes(model: torch.nn.Module) -> dict[str, int]:
    """Payload of one all-gather of each FSDP unit that gathers at all (its mesh has more than one rank): its
    parameters' padded fp32 shards from every rank of the mesh."""
    sizes = {}
    for name, module in model.named_modules():
        group = module._get_fsdp_state()._fsdp_param_group if isinstance(module, FSDPModule) else None
        if group is not None and group.mesh_info.shard_mesh_size > 1:
            shards = sum(p._sharded_param_data.numel() for p in group.fsdp_params)
            sizes[name or "<root>"] = shards * group.mesh_info.shard_mesh_size * 4
    return sizes


def main() -> None:
    torch.set_num_threads(1)
    prefetch, validate = int(sys.argv[1]), sys.argv[2:] == ["validate"]
    L.seed_everything(0, verbose=False)
    gathers = CountGathers()
    strategy = MoEFSDPStrategy(expert_parallel_size=2, prefetch_depth=prefetch)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=2, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                        callbacks=[gathers, ActivationOffload(min_offload_bytes=0)], precision="32-true")
    model = MoELanguageModel(replace(CONFIG, mtp_layers=1) if validate else CONFIG)
    data = torch.randint(0, CONFIG.vocab_size, (4, 17), generator=torch.Generator().manual_seed(trainer.global_rank))
    with gathers.installed():
        if validate:
            trainer.validate(model, torch.utils.data.DataLoader(data[:2], batch_size=2), verbose=False)
        else:
            trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=2))
    if trainer.global_rank == 0:
        print(json.dumps({"steps": gathers.steps, "units": unit_sizes(model.model)}))


if __name__ == "__main__":
    main()
