"""FSDP2 on ``MoETransformer``: the steps ``parallelize_moe`` (``parallel/parallelize.py``) runs, in its order.

    apply_fsdp             ``fully_shard`` on each unit of ``parallel/units.py`` (blocks, experts, embedding, head, root)
    set_prefetch           each unit all-gathers the next ones of its pass; the MTP units only when MTP runs
    materialize            meta-device build: allocate the local shards and initialise them

and, while training, ``accumulating``: the gradient-sync policy of the non-final micro-batches.

Every input is an argument; nothing here reads the strategy or the trainer.
"""

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard,
                                    register_fsdp_forward_method)
from torch.distributed.tensor import DTensor, Shard

from moe_lightning.model import GroupedExperts, MoETransformer
from moe_lightning.parallel.units import fsdp_units

Stage = list[FSDPModule]  # the units that run together: the first one owns the stage's forward prefetch


@dataclass(frozen=True)
class FSDPPolicy:
    """How every unit is sharded (``reshard_after_forward`` is per unit: the head and the root keep theirs)."""

    param_dtype: torch.dtype | None
    reduce_dtype: torch.dtype | None
    reshard_after_forward: bool
    cpu_offload: bool
    expert_placement: Shard  # of expert stacks (the mesh layout's choice); FSDP's default for the rest


def apply_fsdp(model: MoETransformer, dense_mesh: DeviceMesh, expert_mesh: DeviceMesh | None,
               policy: FSDPPolicy, roots: list[nn.Module] | None = None) -> list[Stage]:
    """Shard ``model`` into FSDP units; returns them in forward order, grouped into stages.

    ``roots``: the modules that run forward instead of ``model`` (default: ``model``), each made an FSDP root over
    the units it holds, its leftover parameters its own (TorchTitan likewise shards each pipeline part as a root):
    a pipeline rank's stage views (``pipeline.stage_parts``), whose units are ``model``'s. A root's lazy init,
    stream waits and end-of-backward callback then run whenever its forward runs; ``model``'s never does.

    ``expert_mesh`` (the expert-FSDP sub-mesh under expert parallelism, else None) gets each MoE block's experts
    as a unit of its own. The head is a unit of its own, never grouped with the final norm: the chunked loss runs
    the head through ``OutputHead.cross_entropy``, registered as an FSDP forward method, so the unit's forward
    completes in every step. (A ``[norm, output]`` group whose ``output`` never runs stays "mid-forward" after a
    validation on torch 2.11, and a checkpoint's reshard then breaks the next training step.) Below the root,
    inputs arrive in the compute dtype already, except the rotary tables the root hands every block: they stay
    fp32, as on one device (FSDP2 would cast every floating argument to ``param_dtype``)."""
    expert_params = {id(p) for m in model.modules() if isinstance(m, GroupedExperts) for p in m.parameters()}
    dtypes = dict(param_dtype=policy.param_dtype, reduce_dtype=policy.reduce_dtype)
    common = dict(mp_policy=MixedPrecisionPolicy(**dtypes, cast_forward_inputs=False),
                  offload_policy=CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if policy.cpu_offload
                  else OffloadPolicy(),
                  shard_placement_fn=lambda p: policy.expert_placement if id(p) in expert_params else None)

    stages: dict[int, Stage] = {}
    for unit in fsdp_units(model, expert_parallel=expert_mesh is not None):  # inner units first, the root last
        reshard = policy.reshard_after_forward and not unit.keep_gathered
        if unit.stage is None:  # the root casts the forward inputs
            for root in roots or [model]:
                fully_shard(root, mesh=dense_mesh, reshard_after_forward=reshard,
                            **{**common, "mp_policy": MixedPrecisionPolicy(**dtypes)})
            continue
        sharded = fully_shard(unit.module, mesh=expert_mesh if unit.experts else dense_mesh,
                              reshard_after_forward=reshard, **common)
        stages.setdefault(unit.stage, []).insert(0, sharded)  # a stage runs outer to inner: reverse of wrapping
    if not model.config.tie_embeddings and model.output is not None:  # the head runs last, whichever entry runs it
        for method in ("cross_entropy", "cross_entropy_sums"):
            register_fsdp_forward_method(model.output, method)
    return [stages[i] for i in sorted(stages)]


