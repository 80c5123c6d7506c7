"""``parallelize_moe``: the one function that turns a built ``MoETransformer`` into the model a run trains.

The order, and why:

    0. pipeline stages     the blocks of the other ranks' stages go, names kept (``pipeline.keep_stages``): every later
                           step sees only this rank's blocks, embedding and head
    1. expert parallelism  each rank keeps its ``E / ep`` experts; the all-to-all dispatcher goes on every MoE layer;
                           context parallelism: the model's ``sequence_shard`` becomes this rank's head-tail share
    2. compile             each block's class becomes one with a compiled ``forward`` (``compile.py``)
    3. block wrapping      activation checkpointing and offload (``ActivationOffload``): an instance ``forward`` bound
                           to the class's, so it comes after 2 (before, it would keep calling the eager forward)
    4. FSDP units          ``fully_shard`` on each unit (``fsdp.apply_fsdp``): FSDP2's hooks run in ``__call__``,
                           around whatever ``forward`` 2 and 3 left, so neither changes what a unit gathers; each
                           routed-expert unit divides its summed gradients by the whole data-parallel size once.
                           Several stages on a rank: each stage's view (``pipeline.stage_parts``) is a root
    5. prefetch            which units each unit all-gathers ahead; all-gathers in the compute stream's pool
    6. materialize         a meta-device build only: allocate the local shards and initialise them, or copy the
                           released weights in (after 4, so each rank touches only its own slices)

Each step takes what its dimension of ``sharding.mesh`` asks (a dimension of size 1 asks nothing). Nothing here reads
a trainer or a strategy: ``MoEFSDPStrategy.setup`` is its one caller; on other strategies the module compiles the
blocks itself (``compile_blocks``) and ``ActivationOffload`` applies 3 when fit starts.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.distributed.fsdp import FSDPModule

from moe_lightning.checkpoint.sharded import expert_parameter_names, global_expert_views
from moe_lightning.dtypes import DTYPES
from moe_lightning.model import GroupedExperts, MoETransformer
from moe_lightning.parallel import fsdp
from moe_lightning.parallel.compile import compile_blocks
from moe_lightning.parallel.context_parallel import ContextParallelShard
from moe_lightning.parallel.expert_parallel import apply_expert_parallel, check_overlap_chunks, divide_expert_gradients
from moe_lightning.parallel.mesh import MeshError, MeshLayout, ParallelMesh
from moe_lightning.parallel.pipeline import (SPLIT_BACKWARD, PipelineLayout, copy_first_stage_embedding, keep_stages,
                                             stage_parts)


@dataclass(frozen=True)
class Sharding:
    """How ``parallelize_moe`` shards (``MoEFSDPStrategy`` builds it from its arguments and its ``ParallelMesh``)."""

    mesh: ParallelMesh  # every dimension's size and group, by name
    param_dtype: torch.dtype | None
    reduce_dtype: torch.dtype | None
    reshard_after_forward: bool
    cpu_offload: bool
    prefetch_depth: int
    unshard_async_op: bool
    param_device: torch.device  # where the shards live (host memory under cpu_offload)
    buffer_device: torch.device  # the compute device
    seed: int  # of a meta-device build: the run's seed plus the rank in a replica (replicas agree, the rest differ)
    ep_overlap_chunks: int = 1  # chunks each MoE layer's tokens are pipelined through (expert parallelism)
    dispatch_dtype: torch.dtype | None = None  # of the dispatch hops' hidden rows (None: the training dtype)
    pipeline: PipelineLayout | None = None  # the stages (``mesh.layout.pp > 1``)
    loss_chunk_size: int | None = None  # the module's, for the last stage's loss (``pipeline.StageTransformer``)


def check_strategy_arguments(replicate_size: int, shard_size: int | str, expert_parallel_size: int, param_dtype: str,
                             reduce_dtype: str, prefetch_depth: int, save_distributed_checkpoint: bool,
                             async_checkpoint: bool, context_parallel_size: int = 1, ep_overlap_chunks: int = 1,
                             dispatch_dtype: str | None = None, pipeline_parallel_size: int = 1) -> None:
    """What ``MoEFSDPStrategy``'s arguments can be checked for before any launch; messages name ``strategy.<field>``."""
    for name, value in (("param_dtype", param_dtype), ("reduce_dtype", reduce_dtype)):
        if value != "auto" and value not in DTYPES:
            raise MeshError(f"strategy.{name}={value!r}: use one of 'auto', {', '.join(map(repr, DTYPES))}.")
    if not isinstance(prefetch_depth, int) or prefetch_depth < 0:
        raise MeshError(f"strategy.prefetch_depth={prefetch_depth!r}: must be an integer >= 0.")
    MeshLayout.check_arguments(replicate_size, shard_size, expert_parallel_size, context_parallel_size,
                               pipeline_parallel_size)
    check_overlap_chunks(ep_overlap_chunks)
    if dispatch_dtype not in (None, "float8_e4m3fn"):
        raise MeshError(f"strategy.dispatch_dtype={dispatch_dtype!r}: use null (the training dtype) or "
                        "'float8_e4m3fn' (FP8 dispatch hops).")
    if not save_distributed_checkpoint and expert_parallel_size > 1:
        raise MeshError("strategy.save_distributed_checkpoint=False gathers full tensors per rank, which with "
                        f"expert_parallel_size={expert_parallel_size} hold only local experts: keep sharded "
                        "checkpoints and export a single file with `moe-lightning export`.")
    if async_checkpoint and not save_distributed_checkpoint:
        raise MeshError("strategy.async_checkpoint=True writes sharded checkpoints in the background: keep "
                        "strategy.save_distributed_checkpoint=True.")


