"""The FSDP2 strategy: HSDP + expert parallelism applied to ``MoETransformer`` without touching model code.

Select it from YAML::

    trainer:
      strategy:
        class_path: moe_lightning.strategy.MoEFSDPStrategy
        init_args: {replicate_size: 1, expert_parallel_size: 2}

Initialisation, two ways:
- default: ``configure_model`` builds the whole model on the CPU of every rank from the same seeded RNG
  (Lightning re-seeds each rank before the build), so the sharded model is bit-identical to a
  one-process run; each rank then keeps only its shards. Needs the full model in host memory.
- ``meta_init=True``: the model is built on the meta device, sharded, and only each rank's shards are
  allocated and filled by ``model.init_weights()`` (see ``_materialize``). Deterministic for a seed and
  layout, but not equal to a one-process build. For models that do not fit one host.
"""

import math
from collections.abc import Generator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal, Optional, Union

import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.fsdp import (CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy,
                                    fully_shard, register_fsdp_forward_method)
from torch.distributed.tensor import DTensor

from .model import GroupedExperts, MoETransformer
from .parallel import MeshError, MeshLayout, apply_expert_parallel
from .parallel import checkpoint as ckpt
from .parallel.checkpoint_io import FileCheckpointIO
from .resume import check_resume

DTypeName = Literal["auto", "bf16", "fp16", "fp32"]
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@torch.no_grad()
def clip_grads_(grads: list[torch.Tensor], max_norm: float, device: torch.device) -> torch.Tensor:
    """Clip (possibly sharded) gradients to a global L2 norm of ``max_norm``; returns the norm before clipping.

    Each rank sums the squares of its local shards and divides by how many ranks hold the same values (the
    sizes of the ``Replicate`` mesh dims: HSDP replicas); one all-reduce over the world on ``device`` then
    gives the global squared norm, dense and expert meshes together (the ``ep`` split of expert stacks is
    outside their DTensor mesh, so its ranks add up as they should). No DTensor collective runs on host
    tensors (NCCL rejects those under ``cpu_offload``), and nothing is read back to the host: the scale
    stays a tensor. (With ``cpu_offload`` the host still waits for it, since the host scales the gradients.)
    """
    groups: dict[tuple[torch.device, int], list[torch.Tensor]] = {}  # (device, copies) -> local shards
    for grad in grads:
        if isinstance(grad, DTensor):
            copies = math.prod(grad.device_mesh.size(d) for d, p in enumerate(grad.placements) if p.is_replicate())
            grad = grad.to_local()  # under no_grad: the shard itself, no copy
        else:
            copies = dist.get_world_size() if dist.is_initialized() else 1
        groups.setdefault((grad.device, copies), []).append(grad)
    total_sq = torch.zeros((), device=device)
    for (_, copies), local in groups.items():
        norms = torch._foreach_norm(local)  # fp32 for fp32 shards (FSDP keeps gradients in the sharded dtype)
        total_sq += (torch.stack(norms).float().square().sum() / copies).to(device)
    if dist.is_initialized():
        dist.all_reduce(total_sq)
    total = total_sq.sqrt()
    scale = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for (grad_device, _), local in groups.items():
        torch._foreach_mul_(local, scale.to(grad_device))
    return total


