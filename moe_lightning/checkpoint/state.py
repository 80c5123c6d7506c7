"""A sharded model's training state (model and optimizers) in and out of a checkpoint: a sharded directory
(``ShardedCheckpointer``) or a single file of full tensors (``reshard``), written at any world size or
``expert_parallel_size``. What a strategy's save and load call; no Lightning here."""

from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
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
    count, and one saved by group index (without stages) is read with its own groups and regrouped by parameter
    name (``_regroup_by_name``). Either way the LR schedulers' per-group entries in ``checkpoint`` are rebuilt for
    this rank's groups (``_schedulers_as_loaded``)."""
    if not path.is_dir():
        reshard.load_full_checkpoint(checkpoint, path, module, model, optimizers, expert_mesh)
        return
    entries = SafeReader(path).read_metadata().state_dict_metadata
    saved_by_name = any(k.startswith("optimizer_0.param_groups.") and not k.split(".")[2].isdigit() for k in entries)
    regroup = saved_by_name or flatten_optimizer
    if regroup and len(optimizers) > 1 and checkpoint.get("lr_schedulers"):
        raise ValueError(f"{path}: this run has {len(optimizers)} optimizers, and a checkpoint resumed at or from "
                         "pipeline stages does not say which of them each saved LR scheduler drives; resume it where "
                         "configure_optimizers returns one optimizer (with its schedulers).")
    flat = StateDictOptions(flatten_optimizer_state_dict=saved_by_name)
    state = {"state_dict": get_model_state_dict(model)}
    state.update({f"optimizer_{i}": get_optimizer_state_dict(model, optimizer, options=flat)
                  for i, optimizer in enumerate(optimizers)})
    ours = {}  # this run's groups (by FQN), where the checkpoint's are by index and this run's by name
    if flatten_optimizer and not saved_by_name:
        ours = {key: state[key]["param_groups"] for key in state if key.startswith("optimizer_")}
        for key, groups in _saved_param_groups(entries, list(ours), path).items():
            state[key]["param_groups"] = groups  # filled as saved, with the FQNs each group lists
    checkpointer.load(path, state, expert_parameter_names(module), expert_mesh)
    set_model_state_dict(model, state["state_dict"], options=StateDictOptions(strict=strict))
    for i, optimizer in enumerate(optimizers):
        key = f"optimizer_{i}"
        loaded = state[key]
        if ours:
            loaded = _regroup_by_name(loaded, ours[key], path, key)
        set_optimizer_state_dict(model, optimizer, loaded, options=flat)
    if regroup and optimizers:  # (validate and test restore no optimizer)
        for scheduler in checkpoint.get("lr_schedulers") or []:
            _schedulers_as_loaded(scheduler, optimizers[0].param_groups)


def _saved_param_groups(entries: dict[str, Any], keys: list[str], path: Path) -> dict[str, list[dict[str, Any]]]:
    """Each optimizer's ``param_groups`` as a checkpoint saved by group index holds them
    (``<key>.param_groups.<index>.<name>`` in its metadata ``entries``), as placeholders the load fills."""
    saved: dict[str, dict[int, dict[str, Any]]] = {key: {} for key in keys}
    for entry, meta in entries.items():
        key, _, rest = entry.partition(".param_groups.")
        if key in saved:
            index, _, name = rest.partition(".")
            if "." in name:
                raise ValueError(f"{path}: {entry} nests inside a parameter group, which this load cannot regroup by "
                                 "parameter name; resume it at pipeline_parallel_size=1.")
            is_tensor = isinstance(meta, TensorStorageMetadata)  # a tensor hyper-parameter (lr=torch.tensor(...))
            placeholder = torch.empty(meta.size, dtype=meta.properties.dtype) if is_tensor else None
            saved[key].setdefault(int(index), {})[name] = placeholder
    return {key: [groups[i] for i in sorted(groups)] for key, groups in saved.items()}


def _regroup_by_name(loaded: dict[str, Any], ours: list[dict[str, Any]], path: Path, key: str) -> dict[str, Any]:
    """An optimizer state saved by group index as this run's groups: each takes the hyper-parameters of the saved
    group that lists its parameters (by FQN); its parameters' states are read by FQN already. This run keeps its
    own ``param_names``."""
    group_of = {fqn: index for index, group in enumerate(loaded["param_groups"]) for fqn in group["params"]}
    groups = []
    for index, group in enumerate(ours):
        sources = {group_of.get(fqn) for fqn in group["params"]}
        if len(sources) != 1 or None in sources:
            listed = sorted(source for source in sources if source is not None)
            unlisted = " and some by none" if None in sources else ""
            raise ValueError(
                f"{path}: {key}.param_groups was saved by group index; this run's group {index} "
                f"({group.get('role', 'unnamed')}) takes the hyper-parameters of the saved group listing its "
                f"parameters, but they are listed by {len(listed)} groups {listed}{unlisted}: resume it at "
                "pipeline_parallel_size=1 with the optimizer it was saved with.")
        saved = loaded["param_groups"][sources.pop()]
        groups.append({**{k: v for k, v in saved.items() if k not in ("params", "param_names")},
                       "params": group["params"]})
    return {"state": loaded["state"], "param_groups": groups}


# A torch LR scheduler's per-group settings, which its constructor derives again for the groups it is given.
_DERIVED = ("min_lrs", "max_lrs", "base_momentums", "max_momentums")  # ReduceLROnPlateau's, CyclicLR's


def _schedulers_as_loaded(scheduler: dict[str, Any], groups: list[dict[str, Any]], child: bool = False) -> None:
    """A saved LR scheduler's state, in place, as this rank's loaded ``groups``: under pipeline stages rank 0 alone
    writes the plain data, so its per-group entries list rank 0's stage's groups (or, saved without stages, the
    whole model's), which another stage or stage count does not have (torch's ``LambdaLR`` cannot load 5 saved
    ``lr_lambdas`` into 3 groups, and a stage with as many would take another role's). What a group has reached is
    its restored ``lr`` (``_last_lr``) and ``initial_lr`` (``base_lrs``); other per-group settings are the
    scheduler's this run just built for these groups (``lr_lambdas`` as ``None``: torch keeps the built ones); the
    scalars (steps taken, a warmup's length) load as saved. A chained or sequential scheduler's children alike,
    but with the base rates they built: a ``CyclicLR`` child's is its own ``base_lr``, which a group's
    ``initial_lr``, set by the first child, is not. A stateful ``lr_lambdas`` object starts from the state this run
    built, not the saved one."""
    if "_last_lr" in scheduler:
        scheduler["_last_lr"] = [group["lr"] for group in groups]
    if "base_lrs" in scheduler:
        if child:
            del scheduler["base_lrs"]
        else:
            scheduler["base_lrs"] = [group.get("initial_lr", group["lr"]) for group in groups]
    if "lr_lambdas" in scheduler:
        scheduler["lr_lambdas"] = [None] * len(groups)
    for name in _DERIVED:
        scheduler.pop(name, None)
    for inner in scheduler.get("_schedulers") or []:
        _schedulers_as_loaded(inner, groups, child=True)
