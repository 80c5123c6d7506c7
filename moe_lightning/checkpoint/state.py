"""A sharded model's training state (model and optimizers) in and out of a checkpoint: a sharded directory
(``ShardedCheckpointer``) or a single file of full tensors (``reshard``), written at any world size or
``expert_parallel_size``. What a strategy's save and load call; no Lightning here."""

from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)
from torch.distributed.device_mesh import DeviceMesh

from moe_lightning.checkpoint import reshard
from moe_lightning.checkpoint.safe_load import SafeReader
from moe_lightning.checkpoint.sharded import ShardedCheckpointer, expert_parameter_names


def save_state(checkpointer: ShardedCheckpointer, checkpoint: dict[str, Any], path: Path, module: nn.Module,
               expert_mesh: DeviceMesh | None, background: bool) -> None:
    """Lightning's ``checkpoint`` dict as a sharded directory: its model and optimizer states as DCP shards, the rest
    (plain data) as ``meta.pt``. Takes the states out of ``checkpoint``."""
    state = {"state_dict": checkpoint.pop("state_dict")}
    state.update({f"optimizer_{i}": o for i, o in enumerate(checkpoint.pop("optimizer_states", []))})
    checkpointer.save(state, checkpoint, path, expert_parameter_names(module), expert_mesh, background=background)


def load_state(checkpointer: ShardedCheckpointer, path: Path, checkpoint: dict[str, Any], module: nn.Module,
               model: nn.Module, optimizers: list[torch.optim.Optimizer], expert_mesh: DeviceMesh | None,
               strict: bool, flatten_optimizer: bool = False) -> None:
    """Fill the shards of ``model`` and ``optimizers`` from ``path`` (``checkpoint``: its plain data,
    ``discovery.checkpoint_metadata``; a single file's states, memory-mapped there, are taken out of it).
    ``flatten_optimizer``: this run saves optimizer states keyed by parameter name (pipeline stages hold different
    parameter groups, so a group's index means nothing across ranks); a checkpoint saved so loads at any stage
    count, one saved by group index only without stages."""
    if not path.is_dir():
        reshard.load_full_checkpoint(checkpoint, path, module, model, optimizers, expert_mesh)
        return
    state = {"state_dict": get_model_state_dict(model)}
    saved_by_name = optimizers and _optimizer_saved_by_name(path)
    if flatten_optimizer and optimizers and not saved_by_name:
        raise ValueError(f"{path} was written without pipeline stages: its optimizer states are per parameter-group "
                         "index, which stages do not share; resume it at pipeline_parallel_size=1.")
    flat = StateDictOptions(flatten_optimizer_state_dict=bool(saved_by_name))
    state.update({f"optimizer_{i}": get_optimizer_state_dict(model, optimizer, options=flat)
                  for i, optimizer in enumerate(optimizers)})
    checkpointer.load(path, state, expert_parameter_names(module), expert_mesh)
    set_model_state_dict(model, state["state_dict"], options=StateDictOptions(strict=strict))
    for i, optimizer in enumerate(optimizers):
        set_optimizer_state_dict(model, optimizer, state[f"optimizer_{i}"], options=flat)


def _optimizer_saved_by_name(path: Path) -> bool:
    """Whether a sharded checkpoint's optimizer states are keyed by parameter name
    (``optimizer_0.param_groups.<name>.lr``, as under pipeline stages) rather than by group index."""
    keys = SafeReader(path).read_metadata().state_dict_metadata
    return any(k.startswith("optimizer_0.param_groups.") and not k.split(".")[2].isdigit() for k in keys)
