"""A full (one-process) checkpoint read into this rank's shards: model tensors and the optimizer state, re-keyed.

Lightning's own single-file path keys the optimizer state by ``model.parameters()`` order, not the optimizer's,
and ignores the ``ep`` split of experts; these functions do neither.
"""

from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from moe_lightning.checkpoint import sharded as ckpt
from moe_lightning.checkpoint.safe_load import CheckpointError


def load_full_checkpoint(checkpoint: dict[str, Any], path: Path, lightning_module: nn.Module, model: nn.Module,
                         optimizers: list[torch.optim.Optimizer], expert_mesh: DeviceMesh | None) -> dict[str, Any]:
    """Copy ``checkpoint`` (full tensors, memory-mapped) into the shards of ``model`` and ``optimizers``; returns
    the rest of it (Lightning's metadata). Every rank copies out only the part of each tensor its shards hold."""
    strict = lightning_module.strict_loading
    full = checkpoint.pop("state_dict")
    names = ckpt.expert_parameter_names(lightning_module)
    state = get_model_state_dict(model)
    missing, unexpected = [k for k in state if k not in full], [k for k in full if k not in state]
    if strict and (missing or unexpected):
        raise CheckpointError(
            f"{path} does not fit the model: {len(missing)} keys missing from it {missing[:3]}, {len(unexpected)} "
            f"unexpected in it {unexpected[:3]}. Resume with the model config it was saved with, or set the "
            f"LightningModule's strict_loading = False to load only the matching keys.")
    with ckpt.global_expert_views(state, names, expert_mesh):
        for key, value in state.items():
            if key in full:
                local = value.to_local() if isinstance(value, DTensor) else value
                local.copy_(ckpt.local_part(full[key], value, f"{path}: {key}"))
    set_model_state_dict(model, state, options=StateDictOptions(strict=strict))
    experts = {id(p) for name, p in model.named_parameters() if name in names}
    for optimizer, saved in zip(optimizers, checkpoint.pop("optimizer_states", [])):
        optimizer.load_state_dict(sharded_optimizer_state(optimizer, saved, experts, expert_mesh, path))
    return checkpoint


def sharded_optimizer_state(optimizer: torch.optim.Optimizer, saved: dict, experts: set[int],
                            expert_mesh: DeviceMesh | None, path: Path) -> dict:
    """``saved`` (a full, id-keyed optimizer state) as ``optimizer.state_dict()`` of this rank's shards.
    Groups match by position, parameters by the groups' ``param_names`` (ids follow the writer's order);
    ``experts`` holds the ids of expert parameters (split by ``ep`` outside their DTensor mesh)."""
    if len(saved["param_groups"]) != len(optimizer.param_groups):
        raise CheckpointError(f"{path}: its optimizer has {len(saved['param_groups'])} parameter groups, "
                                   f"this run's {len(optimizer.param_groups)}: resume with the same optimizer.")

    def shard(value: Any, p: torch.Tensor, what: str) -> Any:
        if not isinstance(p, DTensor) or not torch.is_tensor(value) or value.ndim == 0:
            return value
        like = ckpt.global_expert_view(p, expert_mesh) if id(p) in experts and expert_mesh else p
        out = torch.empty_like(p)
        out.to_local().copy_(ckpt.local_part(value, like, what))
        return out

    state, groups, first = {}, [], 0
    for ours, theirs in zip(optimizer.param_groups, saved["param_groups"]):
        ids = theirs["params"]
        if "param_names" in ours and "param_names" in theirs:
            by_name = dict(zip(theirs["param_names"], ids))
            absent = [name for name in ours["param_names"] if name not in by_name]
            if absent:
                raise CheckpointError(
                    f"{path}: its optimizer state has no parameter {absent[0]!r} ({len(absent)} missing; it "
                    f"holds {theirs['param_names'][:3]}...): resume with the model and optimizer it was saved with.")
            ids = [by_name[name] for name in ours["param_names"]]
        indices = list(range(first, first + len(ours["params"])))
        for index, saved_id, p in zip(indices, ids, ours["params"]):
            for key, value in saved["state"].get(saved_id, {}).items():
                state.setdefault(index, {})[key] = shard(value, p, f"{path}: optimizer state {saved_id}.{key}")
        groups.append({**theirs, "params": indices})
        first += len(indices)
    return {"state": state, "param_groups": groups}
