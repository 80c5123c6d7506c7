"""``MoEFSDPStrategy``: Lightning's face of FSDP2/HSDP with expert and context parallelism; it delegates. The layout is
one ``ParallelMesh`` (``parallel/mesh.py``: every dimension by name, validated and built once, in
``setup_environment``); the model is parallelized by ``parallel.parallelize.parallelize_moe`` (its docstring states
the order), gradients are clipped by
``parallel/clip.py``, accumulated under ``parallel/fsdp.py``'s policy, checkpoints go through ``CheckpointHooks``."""

from collections.abc import Callable, Generator
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from functools import partial
from typing import Any, Literal, Optional, Union

import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from moe_lightning.checkpoint.sharded import ShardedCheckpointer
from moe_lightning.dtypes import DTYPES
from moe_lightning.model import MoEConfig, MoETransformer
from moe_lightning.parallel import fsdp
from moe_lightning.parallel.clip import clip_grads_
from moe_lightning.parallel.mesh import MeshLayout, ParallelMesh, resolve_layout
from moe_lightning.parallel.parallelize import Sharding, check_strategy_arguments, parallelize_moe, the_transformer
from moe_lightning.parallel.pipeline import PipelineError, PipelineLayout, PipelineRunner, SCHEDULES, SPLIT_BACKWARD, \
    check_batch, check_torch_runs, reads_embedding_last, resolve_pipeline
