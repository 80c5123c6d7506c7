"""One training step of configs/tiny-fsdp.yaml's model at 2 pipeline stages (or ``--stages-per-rank`` V per rank) on
2 gloo processes, recording what each rank holds of FSDP's gathered parameters and unsharded gradients while
torch's schedule runs, for tests/planner/test_pipeline_gathered.py (``plan``'s "gathered stages" and "unsharded
gradients" rows). Run under ``torch.distributed.run``; rank 0 writes ``--out``.

Counted on the FSDP parameters themselves: an unsharded parameter's storage is allocated from its all-gather (at
one rank per stage, torch 2.13 copies the shard into it) until FSDP frees it on reshard, and its unsharded
gradient (``.grad`` of the unsharded parameter, or FSDP's accumulated one) lives until the reduction. Sampled after
every completed all-gather (``FSDPParamGroup.wait_for_unshard``: gathered bytes only grow there), after every
forward and backward action of the schedule, and before each stage's gradient reduction."""

import argparse
import functools
import json
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
import yaml
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
from torch.distributed.pipelining.stage import _PipelineStageBase

from moe_lightning import MoEConfig, MoELanguageModel, TextDataModule
from moe_lightning.training.strategy import MoEFSDPStrategy

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "tiny-fsdp.yaml"


def _nbytes(tensor: torch.Tensor | None) -> int:
    return 0 if tensor is None else tensor.numel() * tensor.element_size()


class GatheredProbe(L.Callback):
    """Patches FSDP's and the pipeline stage's methods for the first training step and records each rank's most
    gathered parameter bytes (with how many of its stages were wholly gathered then), the most stages wholly
    gathered at once, the most unsharded gradient bytes, and the parameter elements all-gathered in the step; rank 0
    writes them for every rank."""

    def __init__(self, out: str):
        self.out = Path(out)
        self.peak = {"gathered_bytes": 0, "stages_at_peak": 0, "most_stages": 0, "gradient_bytes": 0,
                     "all_gathered_elements": 0}
        self._undo: list = []

    def _groups_by_stage(self, pl_module) -> list[list]:
        parts = getattr(pl_module.model, "pipeline_parts", None) or [pl_module.model]
        stages = []
        for part in parts:
            groups = {id(g): g for m in part.modules() if isinstance(m, FSDPModule)
                      if (g := m._get_fsdp_state()._fsdp_param_group) is not None}
            stages.append(list(groups.values()))
        return stages

    def _sample(self) -> None:
        counted, gathered, gradients, whole = set(), 0, 0, 0

        def count(tensor: torch.Tensor) -> bool:  # whether it holds memory (each storage counted once)
            nonlocal gathered
            storage = tensor.untyped_storage()
            if storage.nbytes() and storage.data_ptr() not in counted:
                counted.add(storage.data_ptr())
                gathered += _nbytes(tensor)
            return storage.nbytes() > 0

        for groups in self.stages:
            held = []
            for group in groups:  # an all-gather issued and not yet copied out holds its output buffer
                pending = getattr(group, "_all_gather_result", None)
                in_flight = pending is not None and pending.all_gather_output is not None and \
                    count(pending.all_gather_output)
                for p in group.fsdp_params:
                    unsharded = getattr(p, "_unsharded_param", None)
                    held.append(in_flight or (unsharded is not None and count(unsharded)))
                    if unsharded is not None:
                        gradients += _nbytes(unsharded.grad)
                    gradients += _nbytes(getattr(p, "unsharded_accumulated_grad", None))
            whole += bool(held) and all(held)
        if gathered > self.peak["gathered_bytes"]:
            self.peak["gathered_bytes"], self.peak["stages_at_peak"] = gathered, whole
        self.peak["most_stages"] = max(self.peak["most_stages"], whole)
        self.peak["gradient_bytes"] = max(self.peak["gradient_bytes"], gradients)

    def _patch(self, owner, name: str, before: bool) -> None:
        original = getattr(owner, name)

        @functools.wraps(original)
        def sampled(*args, **kwargs):
            if before:
                self._sample()
            result = original(*args, **kwargs)
            if not before:
                self._sample()
            return result
        setattr(owner, name, sampled)
        self._undo.append((owner, name, original))

    def _count_all_gathers(self) -> None:
        """Each ``FSDPParamGroup.unshard`` that issues an all-gather adds its parameters' elements."""
        original = FSDPParamGroup.unshard

        @functools.wraps(original)
        def counted(group, *args, **kwargs):
            idle = group._all_gather_result is None
            result = original(group, *args, **kwargs)
            if idle and group._all_gather_result is not None:
                self.peak["all_gathered_elements"] += sum(p._orig_size.numel() for p in group.fsdp_params)
            return result
        FSDPParamGroup.unshard = counted
        self._undo.append((FSDPParamGroup, "unshard", original))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx != 0:
            return
        self.stages = self._groups_by_stage(pl_module)
        self._patch(FSDPParamGroup, "unshard", before=False)
        self._count_all_gathers()
        self._patch(FSDPParamGroup, "wait_for_unshard", before=False)
        for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
            self._patch(_PipelineStageBase, name, before=False)
        self._patch(_PipelineStageBase, "perform_reduce_grad", before=True)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx != 0:
            return
        for owner, name, original in reversed(self._undo):
            setattr(owner, name, original)
        params = {name: p.numel() for name, p in pl_module.model.named_parameters()}
        record = self.peak | {"parameters": params}
        records = [None] * dist.get_world_size()
        dist.all_gather_object(records, record)
        if trainer.is_global_zero:
            self.out.write_text(json.dumps(records))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--schedule", default="1F1B")
    parser.add_argument("--stages-per-rank", type=int, default=None)
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--n-layers", type=int, default=None)
    parser.add_argument("--devices", type=int, default=2, help="gloo processes: 2 stages of devices / 2 ranks")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    shape = yaml.safe_load(CONFIG.read_text())["model"]["init_args"]["config"]
    shape["n_layers"] = args.n_layers or shape["n_layers"]
    L.seed_everything(0)
    model = MoELanguageModel(MoEConfig(**shape), optimizer=lambda groups: torch.optim.AdamW(groups, lr=0.003))
    data = TextDataModule(source="stdlib", seq_len=128, batch_size=8, max_tokens=40000)
    strategy = MoEFSDPStrategy(pipeline_parallel_size=2, pipeline_microbatches=args.microbatches,
                               expert_parallel_size=1, pipeline_schedule=args.schedule,
                               pipeline_stages_per_rank=args.stages_per_rank, stall_timeout=0)
    trainer = L.Trainer(accelerator="cpu", devices=args.devices, strategy=strategy, max_steps=1, logger=False,
                        enable_progress_bar=False, enable_checkpointing=False, limit_val_batches=0,
                        num_sanity_val_steps=0, default_root_dir=Path(args.out).parent,
                        callbacks=[GatheredProbe(args.out)])
    trainer.fit(model, data)


if __name__ == "__main__":
    main()
