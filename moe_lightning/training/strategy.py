"""The FSDP2 strategy: HSDP + expert parallelism applied to ``MoETransformer`` without touching model code.

Select it from YAML::

    trainer:
      strategy:
        class_path: moe_lightning.training.strategy.MoEFSDPStrategy
        init_args: {replicate_size: 1, expert_parallel_size: 2}

Initialisation, two ways:
- default: ``configure_model`` builds the whole model on the CPU of every rank from the same seeded RNG
  (Lightning re-seeds each rank before the build), so the sharded model is bit-identical to a
  one-process run; each rank then keeps only its shards. Needs the full model in host memory.
- ``meta_init=True``: the model is built on the meta device, sharded, and only each rank's shards are
  allocated and filled by ``model.init_weights()`` (see ``parallel/fsdp.py``). Deterministic for a seed and
  layout, but not equal to a one-process build. For models that do not fit one host.
"""

from collections.abc import Generator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal, Optional, Union

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.fsdp import FSDPModule

from moe_lightning.dtypes import DTYPES
from moe_lightning.model import MoETransformer
from moe_lightning.parallel import MeshError, MeshLayout, apply_expert_parallel, fsdp
from moe_lightning.checkpoint import reshard
from moe_lightning.checkpoint import sharded as ckpt
from moe_lightning.training.checkpoint_io import FileCheckpointIO
from moe_lightning.parallel.clip import clip_grads_
from moe_lightning.checkpoint.compat import check_resume

DTypeName = Literal["auto", "bf16", "fp16", "fp32", "bfloat16", "float16", "float32"]  # dtypes.DTYPES


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
        accumulate_unsharded_grads: Under gradient accumulation, keep every unit's full (unsharded) gradient
            across micro-batches and reduce-scatter once per step, instead of reduce-scattering every micro-batch
            into the sharded gradients. Saves the reduce-scatters of the non-final micro-batches, but costs each
            rank ``reduce_dtype`` bytes (fp32: 4) x (dense parameters + routed expert parameters / ``ep``) on the
            compute device for the whole step: 104 GiB per GPU at 1t.yaml's shape (``moe-lightning plan
            --accumulate-unsharded-grads`` prices it). The HSDP all-reduce waits for the last micro-batch either way.
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
                 cpu_offload: bool = False, accumulate_unsharded_grads: bool = False, meta_init: bool = False,
                 save_distributed_checkpoint: bool = True,
                 async_checkpoint: bool = False, process_group_backend: Optional[str] = None,
                 timeout: Optional[timedelta] = default_pg_timeout):
        super().__init__(save_distributed_checkpoint=save_distributed_checkpoint,
                         process_group_backend=process_group_backend, timeout=timeout)
        for name, value in (("param_dtype", param_dtype), ("reduce_dtype", reduce_dtype)):
            if value != "auto" and value not in DTYPES:
                raise MeshError(f"strategy.{name}={value!r}: use one of 'auto', {', '.join(map(repr, DTYPES))}.")
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
        self.accumulate_unsharded_grads = accumulate_unsharded_grads
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
        # Lightning runs a standalone validate/test/predict under torch.inference_mode unless the backend is gloo or
        # the strategy is its own FSDPStrategy (loops/utilities.py, _no_grad_context). FSDP2's all-gather buffers
        # made there are inference tensors, and the next training all-gather writes into them and fails ("Inplace
        # update to inference tensor outside InferenceMode"): evaluate under no_grad, as inside fit.
        for loop in (trainer.validate_loop, trainer.test_loop, trainer.predict_loop):
            loop.inference_mode = False
        # Lightning clips through the precision plugin with one norm over all gradients, which cannot
        # combine DTensors of different meshes (dense and expert); the strategy's norm can.
        self.precision_plugin.clip_grad_by_norm = self.clip_grad_by_norm

    def _dtype(self, name: DTypeName, cuda_default: torch.dtype | None) -> torch.dtype | None:
        if name == "auto":
            return cuda_default if self.root_device.type == "cuda" else None
        return DTYPES[name]

    def _parallelize(self) -> None:
        """The sequence in ``parallel/fsdp.py`` with this strategy's arguments (idempotent)."""
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
            rank_zero_info(apply_expert_parallel(model.moe_layers(), self.expert_mesh["ep"].get_group(),
                                                 ranks_per_node=self.num_processes))
        placement, message = self.layout.expert_placement(E)
        rank_zero_info(f"{type(self).__name__}: {message}")
        policy = fsdp.FSDPPolicy(param_dtype=self._dtype(self.param_dtype, torch.bfloat16),
                                 reduce_dtype=self._dtype(self.reduce_dtype, torch.float32),
                                 reshard_after_forward=self.reshard_after_forward, cpu_offload=self.cpu_offload,
                                 expert_placement=placement)
        stages = fsdp.apply_fsdp(model, self._device_mesh, self._expert_fsdp_mesh, policy)
        self._fsdp_root = model
        fsdp.set_prefetch(model, stages, self.prefetch_depth)
        if on_meta:  # (otherwise fully_shard has moved the buffers to the mesh's device)
            fsdp.materialize(model, self.param_device, self.root_device,
                             seed=torch.initial_seed() + self.global_rank % self.layout.shard)
            fsdp.fill_pretrained(self.lightning_module, self.expert_mesh)
        if self.unshard_async_op:
            fsdp.set_unshard_async_op(model)

    @property
    def param_device(self) -> torch.device:
        """Where sharded parameters, their gradients and the optimizer state live (buffers: ``root_device``)."""
        return torch.device("cpu") if self.cpu_offload else self.root_device

    # ---- training -------------------------------------------------------------------------------
    def clip_grad_by_norm(self, optimizer: torch.optim.Optimizer, max_norm: float) -> torch.Tensor:
        """Scale gradients so their global L2 norm is at most ``max_norm``; returns the norm before clipping."""
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        return clip_grads_(grads, max_norm, self.root_device)

    @contextmanager
    def block_backward_sync(self) -> Generator:
        """Non-final micro-batches of gradient accumulation: each still reduce-scatters (sharded gradients
        accumulate; nothing unsharded outlives its unit's backward) and only the HSDP all-reduce waits for the last
        one. With ``accumulate_unsharded_grads``, no reduction at all (every unit keeps its full gradient)."""
        if self._fsdp_root is None:
            yield
            return
        root = self._fsdp_root
        block = root.set_requires_gradient_sync if self.accumulate_unsharded_grads else root.set_requires_all_reduce
        block(False)
        try:
            yield
        finally:
            block(True)

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
        """A single-file checkpoint (full tensors, e.g. of a one-process run), read into the shards (memory-mapped;
        see ``parallel/reshard.py``)."""
        checkpoint = ckpt.checkpoint_metadata(path)  # memory-mapped: each rank touches only the parts it holds
        config = getattr(self.lightning_module, "config", None)
        if config is not None:  # also for ckpt_path="last"/"best", which the CLI cannot see before the run
            check_resume(checkpoint.get("hyper_parameters", {}), {"config": config}, str(path))
        return reshard.load_full_checkpoint(checkpoint, path, self.lightning_module, self.model, self.optimizers,
                                            self.expert_mesh)

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
