"""``MoEFSDPStrategy``: Lightning's face of FSDP2/HSDP with expert and context parallelism; it delegates. The layout is
one ``ParallelMesh`` (``parallel/mesh.py``: every dimension by name, validated and built once, in
``setup_environment``); the model is parallelized by ``parallel.parallelize.parallelize_moe`` (its docstring states
the order), gradients are clipped by
``parallel/clip.py``, accumulated under ``parallel/fsdp.py``'s policy, checkpoints go through ``CheckpointHooks``."""

from collections.abc import Callable, Generator
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from typing import Any, Literal, Optional, Union

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from moe_lightning.checkpoint.sharded import ShardedCheckpointer
from moe_lightning.dtypes import DTYPES
from moe_lightning.model import MoETransformer
from moe_lightning.parallel import fsdp
from moe_lightning.parallel.clip import clip_grads_
from moe_lightning.parallel.mesh import MeshLayout, ParallelMesh, resolve_layout
from moe_lightning.parallel.parallelize import Sharding, check_strategy_arguments, parallelize_moe, the_transformer
from moe_lightning.run import flight_recorder
from moe_lightning.run.watchdog import DEFAULT_STALL_TIMEOUT_S, check_stall_timeout
from moe_lightning.training.callbacks.activation_offload import ActivationOffload
from moe_lightning.training.callbacks.stall_watchdog import StallWatchdog
from moe_lightning.training.checkpoint_io import CheckpointHooks, FileCheckpointIO
from moe_lightning.training.lightning_internals import evaluate_under_no_grad

DTypeName = Literal["auto", "bf16", "fp16", "fp32", "bfloat16", "float16", "float32"]  # dtypes.DTYPES