def the_transformer(module: torch.nn.Module, owner: str) -> MoETransformer:
    """The one ``MoETransformer`` inside ``module`` (what a strategy parallelizes)."""
    models = [m for m in module.modules() if isinstance(m, MoETransformer)]
    if len(models) != 1:
        raise TypeError(f"{owner} needs exactly one MoETransformer in the LightningModule (found {len(models)}); "
                        "build it in configure_model().")
    return models[0]


def parallelize_moe(model: MoETransformer, sharding: Sharding, *, compile: bool = False,
                    wrap_blocks: Callable[[MoETransformer], None] | None = None,
                    fill_pretrained: Callable[..., None] | None = None) -> list[str]:
    """Apply the steps above to ``model``, in place; returns what to log. ``wrap_blocks(model)`` wraps the blocks'
    forwards; ``fill_pretrained(state[, whole_shapes])`` copies released weights into ``state`` (the model's state
    dict, expert stacks as global views; under pipeline stages a stage's, with the whole model's shapes to check the
    release against) when the model was built on the meta device. A model already sharded is left as it is."""
    if any(isinstance(m, FSDPModule) for m in model.modules()):  # (a model of several stages is no root itself)
        return []
    messages, on_meta = [], any(p.device.type == "meta" for p in model.parameters())
    mesh, layout, E = sharding.mesh, sharding.mesh.layout, model.config.num_experts
    whole_shapes = None  # a release is checked against the whole model on every stage, so all refuse it alike
    if on_meta and fill_pretrained is not None and sharding.pipeline is not None:
        whole_shapes = {name: t.shape for name, t in model.state_dict(keep_vars=True).items()}
    if sharding.pipeline is not None:
        keep_stages(model, sharding.pipeline.stages_of(mesh.pipeline_rank), sharding.pipeline,
                    sharding.loss_chunk_size)
        messages.append(f"pipeline: {sharding.pipeline.num_stages} stages of {list(sharding.pipeline.blocks_per_stage)} "
                        f"blocks, {sharding.pipeline.schedule} over {sharding.pipeline.microbatches} micro-batches; "
                        f"rank 0 holds blocks {[int(name) for name in model.layers._modules]}.")
    if layout.ep > 1:  # FSDP divides the expert gradients (below): exact at any ep, no x ep / ep rounding
        messages.append(apply_expert_parallel(model.moe_layers(), mesh.group("ep"),
                                              overlap_chunks=sharding.ep_overlap_chunks, scale_in_exchange=False,
                                              dispatch_dtype=sharding.dispatch_dtype))
    if layout.cp > 1:
        model.sequence_shard = ContextParallelShard(mesh.group("cp"))
        messages.append(f"context parallelism over {layout.cp} ranks: head-tail shards of every sequence.")
    if compile:
        compile_blocks(model.layers)
    if wrap_blocks is not None:
        wrap_blocks(model)
    placement, message = layout.expert_placement(E)
    messages.append(message)
    # A split backward's weight pass walks the stage's parameters after its input pass: they must still be gathered
    # then (per-unit resharding after forward left it the sharded ones, and those units' gradients were lost).
    # Torch's runtime gathers a whole stage (UNSHARD) and keeps at most 3 of a rank's stages gathered at once.
    split = sharding.pipeline is not None and sharding.pipeline.schedule in SPLIT_BACKWARD
    if split and sharding.reshard_after_forward:
        messages.append(f"reshard_after_forward=True overridden to False: {sharding.pipeline.schedule}'s weight "
                        "pass needs each stage's parameters gathered from its forward to its backward.")
    policy = fsdp.FSDPPolicy(param_dtype=sharding.param_dtype, reduce_dtype=sharding.reduce_dtype,
                             reshard_after_forward=sharding.reshard_after_forward and not split,
                             cpu_offload=sharding.cpu_offload,
                             expert_placement=placement)
    expert_fsdp_mesh = mesh.expert_fsdp
    roots = [model]  # what runs forward: the model, or the views of a rank's several pipeline stages
    if sharding.pipeline is not None:
        roots = model.pipeline_parts = stage_parts(model, sharding.pipeline)
    stages = fsdp.apply_fsdp(model, mesh.dense, expert_fsdp_mesh, policy, roots)
    if expert_fsdp_mesh is not None:
        for experts in (m for m in model.modules() if isinstance(m, GroupedExperts) and isinstance(m, FSDPModule)):
            divide_expert_gradients(experts, expert_fsdp_mesh, layout.ep)
    for root in roots:  # a view's units prefetch each other only: torch's schedule orders the stages
        held = {id(m) for m in root.modules()}
        fsdp.set_prefetch(root, [stage for stage in stages if id(stage[0]) in held], sharding.prefetch_depth)
        if sharding.unshard_async_op:
            fsdp.set_unshard_async_op(root)
    if on_meta:  # (otherwise fully_shard has moved the buffers to the mesh's device)
        fsdp.materialize(model, sharding.param_device, sharding.buffer_device, sharding.seed)
        if sharding.pipeline is not None:  # each stage's rank drew its own values: the embedding copy is the first's
            copy_first_stage_embedding(model, mesh.group("pp_ends"))
        if fill_pretrained is not None:
            with global_expert_views(model.state_dict(keep_vars=True), expert_parameter_names(model),
                                     mesh.expert) as state:
                fill_pretrained(state) if whole_shapes is None else fill_pretrained(state, whole_shapes)
    return messages