from moe_lightning.run import flight_recorder
from moe_lightning.run.refusals import same_on_every_rank
from moe_lightning.run.watchdog import DEFAULT_STALL_TIMEOUT_S, check_stall_timeout
from moe_lightning.optim.muon import Muon
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
        reshard_after_forward: Free gathered block parameters after forward (the head and root keep theirs);
            forced off, with a log line, under the pipeline schedules that split backward (their weight pass).
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
        pipeline_parallel_size: Pipeline stages (``docs/pipeline.md``): ``replicate x pp x shard`` ranks, a stage's
            shard ranks neighbours; each stage holds its blocks (the first the embedding, the last the norm, head,
            loss and MTP), and torch's schedule runs the step's micro-batches through them.
        pipeline_schedule: torch's schedule (``docs/pipeline.md``): one stage per rank, ``"1F1B"`` (default) or
            ``"GPipe"``; several, ``"Interleaved1F1B"``, ``"LoopedBFS"`` or ``"InterleavedZeroBubble"`` (stages
            round-robin over the ranks), ``"ZBVZeroBubble"`` or ``"DualPipeV"`` (2 stages a rank, in a V; refused
            with MTP or a tied head, whose embedding both ends of the V would run).
        pipeline_microbatches: Micro-batches the per-rank batch splits into (at least one per pipeline rank;
            default: as many as pipeline ranks, twice that for DualPipeV, torch's least). They replace
            ``accumulate_grad_batches``, which must stay 1.
        pipeline_stages_per_rank: Stages each pipeline rank holds (``pipeline_parallel_size x`` this many in all,
            at most ``n_layers``); default 1, or 2 for the schedules of several. The rank's model is the union of its
            stages (names kept); torch runs a view of each.
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
                 pipeline_parallel_size: int = 1, pipeline_schedule: str = "1F1B",
                 pipeline_microbatches: Optional[int] = None, pipeline_stages_per_rank: Optional[int] = None,
                 stall_timeout: float = DEFAULT_STALL_TIMEOUT_S):
        super().__init__(save_distributed_checkpoint=save_distributed_checkpoint,
                         process_group_backend=process_group_backend, timeout=timeout)
        check_strategy_arguments(replicate_size, shard_size, expert_parallel_size, param_dtype, reduce_dtype,
                                 prefetch_depth, save_distributed_checkpoint, async_checkpoint, context_parallel_size,
                                 ep_overlap_chunks, dispatch_dtype, pipeline_parallel_size)  # before any launch
        self.pipeline_parallel_size, self.pipeline_schedule = pipeline_parallel_size, pipeline_schedule
        self.pipeline_microbatches, self.pipeline_stages_per_rank = pipeline_microbatches, pipeline_stages_per_rank
        self.pipeline: PipelineLayout | None = None  # the stages, resolved in setup_environment (pp > 1)
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
        layout = self.layout or MeshLayout.resolve(  # before setup (a resume's checks): the same from the arguments
            self.world_size, self.replicate_size, self.shard_size, self.expert_parallel_size, None,
            self.context_parallel_size, pipeline_parallel_size=self.pipeline_parallel_size)
        return {"num_replicas": layout.data_parallel, "rank": layout.data_parallel_rank(self.global_rank)}

    @property
    def layout(self) -> MeshLayout | None:
        """The validated sizes of every dimension (``MeshLayout``), once the environment is set up."""
        return None if self.parallel is None else self.parallel.layout

    def setup_environment(self) -> None:
        module = self.lightning_module  # the data's seq_len is checked here, before the model is built
        seq_len = getattr(module.trainer.datamodule, "seq_len", None) if module._trainer is not None else None
        try:  # every rank checks the same config alike: rank 0 alone says a refusal (run/refusals.py)
            layout = resolve_layout(self.num_nodes * self.num_processes, self.replicate_size, self.shard_size,
                                    self.expert_parallel_size, self.context_parallel_size, module.config, seq_len,
                                    self.pipeline_parallel_size)
            if layout.pp > 1:  # every pipeline refusal before any process group exists (here, not in __init__:
                # jsonargparse would bury the one line in its own multi-line error)
                _check_pipeline_arguments(self.pipeline_schedule, self.cpu_offload,
                                          self._save_distributed_checkpoint, module.config)
                self.pipeline = resolve_pipeline(module.config, layout.pp, self.pipeline_schedule,
                                                 self.pipeline_microbatches, self.pipeline_stages_per_rank,
                                                 seq_len=seq_len)
                _check_pipeline_trainer(module.trainer if module._trainer is not None else None, self.pipeline)
        except ValueError as refusal:
            raise same_on_every_rank(refusal)
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
        module.ranks_per_batch = layout.cp * layout.pp  # a pipeline's stages read one batch, as a CP group does
        module.sum_expert_counts = partial(dist.all_reduce, group=self.parallel.group("stage"))  # same MoE layers
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
        for optimizer in self.optimizers:  # FlexShard's plan agrees over the ranks training the same matrices
            if isinstance(optimizer, Muon):
                optimizer.trainers_group = self.parallel.group("stage")  # a pipeline stage's (None: every rank)
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
                            torch.initial_seed() + self.layout.rank_in_replica(self.global_rank),
                            self.ep_overlap_chunks,
                            getattr(torch, self.dispatch_dtype) if self.dispatch_dtype else None, self.pipeline,
                            getattr(module, "loss_chunk_size", None))
        fill = module.fill_pretrained if getattr(module, "pretrained", None) is not None else None
        for message in parallelize_moe(model, sharding, compile=getattr(module, "compile_each_block", False),
                                       wrap_blocks=wrap_blocks, fill_pretrained=fill):
            rank_zero_info(f"{type(self).__name__}: {message}")
        self._fsdp_root = model
        if self.pipeline is not None and getattr(module, "pipeline", None) is None:
            module.pipeline = PipelineRunner(model.pipeline_parts, self.pipeline, self.parallel.group("pp"),
                                             self.root_device, sharding.param_dtype or torch.get_default_dtype(),
                                             self.parallel.group("pp_ends"))

    @property
    def param_device(self) -> torch.device:
        """Where sharded parameters, their gradients and the optimizer state live (buffers: ``root_device``)."""
        return torch.device("cpu") if self.cpu_offload else self.root_device

    def clip_grad_by_norm(self, optimizer: torch.optim.Optimizer, max_norm: float) -> torch.Tensor:
        """Scale gradients so their global L2 norm is at most ``max_norm``; returns the norm before clipping.
        Under pipeline parallelism the norm is over every stage; the last stage's copy of the token embedding
        (its gradient the same summed one as the first stage's) counts once, and is scaled alike."""
        copy = self._embedding_copy()
        grads = [p.grad for group in optimizer.param_groups for p in group["params"]
                 if p.grad is not None and p is not copy]
        total = clip_grads_(grads, max_norm, self.root_device)
        if copy is not None and copy.grad is not None:
            local = copy.grad.to_local() if hasattr(copy.grad, "to_local") else copy.grad
            local.mul_(torch.clamp(max_norm / (total + 1e-6), max=1.0).to(local.device))
        return total

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """Under pipeline parallelism keyed by parameter name (``param_groups.<name>.lr``): each stage holds other
        parameter groups, so a group's index means nothing across ranks (``checkpoint.state.load_state``)."""
        if self.pipeline is None or not self._save_distributed_checkpoint:
            return super().optimizer_state(optimizer)
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
        optimizer = getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer's
        return get_optimizer_state_dict(self.model, optimizer,
                                        options=StateDictOptions(flatten_optimizer_state_dict=True, cpu_offload=True))

    def _embedding_copy(self) -> torch.nn.Parameter | None:
        """The last pipeline stage's copy of the token embedding (MTP or a tied head reads it there)."""
        model = self._fsdp_root
        if self.pipeline is None or model is None or model.pipeline_first or model.tok_embeddings is None:
            return None
        return model.tok_embeddings.weight

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """Under pipeline parallelism the module's step runs the schedule, forward and backward over the
        micro-batches (``module.pipeline``): the gradients are zeroed before it, not by Lightning between the step
        and its backward (the module's ``optimizer_zero_grad`` then does nothing; see ``backward``)."""
        if self.pipeline is not None:
            for optimizer in self.optimizers:
                optimizer.zero_grad(set_to_none=True)
        return super().training_step(*args, **kwargs)

    def backward(self, closure_loss: torch.Tensor, optimizer: Optional[torch.optim.Optimizer], *args: Any,
                 **kwargs: Any) -> torch.Tensor:
        """Under pipeline parallelism the schedule has run backward inside the training step: Lightning's
        before/after-backward hooks run, autograd does not run again (NeMo's Megatron strategy skips it alike)."""
        if self.pipeline is None:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, self.lightning_module)
        return self.precision_plugin.post_backward(closure_loss, self.lightning_module)

    def block_backward_sync(self):
        root = self._fsdp_root
        return nullcontext() if root is None else fsdp.accumulating(root, self.accumulate_unsharded_grads)

    def model_to_device(self) -> None:
        if not self.cpu_offload:
            return super().model_to_device()
        fsdp.move_all_but(self.lightning_module, MoETransformer, self.root_device)  # shards stay in host memory
        self.lightning_module._device = self.root_device  # what `.to` would set: where batches and metrics go