class MoEFSDPStrategy(CheckpointHooks, ModelParallelStrategy):
    """FSDP2 / HSDP with expert and context parallelism for ``MoETransformer``, sharded checkpoints, exact resume.

    Args:
        replicate_size: HSDP replicas (each holds a full copy of the model, sharded within the replica).
        shard_size: Ranks that shard one replica; ``"auto"`` = world size / ``replicate_size``.
        expert_parallel_size: Ranks of a replica that split the experts (must divide ``shard_size`` and
            ``num_experts``); the other ``shard_size / ep`` ranks shard each expert block FSDP-style.
        context_parallel_size: ``N`` neighbouring ranks share every sequence (``data.seq_len`` a multiple of ``2N``),
            each computing 2 of its ``2N`` chunks; they read the same batches and, folded into the shard ranks, shard
            parameters and reduce gradients too (``docs/context_parallel.md``). Must divide ``shard_size``.
        ep_overlap_chunks: Chunks each MoE layer's tokens are pipelined through under expert parallelism. Default 1
            keeps the unchunked order of sums and full-size expert groups; 2 hides up to half the exchange (measure
            ``benchmarks/ep_dispatch.py`` on the GPUs first: it halves the experts' matmuls).
        dispatch_dtype: ``"float8_e4m3fn"``: FP8 dispatch hops (the combine and gradients keep the training dtype).
        param_dtype: Dtype of unsharded parameters in forward/backward (``auto``: bf16 on GPU, fp32 on CPU).
        reduce_dtype: Dtype of gradient reduction (``auto``: fp32).
        reshard_after_forward: Free gathered block parameters after forward (the head and root keep theirs).
        prefetch_depth: How many FSDP units ahead to all-gather, forward and backward (0: FSDP's default).
        unshard_async_op: All-gather in the compute stream's memory pool instead of a side stream.
        cpu_offload: Keep sharded parameters, gradients and optimizer state in host memory.
        accumulate_unsharded_grads: Keep full gradients across micro-batches, reduce-scatter once per step (104 GiB
            per GPU at 1t.yaml: ``moe-lightning plan --accumulate-unsharded-grads``).
        meta_init: Build on the meta device and materialise only each rank's shards (deterministic for a seed and
            layout). Default: every rank builds the whole model from one seed, bit-identical to one process.
        save_distributed_checkpoint: Sharded checkpoint directories (``False``: one full file from rank 0).
        async_checkpoint: Write sharded checkpoints in the background (one in flight; a failure raises next batch).
        process_group_backend: ``nccl``/``gloo``; default from the device.
        timeout: Collective timeout.
        stall_timeout: Seconds a rank may make no progress before a surviving rank names it and every live rank
            exits with status 69 (``run/watchdog.py``, ``docs/distributed.md``); 0 turns the watchdog off.
    """

    def __init__(self, replicate_size: int = 1, shard_size: Union[int, Literal["auto"]] = "auto",
                 expert_parallel_size: int = 1, context_parallel_size: int = 1, ep_overlap_chunks: int = 1,
                 dispatch_dtype: Optional[Literal["float8_e4m3fn"]] = None, param_dtype: DTypeName = "auto",
                 reduce_dtype: DTypeName = "auto", reshard_after_forward: bool = True, prefetch_depth: int = 1,
                 unshard_async_op: bool = False, cpu_offload: bool = False, accumulate_unsharded_grads: bool = False,
                 meta_init: bool = False, save_distributed_checkpoint: bool = True, async_checkpoint: bool = False,
                 process_group_backend: Optional[str] = None, timeout: Optional[timedelta] = default_pg_timeout,
                 stall_timeout: float = DEFAULT_STALL_TIMEOUT_S):
        super().__init__(save_distributed_checkpoint=save_distributed_checkpoint,
                         process_group_backend=process_group_backend, timeout=timeout)
        check_strategy_arguments(replicate_size, shard_size, expert_parallel_size, param_dtype, reduce_dtype,
                                 prefetch_depth, save_distributed_checkpoint, async_checkpoint, context_parallel_size,
                                 ep_overlap_chunks, dispatch_dtype)  # before any launch
        self.stall_timeout = check_stall_timeout(stall_timeout)
        self.replicate_size, self.shard_size, self.expert_parallel_size = replicate_size, shard_size, expert_parallel_size
        self.context_parallel_size, self.ep_overlap_chunks = context_parallel_size, ep_overlap_chunks
        self.dispatch_dtype, self.param_dtype, self.reduce_dtype = dispatch_dtype, param_dtype, reduce_dtype
        self.reshard_after_forward, self.prefetch_depth = reshard_after_forward, prefetch_depth
        self.unshard_async_op, self.cpu_offload, self.meta_init = unshard_async_op, cpu_offload, meta_init
        self.accumulate_unsharded_grads, self.async_checkpoint = accumulate_unsharded_grads, async_checkpoint
        self.parallel: ParallelMesh | None = None  # every parallel dimension, by name: built in setup_environment
        self._fsdp_root: MoETransformer | None = None  # sharded by _parallelize
        self.checkpointer = ShardedCheckpointer()
        self.checkpoint_io = FileCheckpointIO()  # single-file saves (save_distributed_checkpoint=False)

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """The data-parallel replicas: the ranks of a context-parallel group read the same sequences."""
        if self.parallel is None:
            raise RuntimeError(f"{type(self).__name__}.distributed_sampler_kwargs is known once the environment is "
                               "set up (setup_environment builds the layout).")
        return {"num_replicas": self.parallel.data_parallel_size, "rank": self.parallel.data_parallel_rank}

    @property
    def layout(self) -> MeshLayout | None:
        """The validated sizes of every dimension (``MeshLayout``), once the environment is set up."""
        return None if self.parallel is None else self.parallel.layout

    def setup_environment(self) -> None:
        module = self.lightning_module  # the data's seq_len is checked here, before the model is built
        seq_len = getattr(module.trainer.datamodule, "seq_len", None) if module._trainer is not None else None
        layout = resolve_layout(self.num_nodes * self.num_processes, self.replicate_size, self.shard_size,
                                self.expert_parallel_size, self.context_parallel_size, module.config, seq_len)
        trainer = module._trainer
        if trainer is not None and self.root_device.type == "cuda":  # read when NCCL's groups are made
            flight_recorder.enable(trainer.default_root_dir)
        self._setup_distributed()
        if self.parallel is None or self.parallel.layout != layout:  # once per process: fit after validate reuses it
            self.parallel = ParallelMesh(layout, self.root_device.type)
        watched = trainer is None or any(isinstance(c, StallWatchdog) for c in trainer.callbacks)  # one from YAML
        if self.stall_timeout and not watched:
            trainer.callbacks.insert(0, StallWatchdog(self.stall_timeout))  # first: its phase marks precede the rest
        self._device_mesh = module._device_mesh = self.parallel.dense  # Lightning's, for users' code (not ours)
        module.parallelized_by_strategy = True  # so it does not compile the blocks itself
        module.ranks_per_sequence = layout.cp  # its loss is a share of each sequence's: scale it (module.py)
        self.checkpointer.use_groups(self.parallel.side_channel("checkpoint"),
                                     self.parallel.side_channel("checkpoint_writer"))
        rank_zero_info(f"{type(self).__name__}: {layout.replicate} replica(s) x {layout.shard} shard ranks, "
                       f"expert_parallel_size={layout.ep}, context_parallel_size={layout.cp}.")

    @contextmanager
    def tensor_init_context(self, empty_init: Optional[bool] = None) -> Generator[None, None, None]:
        pretrained = getattr(self.lightning_module, "pretrained", None) is not None  # read per shard, never in full
        with super().tensor_init_context((self.meta_init or pretrained) if empty_init is None else empty_init):
            yield

    def setup(self, trainer) -> None:
        offload = [cb for cb in trainer.callbacks if isinstance(cb, ActivationOffload)]  # its wish: wrap the blocks
        self._parallelize(offload[0].wrap if offload and trainer.state.fn == TrainerFn.FITTING else None)
        super().setup(trainer)
        evaluate_under_no_grad(trainer)
        # Lightning clips with one norm over all gradients, which cannot combine DTensors of two meshes; ours can.
        self.precision_plugin.clip_grad_by_norm = self.clip_grad_by_norm

    def _dtype(self, name: DTypeName, cuda_default: torch.dtype | None) -> torch.dtype | None:
        return (cuda_default if self.root_device.type == "cuda" else None) if name == "auto" else DTYPES[name]

    def _parallelize(self, wrap_blocks: Callable[[MoETransformer], None] | None = None) -> None:
        """``parallelize_moe`` with this strategy's arguments and the module's wishes (a no-op once sharded)."""
        module, model = self.lightning_module, the_transformer(self.lightning_module, type(self).__name__)
        sharding = Sharding(self.parallel, self._dtype(self.param_dtype, torch.bfloat16),
                            self._dtype(self.reduce_dtype, torch.float32), self.reshard_after_forward, self.cpu_offload,
                            self.prefetch_depth, self.unshard_async_op, self.param_device, self.root_device,
                            torch.initial_seed() + self.global_rank % self.layout.shard, self.ep_overlap_chunks,
                            getattr(torch, self.dispatch_dtype) if self.dispatch_dtype else None)
        fill = module.fill_pretrained if getattr(module, "pretrained", None) is not None else None
        for message in parallelize_moe(model, sharding, compile=getattr(module, "compile_each_block", False),
                                       wrap_blocks=wrap_blocks, fill_pretrained=fill):
            rank_zero_info(f"{type(self).__name__}: {message}")
        self._fsdp_root = model

    @property
    def param_device(self) -> torch.device:
        """Where sharded parameters, their gradients and the optimizer state live (buffers: ``root_device``)."""
        return torch.device("cpu") if self.cpu_offload else self.root_device

    def clip_grad_by_norm(self, optimizer: torch.optim.Optimizer, max_norm: float) -> torch.Tensor:
        """Scale gradients so their global L2 norm is at most ``max_norm``; returns the norm before clipping."""
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        return clip_grads_(grads, max_norm, self.root_device)

    def block_backward_sync(self):
        root = self._fsdp_root
        return nullcontext() if root is None else fsdp.accumulating(root, self.accumulate_unsharded_grads)

    def model_to_device(self) -> None:
        if not self.cpu_offload:
            return super().model_to_device()
        fsdp.move_all_but(self.lightning_module, MoETransformer, self.root_device)  # shards stay in host memory
        self.lightning_module._device = self.root_device  # what `.to` would set: where batches and metrics go