def set_prefetch(model: MoETransformer, stages: list[Stage], depth: int) -> None:
    """Explicit prefetch: each FSDP unit all-gathers the next ``depth`` units of its pass (0: FSDP's default).

    In forward, a stage's nested units (a block's ``experts`` under expert parallelism) hand their lists to the
    block: FSDP2 runs a unit's forward prefetch whenever the unit runs forward (torch 2.11
    ``FSDPState._pre_forward``), also when a checkpointed block is recomputed in backward, where the block itself
    (already in its backward) skips it but a nested unit would all-gather the next block again, whose backward is
    done, and hold it to the end of backward.

    The MTP units run only in a forward called with ``mtp=True`` (training); any other forward (validation,
    generation) would gather them for nothing and hold them. A pre-forward hook on the root picks the forward
    lists by that argument."""
    if depth == 0:
        return
    mtp = {id(module) for module in model.mtp}
    with_mtp = _forward_prefetch(stages, depth)
    without_mtp = _forward_prefetch([stage for stage in stages if id(stage[0]) not in mtp], depth)
    for unit, targets in with_mtp.items():
        unit.set_modules_to_forward_prefetch(targets)
    differ = {unit: (with_mtp.get(unit, []), without_mtp.get(unit, [])) for unit in {*with_mtp, *without_mtp}
              if with_mtp.get(unit, []) != without_mtp.get(unit, [])}
    if differ:
        def choose(_module, _args, kwargs):
            for unit, (training, other) in differ.items():
                unit.set_modules_to_forward_prefetch(training if kwargs.get("mtp") else other)
        model.register_forward_pre_hook(choose, with_kwargs=True)
    backward = [m for stage in reversed(stages) for m in stage]
    for i, module in enumerate(backward):
        if targets := backward[i + 1:i + 1 + depth]:
            module.set_modules_to_backward_prefetch(targets)


def _forward_prefetch(stages: list[Stage], depth: int) -> dict[FSDPModule, list[FSDPModule]]:
    """Each stage's first unit: the next ``depth`` units after any unit of its stage, in forward order."""
    forward = [m for stage in stages for m in stage]
    position = {id(m): i for i, m in enumerate(forward)}
    plan = {}
    for stage in stages:
        ahead = (t for m in stage for t in forward[position[id(m)] + 1:position[id(m)] + 1 + depth])
        if targets := list(dict.fromkeys(ahead)):
            plan[stage[0]] = targets
    return plan


def set_unshard_async_op(model: nn.Module) -> None:
    """All-gather in the compute stream's memory pool instead of a side stream, for every unit."""
    for module in model.modules():
        if isinstance(module, FSDPModule):  # private in torch <= 2.13; a public name wins if present
            (getattr(module, "set_unshard_async_op", None) or module._set_unshard_async_op)(True)


def move_all_but(module: nn.Module, sharded: type, device: torch.device) -> None:
    """``module``'s children to ``device``, except the ``sharded`` one (its shards stay where the offload policy
    keeps them: host memory under ``cpu_offload``)."""
    for child in module.children():
        if not isinstance(child, sharded):
            child.to(device)


@torch.no_grad()
def materialize(model: MoETransformer, param_device: torch.device, buffer_device: torch.device, seed: int) -> None:
    """Allocate the local shards on ``param_device`` and run ``model.init_weights()`` on them as plain tensors.

    ``seed`` should be the run's seed plus the rank's place in its replica (``MeshLayout.rank_in_replica``: HSDP
    replicas share it), so shards and pipeline stages differ and replicas agree, with element-wise initialisers,
    on CPU and CUDA alike. Buffers (e.g. the router's ``expert_bias``) are read by the forward pass: they go to
    ``buffer_device`` (the compute device), also under ``cpu_offload``."""
    model.to_empty(device=param_device)
    for module in model.modules():
        for name, buffer in module._buffers.items():
            if buffer is not None and buffer.device != buffer_device:
                module._buffers[name] = buffer.to(buffer_device)
    swapped = []
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if isinstance(param, DTensor):
                swapped.append((module, name, param))
                module._parameters[name] = nn.Parameter(param.to_local(), requires_grad=False)
    try:
        cuda = [buffer_device] if buffer_device.type == "cuda" else []
        with torch.random.fork_rng(devices=cuda):  # leave every generator as it was, CUDA's included
            torch.manual_seed(seed)
            model.init_weights()
    finally:
        for module, name, param in swapped:
            module._parameters[name] = param


@contextmanager
def accumulating(root: FSDPModule, unsharded: bool) -> Iterator[None]:
    """Non-final micro-batches of gradient accumulation: each still reduce-scatters (sharded gradients accumulate;
    nothing unsharded outlives its unit's backward) and only the HSDP all-reduce waits for the last one. With
    ``unsharded``, no reduction at all (every unit keeps its full gradient until the last micro-batch). Not under
    pipeline stages (``accumulate_grad_batches`` is 1 there, and a rank of several stages has no single root)."""
    block = root.set_requires_gradient_sync if unsharded else root.set_requires_all_reduce
    block(False)
    try:
        yield
    finally:
        block(True)