def _check_pipeline_arguments(schedule: str, cpu_offload: bool = False,
                              save_distributed_checkpoint: bool = True, config: MoEConfig | None = None) -> None:
    """What this strategy composes with pipeline stages yet (one line each)."""
    if schedule in SCHEDULES and SCHEDULES[schedule][1] == "v" and config is not None \
            and reads_embedding_last(config):  # a V's rank 0 runs the first and the last stage: one embedding
        raise PipelineError(f"strategy.pipeline_schedule={schedule!r} puts the first and the last stage on one rank, "
                            f"and with model.config.mtp_layers={config.mtp_layers} and tie_embeddings="
                            f"{config.tie_embeddings} both would run its one token embedding (two FSDP roots cannot "
                            "share it): use 'Interleaved1F1B' or 'InterleavedZeroBubble'.")
    if cpu_offload:  # the embedding copies' gradient sum would all-reduce host tensors over the device's group
        raise PipelineError("strategy.cpu_offload=True with pipeline_parallel_size > 1: the stages' shared "
                            "embedding gradient is summed over the accelerator's group; set cpu_offload=False.")
    if not save_distributed_checkpoint:  # rank 0 alone writes a single file, and it holds stage 0 only
        raise PipelineError("strategy.save_distributed_checkpoint=False with pipeline_parallel_size > 1: a "
                            "single-file checkpoint would hold the first stage only; set it to True.")
    check_torch_runs(schedule, torch.__version__)


def _check_pipeline_trainer(trainer, layout: PipelineLayout) -> None:
    """The trainer's and the data's settings the stages need (one line each, before any process group)."""
    if trainer is None:
        return
    if trainer.accumulate_grad_batches != 1:
        raise PipelineError(f"trainer.accumulate_grad_batches={trainer.accumulate_grad_batches} with "
                            f"pipeline_parallel_size={layout.size}: the pipeline's micro-batches are the accumulation; "
                            f"set it to 1 and raise strategy.pipeline_microbatches (now {layout.microbatches}) with "
                            "data.batch_size instead.")
    if layout.schedule in SPLIT_BACKWARD and any(isinstance(c, ActivationOffload) for c in trainer.callbacks):
        raise PipelineError(f"ActivationOffload with strategy.pipeline_schedule={layout.schedule!r}: torch's weight "
                            "pass takes each parameter group's gradient in a backward of its own, and each one "
                            "recomputes every checkpointed block again; use "
                            "'Interleaved1F1B' or '1F1B' with it, or remove the callback.")
    batch_size = getattr(trainer.datamodule, "batch_size", None)
    if isinstance(batch_size, int):
        check_batch(batch_size, layout)