class MoEFSDPStrategy(ModelParallelStrategy):
    """FSDP2 / HSDP with expert parallelism for ``MoETransformer``, sharded checkpoints and exact resume.

    Args:
        replicate_size: HSDP replicas (each holds a full copy of the model, sharded within the replica).
        shard_size: Ranks that shard one replica; ``"auto"`` = world size / ``replicate_size``. The
            defaults give plain FSDP over all ranks.
        expert_parallel_size: ``ep``: ranks of a replica that split the experts between them (must
            divide ``shard_size`` and ``num_experts``); the remaining ``shard_size / ep`` ranks shard
            each expert block FSDP-style.
        param_dtype: Dtype of unsharded parameters in forward/backward (``auto``: bf16 on GPU, fp32 on CPU).
        reduce_dtype: Dtype of gradient reduction (``auto``: fp32).
        reshard_after_forward: Free gathered block parameters after forward (re-gather in backward).
            The head and the root always keep theirs: backward needs them at once.
        prefetch_depth: How many FSDP units ahead to all-gather, forward and backward (0: FSDP's default).
        unshard_async_op: All-gather in the compute stream's memory pool instead of a side stream
            (less fragmentation; measured by ``benchmarks/gpu_strategy.py``).
        cpu_offload: Keep sharded parameters, gradients and optimizer state in host memory.
        meta_init: Build on the meta device and materialise only local shards (see the module docstring).
        save_distributed_checkpoint: Sharded checkpoint directories (``False``: one full file from rank 0).
        async_checkpoint: Copy the state to host memory and write the sharded checkpoint in the background
            while training goes on (at most one save in flight; a failed save raises at the next batch).
        process_group_backend: ``nccl``/``gloo``; default from the device.
        timeout: Collective timeout.
    """

    def __init__(self, replicate_size: int = 1, shard_size: Union[int, Literal["auto"]] = "auto",
                 expert_parallel_size: int = 1, param_dtype: DTypeName = "auto", reduce_dtype: DTypeName = "auto",
                 reshard_after_forward: bool = True, prefetch_depth: int = 1, unshard_async_op: bool = False,
                 cpu_offload: bool = False, meta_init: bool = False, save_distributed_checkpoint: bool = True,
                 async_checkpoint: bool = False, process_group_backend: Optional[str] = None,
                 timeout: Optional[timedelta] = default_pg_timeout):
        super().__init__(save_distributed_checkpoint=save_distributed_checkpoint,
                         process_group_backend=process_group_backend, timeout=timeout)
        for name, value in (("param_dtype", param_dtype), ("reduce_dtype", reduce_dtype)):
            if value != "auto" and value not in _DTYPES:
                raise MeshError(f"strategy.{name}={value!r}: use one of 'auto', {', '.join(map(repr, _DTYPES))}.")
        if not isinstance(prefetch_depth, int) or prefetch_depth < 0:
            raise MeshError(f"strategy.prefetch_depth={prefetch_depth!r}: must be an integer >= 0.")
        MeshLayout.check_arguments(replicate_size, shard_size, expert_parallel_size)  # before any launch
        if not save_distributed_checkpoint and expert_parallel_size > 1:
            raise MeshError("strategy.save_distributed_checkpoint=False gathers full tensors per rank, which with "
                            f"expert_parallel_size={expert_parallel_size} hold only local experts: keep sharded "
                            "checkpoints and export a single file with `moe-lightning export`.")
        if async_checkpoint and not save_distributed_checkpoint:
            raise MeshError("strategy.async_checkpoint=True writes sharded checkpoints in the background: keep "
                            "strategy.save_distributed_checkpoint=True.")
        self.replicate_size, self.shard_size, self.expert_parallel_size = replicate_size, shard_size, expert_parallel_size
        self.param_dtype, self.reduce_dtype = param_dtype, reduce_dtype
        self.reshard_after_forward, self.prefetch_depth = reshard_after_forward, prefetch_depth
        self.unshard_async_op, self.cpu_offload, self.meta_init = unshard_async_op, cpu_offload, meta_init
        self.layout: MeshLayout | None = None
        self.expert_mesh = None
        self._expert_fsdp_mesh = None  # the sub-mesh that FSDP-shards expert stacks under ep > 1
        self._fsdp_root: FSDPModule | None = None
        self.async_checkpoint, self._fitting = async_checkpoint, False  # background saves only inside fit
        self.checkpointer = ckpt.ShardedCheckpointer()
        self.checkpoint_io = FileCheckpointIO()  # single-file saves (save_distributed_checkpoint=False)

    # ---- mesh -----------------------------------------------------------------------------------
    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Every rank reads different data: replicas, shards and expert-parallel ranks alike."""
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    def setup_environment(self) -> None:
        config = getattr(self.lightning_module, "config", None)
        self.layout = MeshLayout.resolve(self.num_nodes * self.num_processes, self.replicate_size, self.shard_size,
                                         self.expert_parallel_size, getattr(config, "num_experts", None))
        self._setup_distributed()
        device_type = self.root_device.type
        self._device_mesh = self.layout.dense_mesh(device_type)
        self.expert_mesh = self.layout.expert_mesh(device_type) if self.layout.ep > 1 else None
        self._expert_fsdp_mesh = MeshLayout.expert_fsdp_mesh(self.expert_mesh) if self.expert_mesh is not None else None
        self.lightning_module._device_mesh = self._device_mesh
        rank_zero_info(f"{type(self).__name__}: {self.layout.replicate} replica(s) x {self.layout.shard} shard ranks, "
                       f"expert_parallel_size={self.layout.ep}.")

    # ---- sharding -------------------------------------------------------------------------------
    @contextmanager
    def tensor_init_context(self, empty_init: Optional[bool] = None) -> Generator[None, None, None]:
        # Pretrained weights are read per shard after sharding (fill_pretrained), so never build them in full.
        pretrained = getattr(self.lightning_module, "pretrained", None) is not None
        with super().tensor_init_context((self.meta_init or pretrained) if empty_init is None else empty_init):
            yield

    def setup(self, trainer) -> None:
        self._parallelize()
        super().setup(trainer)
        # Lightning clips through the precision plugin with one norm over all gradients, which cannot
        # combine DTensors of different meshes (dense and expert); the strategy's norm can.
        self.precision_plugin.clip_grad_by_norm = self.clip_grad_by_norm

    def _dtype(self, name: DTypeName, cuda_default: torch.dtype | None) -> torch.dtype | None:
        if name == "auto":
            return cuda_default if self.root_device.type == "cuda" else None
        return _DTYPES[name]

    def _parallelize(self) -> None:
        """Expert parallelism, then ``fully_shard`` per block, embedding, head and root (idempotent).

        The head is a unit of its own, never grouped with the final norm: the chunked loss runs the head through
        ``OutputHead.cross_entropy``, registered as an FSDP forward method, so the unit's forward completes
        in every step. (A ``[norm, output]`` group whose ``output`` never runs stays "mid-forward" after a
        validation on torch 2.11, and a checkpoint's reshard then breaks the next training step.)"""
        models = [m for m in self.lightning_module.modules() if isinstance(m, MoETransformer)]
        if len(models) != 1:
            raise TypeError(f"{type(self).__name__} needs exactly one MoETransformer in the LightningModule "
                            f"(found {len(models)}); build it in configure_model().")
        model = models[0]
        if isinstance(model, FSDPModule):
            return
        on_meta = any(p.device.type == "meta" for p in model.parameters())
        E = model.config.num_experts
        MeshLayout.resolve(self.layout.world_size, self.layout.replicate, self.layout.shard, self.layout.ep, E)
        if self.layout.ep > 1:
            apply_expert_parallel(model.moe_layers(), self.expert_mesh["ep"].get_group())
        dense_mesh = self._device_mesh
        offload = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if self.cpu_offload else OffloadPolicy()
        dtypes = dict(param_dtype=self._dtype(self.param_dtype, torch.bfloat16),
                      reduce_dtype=self._dtype(self.reduce_dtype, torch.float32))
        # Below the root, inputs arrive in the compute dtype already, except the rotary tables the root hands every
        # block: they stay fp32, as on one device (FSDP2 would cast every floating argument to param_dtype).
        common = dict(mp_policy=MixedPrecisionPolicy(**dtypes, cast_forward_inputs=False),
                      offload_policy=offload, shard_placement_fn=self._expert_placement(model))
        stages: list[list[nn.Module]] = []
        tied = model.config.tie_embeddings  # a tied embedding/head stays in the root group
        if not tied:
            stages.append([fully_shard(model.tok_embeddings, mesh=dense_mesh,
                                       reshard_after_forward=self.reshard_after_forward, **common)])
        for block in model.layers:
            stage = []
            if self.layout.ep > 1 and block.is_moe:
                stage.append(fully_shard(block.ffn.experts, mesh=self._expert_fsdp_mesh,
                                         reshard_after_forward=self.reshard_after_forward, **common))
            stages.append([fully_shard(block, mesh=dense_mesh, reshard_after_forward=self.reshard_after_forward,
                                       **common)] + stage)
        # multi-token prediction runs after the final norm: its block is a unit like the others, its norms and
        # eh_proj another (entered first)
        for module in model.mtp:
            shard = dict(mesh=dense_mesh, reshard_after_forward=self.reshard_after_forward, **common)
            experts = [fully_shard(module.block.ffn.experts, **{**shard, "mesh": self._expert_fsdp_mesh})] \
                if self.layout.ep > 1 and module.block.is_moe else []
            block = fully_shard(module.block, **shard)
            stages.append([fully_shard(module, **shard), block, *experts])
        if not tied:  # the head is its own unit, run last, whichever entry point runs it (the final norm: root)
            stages.append([fully_shard(model.output, mesh=dense_mesh, reshard_after_forward=False, **common)])
            for method in ("cross_entropy", "cross_entropy_sums"):
                register_fsdp_forward_method(model.output, method)
        self._fsdp_root = fully_shard(model, mesh=dense_mesh, reshard_after_forward=False,
                                      **{**common, "mp_policy": MixedPrecisionPolicy(**dtypes)})
        self._set_prefetch(stages)
        if on_meta:  # (otherwise fully_shard has moved the buffers to the mesh's device)
            self._materialize(model)
            self._fill_pretrained()
        if self.unshard_async_op:
            for module in model.modules():
                if isinstance(module, FSDPModule):  # private in torch <= 2.13; a public name wins if present
                    (getattr(module, "set_unshard_async_op", None) or module._set_unshard_async_op)(True)

    @property
    def param_device(self) -> torch.device:
        """Where sharded parameters, their gradients and the optimizer state live (buffers: ``root_device``)."""
        return torch.device("cpu") if self.cpu_offload else self.root_device

    def _buffers_to_compute_device(self, model: nn.Module) -> None:
        """Buffers (e.g. the router's ``expert_bias``) are read by the forward pass: keep them by the compute,
        also under ``cpu_offload``, where ``to_empty`` put them in host memory with the parameters."""
        for module in model.modules():
            for name, buffer in module._buffers.items():
                if buffer is not None and buffer.device != self.root_device:
                    module._buffers[name] = buffer.to(self.root_device)

    @torch.no_grad()
    def _materialize(self, model: MoETransformer) -> None:
        """Allocate the local shards and run ``model.init_weights()`` on them as plain tensors.

        Each shard rank draws from its own seed (``initial seed + shard rank``; HSDP replicas share it),
        so shards differ and replicas agree, with element-wise initialisers, on CPU and CUDA alike.
        """
        model.to_empty(device=self.param_device)
        self._buffers_to_compute_device(model)
        swapped = []
        for module in model.modules():
            for name, param in list(module.named_parameters(recurse=False)):
                if isinstance(param, DTensor):
                    swapped.append((module, name, param))
                    module._parameters[name] = nn.Parameter(param.to_local(), requires_grad=False)
        try:
            cuda = [self.root_device] if self.root_device.type == "cuda" else []
            with torch.random.fork_rng(devices=cuda):  # leave every generator as it was, CUDA's included
                torch.manual_seed(torch.initial_seed() + self.global_rank % self.layout.shard)
                model.init_weights()
        finally:
            for module, name, param in swapped:
                module._parameters[name] = param

    def _fill_pretrained(self) -> None:
        """Let the module copy released weights into the shards (it knows the format; we know the layout)."""
        fill = getattr(self.lightning_module, "fill_pretrained", None)
        if fill is None or getattr(self.lightning_module, "pretrained", None) is None:
            return
        names = ckpt.expert_parameter_names(self.lightning_module)
        with ckpt.global_expert_views(self.lightning_module.state_dict(keep_vars=True), names, self.expert_mesh) as state:
            fill(state)

    def _expert_placement(self, model: MoETransformer):
        """``shard_placement_fn``: the layout's choice for expert stacks, FSDP's default for the rest."""
        placement, message = self.layout.expert_placement(model.config.num_experts)
        rank_zero_info(f"{type(self).__name__}: {message}")
        expert_params = {id(p) for m in model.modules() if isinstance(m, GroupedExperts) for p in m.parameters()}
        return lambda param: placement if id(param) in expert_params else None

    def _set_prefetch(self, stages: list[list[nn.Module]]) -> None:
        """Explicit prefetch: each FSDP unit all-gathers the next ``prefetch_depth`` units of its pass.

        In forward, a stage's nested units (a block's ``experts`` under expert parallelism) hand their lists to
        the block: FSDP2 runs a unit's forward prefetch whenever the unit runs forward (torch 2.11
        ``FSDPState._pre_forward``), also when a checkpointed block is recomputed in backward, where the block
        itself (already in its backward) skips it but a nested unit would all-gather the next block again, whose
        backward is done, and hold it to the end of backward."""
        if self.prefetch_depth == 0:
            return
        forward = [m for stage in stages for m in stage]
        backward = [m for stage in reversed(stages) for m in stage]
        position = {id(m): i for i, m in enumerate(forward)}
        for stage in stages:
            lists = [forward[position[id(m)] + 1:position[id(m)] + 1 + self.prefetch_depth] for m in stage]
            if targets := list(dict.fromkeys(t for ahead in lists for t in ahead)):
                stage[0].set_modules_to_forward_prefetch(targets)
        for i, module in enumerate(backward):
            if targets := backward[i + 1:i + 1 + self.prefetch_depth]:
                module.set_modules_to_backward_prefetch(targets)

    # ---- training -------------------------------------------------------------------------------
    def clip_grad_by_norm(self, optimizer: torch.optim.Optimizer, max_norm: float) -> torch.Tensor:
        """Scale gradients so their global L2 norm is at most ``max_norm``; returns the norm before clipping."""
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        return clip_grads_(grads, max_norm, self.root_device)

    @contextmanager
    def block_backward_sync(self) -> Generator:
        """No reduce-scatter (or HSDP all-reduce) on non-final micro-batches of gradient accumulation."""
        if self._fsdp_root is None:
            yield
            return
        self._fsdp_root.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self._fsdp_root.set_requires_gradient_sync(True)

    def model_to_device(self) -> None:
        if not self.cpu_offload:
            return super().model_to_device()
        for child in self.lightning_module.children():  # sharded parameters stay in host memory
            if not isinstance(child, MoETransformer):
                child.to(self.root_device)
        self.lightning_module._device = self.root_device  # what `.to` would set: where batches and metrics go

    # ---- checkpoints (the I/O lives in parallel/checkpoint.py) ----------------------------------
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Optional[Any] = None) -> None:
        """A sharded directory, visible only once complete (see ``ShardedCheckpointer``)."""
        if not self._save_distributed_checkpoint:
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint(storage_options=...) is not supported.")
        state = {"state_dict": checkpoint.pop("state_dict")}
        state.update({f"optimizer_{i}": o for i, o in enumerate(checkpoint.pop("optimizer_states", []))})
        self.checkpointer.save(state, checkpoint, Path(self.broadcast(str(filepath))),
                               ckpt.expert_parameter_names(self.lightning_module), self.expert_mesh,
                               background=self.async_checkpoint and self._fitting)

    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """A sharded checkpoint written at any world size or ``expert_parallel_size``, or a single file.

        Always ``weights_only``: checkpoints hold plain data only, and loading one never runs code from it.
        """
        path = ckpt.resolve_checkpoint(Path(self.broadcast(str(checkpoint_path))))
        if not path.is_dir():
            return self._load_single_file(path)
        metadata = ckpt.checkpoint_metadata(path)  # refuses an unsafe file before any tensor is read
        config = getattr(self.lightning_module, "config", None)
        if config is not None:  # also for ckpt_path="last"/"best", which the CLI cannot see before the run
            check_resume(metadata.get("hyper_parameters", {}), {"config": config}, str(path))
        state = {"state_dict": get_model_state_dict(self.model)}
        state.update({f"optimizer_{i}": get_optimizer_state_dict(self.model, optimizer)
                      for i, optimizer in enumerate(self.optimizers)})
        self.checkpointer.load(path, state, ckpt.expert_parameter_names(self.lightning_module), self.expert_mesh)
        set_model_state_dict(self.model, state["state_dict"],
                             options=StateDictOptions(strict=self.lightning_module.strict_loading))
        for i, optimizer in enumerate(self.optimizers):
            set_optimizer_state_dict(self.model, optimizer, state[f"optimizer_{i}"])
        return metadata

    def _load_single_file(self, path: Path) -> dict[str, Any]:
        """A single-file checkpoint (full tensors, e.g. of a one-process run): every rank reads the file (memory-
        mapped) and copies out the part of each tensor its shards hold. (Lightning's own path keys the optimizer
        state by ``model.parameters()`` order, not the optimizer's, and ignores the ``ep`` split of experts.)"""
        checkpoint = ckpt.checkpoint_metadata(path)  # memory-mapped: each rank touches only the parts it holds
        config = getattr(self.lightning_module, "config", None)
        if config is not None:
            check_resume(checkpoint.get("hyper_parameters", {}), {"config": config}, str(path))
        full = checkpoint.pop("state_dict")
        names = ckpt.expert_parameter_names(self.lightning_module)
        state = get_model_state_dict(self.model)
        missing, unexpected = [k for k in state if k not in full], [k for k in full if k not in state]
        if self.lightning_module.strict_loading and (missing or unexpected):
            raise ckpt.CheckpointError(
                f"{path} does not fit the model: {len(missing)} keys missing from it {missing[:3]}, {len(unexpected)} "
                f"unexpected in it {unexpected[:3]}. Resume with the model config it was saved with, or set the "
                f"LightningModule's strict_loading = False to load only the matching keys.")
        with ckpt.global_expert_views(state, names, self.expert_mesh):
            for key, value in state.items():
                if key in full:
                    local = value.to_local() if isinstance(value, DTensor) else value
                    local.copy_(ckpt.local_part(full[key], value, f"{path}: {key}"))
        set_model_state_dict(self.model, state, options=StateDictOptions(strict=self.lightning_module.strict_loading))
        experts = {id(p) for name, p in self.model.named_parameters() if name in names}
        for optimizer, saved in zip(self.optimizers, checkpoint.pop("optimizer_states", [])):
            optimizer.load_state_dict(self._sharded_optimizer_state(optimizer, saved, experts, path))
        return checkpoint

    def _sharded_optimizer_state(self, optimizer: torch.optim.Optimizer, saved: dict, experts: set[int],
                                 path: Path) -> dict:
        """``saved`` (a full, id-keyed optimizer state) as ``optimizer.state_dict()`` of this rank's shards.
        Groups match by position, parameters by the groups' ``param_names`` (ids follow the writer's order)."""
        if len(saved["param_groups"]) != len(optimizer.param_groups):
            raise ckpt.CheckpointError(f"{path}: its optimizer has {len(saved['param_groups'])} parameter groups, "
                                       f"this run's {len(optimizer.param_groups)}: resume with the same optimizer.")

        def shard(value: Any, p: torch.Tensor, what: str) -> Any:
            if not isinstance(p, DTensor) or not torch.is_tensor(value) or value.ndim == 0:
                return value
            like = ckpt.global_expert_view(p, self.expert_mesh) if id(p) in experts and self.expert_mesh else p
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
                    raise ckpt.CheckpointError(
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

    def remove_checkpoint(self, filepath: _PATH) -> None:
        """Lightning's top-k rotation removes the previous checkpoint as a new save starts: while that save is
        written in the background, the removal waits for its commit (the previous one is the only complete copy)."""
        if not self.checkpointer.remove_after_commit(Path(filepath)):
            super().remove_checkpoint(filepath)

    def on_train_start(self) -> None:
        super().on_train_start()
        self._fitting = True

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        self.checkpointer.poll()  # commit a finished background save, or raise its error

    def on_train_end(self) -> None:
        super().on_train_end()
        self._fitting = False
        self.checkpointer.wait()
        self.barrier()  # the last checkpoint is visible to every rank when fit returns

    def on_exception(self, exception: BaseException) -> None:
        try:  # a save started before the failure holds a consistent state: finish it (the other ranks may be
            self.checkpointer.wait(agree=False)  # elsewhere: no collective of ours)
        except ckpt.CheckpointError as error:
            rank_zero_warn(str(error))
        super().on_exception(exception)

    def teardown(self) -> None:
        self.checkpointer.wait(agree=False)
        super().teardown()
