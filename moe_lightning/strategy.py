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

import shutil
from collections.abc import Generator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal, Optional, Union

import torch
import torch.distributed.checkpoint as dcp
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.fsdp import (CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy,
                                    fully_shard)
from torch.distributed.tensor import DTensor

from .model import GroupedExperts, MoETransformer
from .parallel import MeshError, MeshLayout, apply_expert_parallel
from .parallel import checkpoint as ckpt

DTypeName = Literal["auto", "bf16", "fp16", "fp32"]
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


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
        process_group_backend: ``nccl``/``gloo``; default from the device.
        timeout: Collective timeout.
    """

    def __init__(self, replicate_size: int = 1, shard_size: Union[int, Literal["auto"]] = "auto",
                 expert_parallel_size: int = 1, param_dtype: DTypeName = "auto", reduce_dtype: DTypeName = "auto",
                 reshard_after_forward: bool = True, prefetch_depth: int = 1, unshard_async_op: bool = False,
                 cpu_offload: bool = False, meta_init: bool = False, save_distributed_checkpoint: bool = True,
                 process_group_backend: Optional[str] = None, timeout: Optional[timedelta] = default_pg_timeout):
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
        self.replicate_size, self.shard_size, self.expert_parallel_size = replicate_size, shard_size, expert_parallel_size
        self.param_dtype, self.reduce_dtype = param_dtype, reduce_dtype
        self.reshard_after_forward, self.prefetch_depth = reshard_after_forward, prefetch_depth
        self.unshard_async_op, self.cpu_offload, self.meta_init = unshard_async_op, cpu_offload, meta_init
        self.layout: MeshLayout | None = None
        self.expert_mesh = None
        self._expert_fsdp_mesh = None  # the sub-mesh that FSDP-shards expert stacks under ep > 1
        self._fsdp_root: FSDPModule | None = None

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
        """Expert parallelism, then ``fully_shard`` per block, embedding, norm + head and root (idempotent)."""
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
        common = dict(mp_policy=MixedPrecisionPolicy(param_dtype=self._dtype(self.param_dtype, torch.bfloat16),
                                                     reduce_dtype=self._dtype(self.reduce_dtype, torch.float32)),
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
        if not tied:
            fully_shard([model.norm, model.output], mesh=dense_mesh, reshard_after_forward=False, **common)
            stages.append([model.norm])  # one FSDP unit for both; the norm runs first
        self._fsdp_root = fully_shard(model, mesh=dense_mesh, reshard_after_forward=False, **common)
        self._set_prefetch(stages)
        if on_meta:
            self._materialize(model)
            self._fill_pretrained()
        if self.unshard_async_op:
            for module in model.modules():
                if isinstance(module, FSDPModule):  # private in torch <= 2.13; a public name wins if present
                    (getattr(module, "set_unshard_async_op", None) or module._set_unshard_async_op)(True)

    @torch.no_grad()
    def _materialize(self, model: MoETransformer) -> None:
        """Allocate the local shards and run ``model.init_weights()`` on them as plain tensors.

        Each shard rank draws from its own seed (``initial seed + shard rank``; HSDP replicas share it),
        so shards differ and replicas agree, with element-wise initialisers, on CPU and CUDA alike.
        """
        model.to_empty(device="cpu" if self.cpu_offload else self.root_device)
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
        with self._expert_views(self.lightning_module.state_dict(keep_vars=True)) as state:
            fill(state)

    def _expert_placement(self, model: MoETransformer):
        """``shard_placement_fn``: the layout's choice for expert stacks, FSDP's default for the rest."""
        placement, message = self.layout.expert_placement(model.config.num_experts)
        rank_zero_info(f"{type(self).__name__}: {message}")
        expert_params = {id(p) for m in model.modules() if isinstance(m, GroupedExperts) for p in m.parameters()}
        return lambda param: placement if id(param) in expert_params else None

    def _set_prefetch(self, stages: list[list[nn.Module]]) -> None:
        """Explicit prefetch: each FSDP unit all-gathers the next ``prefetch_depth`` units of its pass."""
        if self.prefetch_depth == 0:
            return
        forward = [m for stage in stages for m in stage]
        backward = [m for stage in reversed(stages) for m in stage]
        for order, setter in ((forward, "set_modules_to_forward_prefetch"), (backward, "set_modules_to_backward_prefetch")):
            for i, module in enumerate(order):
                if ahead := order[i + 1:i + 1 + self.prefetch_depth]:
                    getattr(module, setter)(ahead)

    # ---- training -------------------------------------------------------------------------------
    @torch.no_grad()
    def clip_grad_by_norm(self, optimizer: torch.optim.Optimizer, max_norm: float) -> torch.Tensor:
        """Scale gradients so their global L2 norm is at most ``max_norm``; returns the norm before clipping.

        Norms are taken per mesh (each DTensor reduces over its own mesh); expert gradients, split over
        ``ep`` ranks, add their squares over the ``ep`` group.
        """
        grads_by_mesh: dict[Any, list[torch.Tensor]] = {}
        for group in optimizer.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    grads_by_mesh.setdefault(getattr(param.grad, "device_mesh", None), []).append(param.grad)
        total_sq = torch.zeros((), device=self.root_device)
        for mesh, grads in grads_by_mesh.items():
            norm = torch.nn.utils.get_total_norm(grads)
            # Reduce on the compute device: with cpu_offload the local norms live in host memory (NCCL rejects them).
            norm_sq = (norm.to_local() if isinstance(norm, DTensor) else norm).float().square().to(self.root_device)
            if isinstance(norm, DTensor):
                for dim, placement in enumerate(norm.placements):
                    if placement.is_partial():
                        torch.distributed.all_reduce(norm_sq, group=norm.device_mesh.get_group(dim))
            if self._expert_fsdp_mesh is not None and mesh == self._expert_fsdp_mesh:
                torch.distributed.all_reduce(norm_sq, group=self.expert_mesh["ep"].get_group())
            total_sq += norm_sq
        total = total_sq.sqrt()
        scale = max_norm / (total.item() + 1e-6)
        if scale < 1:
            for grads in grads_by_mesh.values():
                torch._foreach_mul_(grads, scale)
        return total

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

    # ---- checkpoints ----------------------------------------------------------------------------
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Optional[Any] = None) -> None:
        """Write into ``<path>.partial`` on all ranks, then rename over ``path``: never a half-written checkpoint."""
        if not self._save_distributed_checkpoint:
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint(storage_options=...) is not supported.")
        path = Path(self.broadcast(str(filepath)))
        partial = path.with_name(path.name + ckpt.PARTIAL_SUFFIX)
        if self.is_global_zero and partial.exists():
            shutil.rmtree(partial)  # left behind by a run killed while writing
        self.barrier()
        state = {"state_dict": checkpoint.pop("state_dict")}
        state.update({f"optimizer_{i}": o for i, o in enumerate(checkpoint.pop("optimizer_states", []))})
        with self._expert_views(state):
            dcp.save(state, checkpoint_id=partial)
        if self.is_global_zero:
            torch.save(checkpoint, partial / ckpt.METADATA_FILE)
        self.barrier()
        self._commit(partial, path)
        self.barrier()

    def _commit(self, partial: Path, path: Path) -> None:
        if self.is_global_zero:
            ckpt.commit_directory(partial, path)

    def _expert_views(self, state: dict):
        """Expert stacks seen as global ``[E, ...]`` tensors while DCP saves or loads ``state``."""
        return ckpt.global_expert_views(state, ckpt.expert_parameter_names(self.lightning_module), self.expert_mesh)

    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Load a sharded checkpoint written at any world size or ``expert_parallel_size``."""
        path = ckpt.resolve_checkpoint(Path(self.broadcast(str(checkpoint_path))))
        if not (path / ckpt.METADATA_FILE).is_file():
            return super().load_checkpoint(path, weights_only)
        state = {"state_dict": get_model_state_dict(self.model)}
        state.update({f"optimizer_{i}": get_optimizer_state_dict(self.model, optimizer)
                      for i, optimizer in enumerate(self.optimizers)})
        with self._expert_views(state):
            dcp.load(state, checkpoint_id=path)
        set_model_state_dict(self.model, state["state_dict"],
                             options=StateDictOptions(strict=self.lightning_module.strict_loading))
        for i, optimizer in enumerate(self.optimizers):
            set_optimizer_state_dict(self.model, optimizer, state[f"optimizer_{i}"])
        # Our own metadata (it pickles the model config), so full unpickling unless the caller forbids it.
        return torch.load(path / ckpt.METADATA_FILE, weights_only=bool(weights_only))
