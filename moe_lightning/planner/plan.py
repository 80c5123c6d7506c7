"""``moe-lightning plan``: will a config fit the cluster, and how fast could it train? Decide before queueing.

It plans the run the YAML describes: the trainer's nodes and devices, ``MoEFSDPStrategy``'s mesh sizes,
``cpu_offload`` and ``prefetch_depth``, whether ``ActivationOffload`` is among the callbacks (and its
``prefetch``), the optimizer (Muon or AdamW, by ``class_path``), the model's ``loss_chunk_size`` and the
data's ``batch_size`` and ``seq_len``; command-line flags override any of them.
Everything is counted on the meta device (no memory allocated) and priced with the formulas below.
Notation: P parameters, S FSDP shard-group size (``--shard-size``), b micro-batch, s sequence length,
d model dim, L layers, V vocabulary, K top-k; bytes are per GPU unless stated.

- Sharded parameters: ``4·P / S`` (fp32 master copy; FSDP2 gathers bf16 for compute).
- Gradients: ``4·P / S`` (fp32 after the reduce-scatter).
- Optimizer state: AdamW ``8·P / S`` (two fp32 moments). Muon ``(4·P_muon + 8·P_adamw) / S``: one fp32
  momentum for block matrices and expert stacks, AdamW's two for embedding, head, router and norms.
  ``--cpu-offload`` moves these three to host memory (FSDP2 ``CPUOffloadPolicy``), parameters and gradients
  pinned, one block per parameter shard: each priced rounded up to a power of two (see below).
- Boundary activations: ``L · b · s · d · 2`` (bf16 input of every checkpointed block). Offloaded
  (``ActivationOffload``), they live in host memory and the GPU keeps ``(1 + offload prefetch)`` of them:
  the block in backward and those being copied back. Pinned host memory comes from torch's
  ``CachingHostAllocator``, which rounds every block up to a power of two (torch 2.11
  ``ATen/core/CachingHostAllocator.h``, ``PowerOf2Ceil``): a 896 MiB boundary activation takes 1 GiB.
- Block recompute working set: what one block's recomputed forward saves for its backward
  (see ``block_working_set_bytes``); the largest block counts.
- Loss working set: unchunked, ``12 · V`` bytes per token (fp32 logits, log-softmax output and logit
  gradient). Chunked (``moe_lightning.model.loss``, chunk c): at most ``8 · V`` per token of one chunk (fp32
  logits and the log-sum-exp temporary; backward rebuilds the logit gradient in place) plus ``6 · V · d``
  (the head gradient's fp32 accumulator and one chunk's bf16 contribution). Transient like the block
  working set, so the peak takes the larger of the two.
- FSDP units are the strategy's own (``parallel.units.fsdp_units``, read from the meta-device model): the
  embedding, each block (its routed experts a unit of their own under expert parallelism, counted ``1 / ep``),
  each MTP module with its block, the head, and the root (the final norm; a tied embedding/head weight, once).
  A stage is the units that run together (a block and its experts); U is the largest stage's gathered
  parameters, R the root's, which stay gathered the whole step (``reshard_after_forward=False``).
- All-gather buffers: ``(1 + prefetch_depth) · 2 · U + 2 · R``.
- Reduce-scatter buffers: ``6 · max(U, R)`` (the unsharded bf16 gradient and its fp32 reduce copy).
- Unsharded gradient accumulation (the strategy's opt-in ``accumulate_unsharded_grads``): every unit's fp32
  gradient held across micro-batches, ``4 · (dense + routed / ep)`` parameters of the whole model.
- Runtime reserve: CUDA context, communicator buffers and allocator slack (``--reserve``).
- Muon host staging (``cpu_offload`` with Muon): Newton–Schulz of host matrices runs on the GPU through a ring
  of two pinned fp32 inputs and two bf16 outputs per distinct local matrix shape (``optim.host_staging``), each
  rounded up to a power of two.
- Async checkpoint staging (``async_checkpoint``): each background save first copies the sharded parameters
  and optimizer state into new host memory (``4·P/S`` + the optimizer state), held while it is written.

- Multi-token prediction (``mtp_layers``): what its modules keep for backward is its own row
  (``mtp_activation_bytes``). Without activation offload their blocks are not checkpointed and keep their whole
  working set; ``ActivationOffload`` checkpoints them too (its ``mtp``, default on; ``--no-offload-mtp`` prices
  it off), leaving their inputs and the modules' norms and projection. Both figures are printed. Their
  parameters, FSDP units and FLOPs count like the blocks'.

- Expert exchange buffers (expert parallelism): what a MoE layer's exchange holds beyond its saved activations,
  ``2 · f · K · d · 2`` bytes a token at one chunk, at most ``4 · f · K · d · 2 / C + 2d`` with ``C`` overlap
  chunks (``ep_traffic.transient_bytes``, measured by ``benchmarks/ep_dispatch.py --memory``; ``f``:
  ``--ep-imbalance``, default 1.5). Transient with the block working set, so it adds to it, not to the loss's.
- Context parallelism (``context_parallel_size`` N): every per-token row at ``b·s / N`` tokens, plus attention's
  key side over the whole sequence (``activations.key_side_bytes``); see ``planner/context_parallel.py``.

Throughput: ``tokens/s per GPU = tokens per GPU / step time``, the step built from its parts
(``planner/exchange_time.py``: compute at the planned MFU, the exposed expert exchange, the count exchanges and
host reads, the exposed FSDP collectives, the CP exchange). Compute counts training FLOPs per token
(``moe_lightning.planner.flops``: 6 × active matmul parameters + causal attention at sequence length s, plus CP's
repeated key up-projection). With
``document_masking``, attention scores only within documents: ``--doc-len`` (the typical document length) counts
the pairs of documents of that length, as ``MoEThroughputMonitor`` counts each batch's; without it the count is
causal over the whole sequence, an upper bound.
"""

import argparse
import json
import math
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

import torch

from moe_lightning.planner import context_parallel, ep_traffic, exchange_time, pipeline
from moe_lightning.planner.activations import block_working_set_bytes, key_side_bytes, mtp_activation_bytes, \
    pinned_bytes
from moe_lightning.planner.run_config import load_model_config, read_run_config
from moe_lightning.planner.flops import (PEAK_BF16_FLOPS, cp_key_upprojection_flops_per_token, parameter_counts,
                                         peak_bf16_flops, training_flops_per_token)
from moe_lightning.model import MoEConfig, MoETransformer
from moe_lightning.optim.grouping import parameter_roles
from moe_lightning.optim.host_staging import staging_bytes
from moe_lightning.optim.muon_groups import MUON_ROLES
from moe_lightning.parallel import MeshLayout
from moe_lightning.parallel.mesh import resolve_layout
from moe_lightning.parallel.units import Unit, fsdp_units
from moe_lightning.run.refusals import CommandParser, one_line, traceback_requested

GiB = 2**30
EP_OVERLAP_CHUNKS = 1  # MoEFSDPStrategy's default ep_overlap_chunks (the planner cannot import training/)


@dataclass
class Cluster:
    """Hardware and the strategy's mesh sizes (``MoEFSDPStrategy`` arguments; ``None`` shard size = auto)."""

    nodes: int = 1
    gpus_per_node: int = 8
    gpu: str = "H100"  # the GPU model assumed (its name only; memory and peak are the two fields below)
    gpu_memory_gib: float = 80.0
    host_memory_gib: float | None = None
    peak_tflops: float = 989.0
    replicate_size: int = 1
    shard_size: int | None = None
    expert_parallel_size: int = 1
    context_parallel_size: int = 1  # ranks sharing each sequence, folded into the shard dimension
    ib_gbps: float | None = None  # per GPU per direction; None: by --gpu (ep_traffic.BANDWIDTH_GBPS)
    nvlink_gbps: float | None = None
    collective_latency_us: float = exchange_time.COLLECTIVE_LATENCY_US  # one blocking count exchange
    host_sync_us: float = exchange_time.HOST_SYNC_US  # GPU idle after one host read-back

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    def __post_init__(self) -> None:
        for name in ("nodes", "gpus_per_node"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')}={getattr(self, name)} must be >= 1.")
        for flag, gib in (("--gpu-memory", self.gpu_memory_gib), ("--host-memory", self.host_memory_gib)):
            if gib is not None and not gib > 0:
                raise ValueError(f"{flag}={gib:g} must be > 0 (GiB per GPU).")
        for flag, us in (("--collective-latency-us", self.collective_latency_us),
                         ("--host-sync-us", self.host_sync_us)):
            if not us >= 0:
                raise ValueError(f"{flag}={us:g} must be >= 0 (microseconds).")


@dataclass
class Workload:
    """What one training step runs on each GPU."""

    micro_batch: int = 1
    seq_len: int = 4096
    optimizer: str = "adamw"
    cpu_offload: bool = False
    prefetch_depth: int = 1
    loss_chunk: int | None = None
    mfu: float = 0.3
    reserve_gib: float = 3.0
    activation_offload: bool = False  # the variant whose fit is the verdict (both are priced)
    offload_prefetch: int = 1
    async_checkpoint: bool = False
    doc_len: int | None = None  # typical document length (document masking): attention FLOPs within documents
    offload_mtp: bool = True  # ActivationOffload(mtp=...): the multi-token prediction blocks are checkpointed too
    accumulate_unsharded_grads: bool = False
    ep_overlap_chunks: int = EP_OVERLAP_CHUNKS  # the strategy's: chunks of a MoE layer's pipelined exchange
    dispatch_dtype: str | None = None  # the strategy's: "float8_e4m3fn" sends the dispatch hops' rows in FP8
    ep_imbalance: float = 1.5  # busiest rank's received rows / the mean, for the exchange's transient buffers

    def __post_init__(self) -> None:
        if self.optimizer not in ("adamw", "muon"):
            raise ValueError(f"--optimizer={self.optimizer!r}: use 'adamw' or 'muon'.")
        if self.micro_batch < 1 or self.seq_len < 1 or self.prefetch_depth < 0 or self.offload_prefetch < 0:
            raise ValueError("--micro-batch and --seq-len must be >= 1, --prefetch-depth and --offload-prefetch "
                             ">= 0.")
        if self.loss_chunk is not None and self.loss_chunk < 1:
            raise ValueError(f"--loss-chunk={self.loss_chunk}: must be >= 1 (0 on the command line: unchunked).")
        if not 0 < self.mfu <= 1:
            raise ValueError(f"--mfu={self.mfu} must be in (0, 1].")
        if self.doc_len is not None and self.doc_len < 1:
            raise ValueError(f"--doc-len={self.doc_len}: must be >= 1 (tokens in a typical document).")
        ep_traffic.check_options(self.ep_overlap_chunks, self.dispatch_dtype, self.ep_imbalance)


def count_parameters(config: MoEConfig, expert_parallel: bool = False) -> tuple[dict[str, int], list[Unit]]:
    """Parameters per optimizer role, and the FSDP units ``parallel/fsdp.py`` shards the model into
    (``parallel.units.fsdp_units``; ``expert_parallel``: routed experts a unit of their own). Counted on a
    meta-device model, so nothing is allocated."""
    with torch.device("meta"):
        model = MoETransformer(config)
    params = dict(model.named_parameters())
    roles: dict[str, int] = {}
    for name, role in parameter_roles(model).items():
        roles[role] = roles.get(role, 0) + params[name].numel()
    return roles, fsdp_units(model, expert_parallel)


def gathered_parameters(units: list[Unit], ep: int) -> tuple[list[float], float]:
    """Parameters one rank holds unsharded while each stage runs (its units together; an expert unit holds its
    ``1 / ep`` of the experts), and those of the root unit, which stays gathered the whole step."""
    stages: dict[int, float] = {}
    for unit in units:
        if unit.stage is not None:
            stages[unit.stage] = stages.get(unit.stage, 0) + unit.numel / (ep if unit.experts else 1)
    root = sum(unit.numel for unit in units if unit.stage is None)
    return [stages[i] for i in sorted(stages)], root


def sharded_parameter_numels(config: MoEConfig, shard: int) -> list[int]:
    """Elements of each parameter's shard on one rank (dim 0 split ``shard`` ways, padded as FSDP2 pads)."""
    with torch.device("meta"):
        model = MoETransformer(config)
    return [math.ceil(p.shape[0] / shard) * (p.numel() // p.shape[0]) for p in model.parameters()]


def staged_muon_shapes(config: MoEConfig, mesh: MeshLayout) -> list[tuple[int, ...]]:
    """Local shapes of the Muon matrices one rank orthogonalizes whole (``optim.host_staging`` stages these under
    ``cpu_offload``): expert stacks sharded by whole experts (``Shard(0)``), and hidden matrices when they are not
    row-sharded (shard size 1); row-sharded ones go through FlexShard's row exchange instead."""
    with torch.device("meta"):
        model = MoETransformer(config)
    params = dict(model.named_parameters())
    whole_experts = (config.num_experts // mesh.ep) % mesh.expert_shard == 0
    shapes = []
    for name, role in parameter_roles(model).items():
        shape = tuple(params[name].shape)
        if role == "expert_stack" and whole_experts:
            shapes.append((shape[0] // mesh.ep // mesh.expert_shard, *shape[1:]))
        elif role == "hidden_matrix" and mesh.shard == 1:
            shapes.append(shape)
    return shapes


def plan(config: MoEConfig, cluster: Cluster, work: Workload) -> dict:
    """Parameters, FLOPs, per-GPU memory (without and with activation offload), fit and throughput."""
    cp = cluster.context_parallel_size
    mesh = resolve_layout(cluster.world_size, cluster.replicate_size, cluster.shard_size or "auto",
                          cluster.expert_parallel_size, cp, config, work.seq_len)  # the strategy's own refusals
    roles, units = count_parameters(config, expert_parallel=mesh.ep > 1)
    total = sum(roles.values())
    counts = parameter_counts(config)
    active = counts["active"]
    S, tokens = mesh.shard, work.micro_batch * work.seq_len // cp  # this GPU's positions
    muon = sum(roles.get(r, 0) for r in MUON_ROLES) if work.optimizer == "muon" else 0

    state = {
        "sharded parameters (fp32)": 4 * total / S,
        "gradients (fp32)": 4 * total / S,
        f"optimizer state ({work.optimizer})": (4 * muon + 8 * (total - muon)) / S,
    }
    boundary_one = 2 * tokens * config.dim
    stages, root = gathered_parameters(units, mesh.ep)
    unit = max(stages)
    kinds = [m for m, n in ((True, config.n_moe_layers), (False, config.n_layers - config.n_moe_layers)) if n]
    key_side = key_side_bytes(config, gathered=cp > 1) * tokens * cp  # every key position of the micro-batch
    working_set = max(block_working_set_bytes(config, tokens, moe=m, key_tokens=tokens * cp) for m in kinds)
    V = config.vocab_size
    loss_set = 12 * V * tokens if work.loss_chunk is None else \
        8 * V * min(work.loss_chunk, tokens) + 6 * V * config.dim

    # under CP a block's backward also makes the key side's gradient over the whole sequence (dk, dv, the
    # up-projection's and the latent's): one gradient per kept key-side tensor, an upper bound on its peak
    key_grad = key_side if cp > 1 else 0
    transient = {"block recompute working set": working_set} if cp == 1 else {
        "block recompute working set": working_set - key_side, "key side, whole sequence (CP)": key_side,
        "key side gradient (CP backward)": key_grad}
    transient |= {
        "loss working set": loss_set,
        "all-gather buffers (bf16)": (1 + work.prefetch_depth) * 2 * unit + 2 * root,
        "reduce-scatter buffers": 6 * max(unit, root),
        "runtime reserve": work.reserve_gib * GiB,
    }
    exchange_buffers = ep_traffic.transient_bytes(config, mesh.ep, tokens, work.ep_overlap_chunks,
                                                  work.ep_imbalance)
    if exchange_buffers:
        transient = {**dict(list(transient.items())[:-1]), "expert exchange buffers": exchange_buffers,
                     "runtime reserve": transient["runtime reserve"]}
    # ActivationOffload's default keeps the last block's input; each offloaded one is a pinned block
    pinned_boundaries = (config.n_layers - 1) * pinned_bytes(boundary_one)
    pinned_shards = sum(pinned_bytes(4 * n) for n in sharded_parameter_numels(config, S)) if work.cpu_offload else 0
    muon_staging = staging_bytes(staged_muon_shapes(config, mesh), 2, pinned_bytes) if (
        work.cpu_offload and work.optimizer == "muon") else 0
    variants = {}
    for offload in (False, True):
        boundary = min(1 + work.offload_prefetch if offload else config.n_layers, config.n_layers) * boundary_one
        gpu = {} if work.cpu_offload else dict(state)
        gpu["boundary activations"] = boundary
        if work.accumulate_unsharded_grads:
            gpu["unsharded grad accumulation (fp32)"] = 4 * (sum(stages) + root)
        if config.mtp_layers:
            gpu["multi-token prediction activations"] = mtp_activation_bytes(config, tokens,
                                                                             offload and work.offload_mtp)
        gpu.update(transient)
        # the block's working set and its exchange never coexist with the loss's
        peak = sum(gpu.values()) - min(working_set + key_grad + exchange_buffers, loss_set)
        host_rows = {}
        if work.cpu_offload:  # parameters and gradients pinned, a power-of-two block per shard; the state pageable
            optimizer_row = f"optimizer state ({work.optimizer})"
            host_rows = {"sharded params (fp32, pinned)": pinned_shards, "gradients (fp32, pinned)": pinned_shards,
                         optimizer_row: state[optimizer_row]}
            if work.optimizer == "muon":  # Newton–Schulz on the GPU: a pinned ring per shape, bf16 results
                host_rows["Muon host staging (pinned)"] = muon_staging
        host_rows["boundary activations (pinned)"] = pinned_boundaries if offload else 0
        if work.async_checkpoint:  # a fresh pageable host copy of the sharded state per save (DCP async_save)
            host_rows["async checkpoint staging"] = state["sharded parameters (fp32)"] + state[
                f"optimizer state ({work.optimizer})"]
        host = sum(host_rows.values())
        fits = peak <= cluster.gpu_memory_gib * GiB and (
            cluster.host_memory_gib is None or host <= cluster.host_memory_gib * GiB)
        variants["with_offload" if offload else "without_offload"] = {
            "gpu_bytes": {k: int(v) for k, v in gpu.items()}, "gpu_peak_bytes": int(peak),
            "host_bytes_by_row": {k: int(v) for k, v in host_rows.items()}, "host_bytes": int(host), "fits": fits}
    configured = "with_offload" if work.activation_offload else "without_offload"

    if work.doc_len is not None and not config.document_masking:
        raise ValueError(f"--doc-len={work.doc_len}: the model attends over the whole sequence "
                         "(model.init_args.config.document_masking is false); drop --doc-len or turn masking on.")
    cp_flops = cp_key_upprojection_flops_per_token(config, cp)
    flops_per_token = training_flops_per_token(config, work.seq_len, counts=counts, doc_len=work.doc_len) + cp_flops
    result = {
        "parameters": {"total": total, "active": active, "routed_experts": roles.get("expert_stack", 0),
                       "by_role": roles},
        "flops_per_token": flops_per_token,  # the step's, per local token (CP's repeated key up-projection included)
        "cp_key_upprojection_flops_per_token": cp_flops,
        "attention_flops_per_rank": context_parallel.attention_flops_per_rank(config, cp, work.micro_batch,
                                                                              work.seq_len, work.doc_len),
        "tokens_per_gpu": tokens,
        "fsdp_bytes": exchange_time.fsdp_bytes(units, mesh),
        # the largest stage's all-gather (bf16) and reduce-scatter (fp32), at the step's edges
        "fsdp_edge_bytes": 6 * unit * (S - 1) / S,
        "document_masking": config.document_masking,
        "cluster": asdict(cluster) | {"world_size": cluster.world_size, "shard_size": mesh.shard},
        "workload": asdict(work),
        "boundary_activations_bytes": config.n_layers * boundary_one,
        "mtp_activation_bytes": {"not_checkpointed": mtp_activation_bytes(config, tokens),
                                 "checkpointed": mtp_activation_bytes(config, tokens, checkpointed=True)},
        "memory": variants,
        "configured": configured,  # the variant the workload runs
        "fits": variants[configured]["fits"],
    }
    ib, nvlink = result["bandwidths"] = ep_traffic.bandwidths(cluster.gpu, cluster.ib_gbps, cluster.nvlink_gbps)
    result["ep_traffic"] = ep_traffic.traffic(config, result, mesh, ib, nvlink)
    result["cp_exchange"] = context_parallel.exchange(config, cp, work.micro_batch, work.seq_len,
                                                      cluster.gpus_per_node, nvlink, ib)
    result["warnings"] = context_parallel.warnings(cp, cluster.gpus_per_node)
    result["step_time"] = exchange_time.step_time(config, result)
    result["step_seconds"] = result["step_time"]["seconds"]
    result["tokens_per_s_per_gpu"] = tokens / result["step_seconds"]
    result["tokens_per_s_total"] = result["tokens_per_s_per_gpu"] * cluster.world_size
    return result


def format_plan(result: dict) -> str:
    p, c, w = result["parameters"], result["cluster"], result["workload"]
    without, with_ = result["memory"]["without_offload"], result["memory"]["with_offload"]
    chunk = f"loss chunk {w['loss_chunk']:,}" if w["loss_chunk"] else "unchunked loss"
    offload = f"activation offload on (prefetch {w['offload_prefetch']})" if w["activation_offload"] \
        else "activation offload off"
    lines = [
        f"parameters        total {_scaled(p['total'], '.2f')}   active {_scaled(p['active'], '.2f')}",
        f"training FLOPs    {_scaled(result['flops_per_token'], '.1f', 'FLOP')} per token at seq_len {w['seq_len']:,}"
        + (f", attention within {w['doc_len']:,}-token documents" if w["doc_len"] else ""),
        f"cluster           {c['nodes']} x {c['gpus_per_node']} GPUs = {c['world_size']}, "
        f"{c['gpu_memory_gib']:g} GiB each; mesh replicate_size={c['replicate_size']} shard_size={c['shard_size']} "
        f"ep={c['expert_parallel_size']} cp={c['context_parallel_size']}",
        f"workload          micro_batch {w['micro_batch']} x seq_len {w['seq_len']:,}, optimizer {w['optimizer']}, "
        f"cpu_offload {'on' if w['cpu_offload'] else 'off'}, prefetch_depth {w['prefetch_depth']}, {chunk}, "
        f"{offload}",
    ]
    lines.insert(2, f"gpu               {c['gpu']}: {c['gpu_memory_gib']:g} GiB, {c['peak_tflops']:g} TFLOP/s dense "
                    f"bf16 peak (--gpu, --gpu-memory, --peak-tflops)")
    for origin in ("config", "flag", "default"):
        names = [f"{k}={'null' if v is None else v}" + (" (auto: every GPU of a replica)" if k == "shard_size" and o == "default" else "")
                 for k, (v, o) in result.get("inputs", {}).items() if o == origin]
        if names:
            lines.append(f"{'from ' + origin + 's' if origin != 'config' else 'from the config':<18}{' '.join(names)}")
    mark = {"without_offload": ("*", ""), "with_offload": ("", "*")}[result["configured"]]
    rows = [(name, without["gpu_bytes"][name], with_["gpu_bytes"][name]) for name in without["gpu_bytes"]]
    largest = max(max(a, b) for name, a, b in rows if name != "runtime reserve")
    unit, scale = ("GiB", GiB) if largest >= GiB / 10 else ("MiB", 2**20)  # a tiny model's rows in MiB
    lines += ["", f"{f'per-GPU memory ({unit})':<36}{'no act. offload' + mark[0]:>18}{'act. offload' + mark[1]:>15}"]
    rows.append(("peak (larger working set only)", without["gpu_peak_bytes"], with_["gpu_peak_bytes"]))
    rows += [(f"host: {name}", without["host_bytes_by_row"][name], with_["host_bytes_by_row"][name])
             for name in without["host_bytes_by_row"]]
    rows.append(("host memory per GPU", without["host_bytes"], with_["host_bytes"]))
    lines += [f"{name:<36}{a / scale:>17.2f}{b / scale:>15.2f}" for name, a, b in rows]
    lines.append(f"{'fits':<36}{_yes(without['fits']):>17}{_yes(with_['fits']):>15}")
    chosen = result["memory"][result["configured"]]
    if c["host_memory_gib"] is not None:
        host = f"host {chosen['host_bytes'] / GiB:.2f} of {c['host_memory_gib']:g} GiB"
    elif chosen["host_bytes"]:
        host = f"host {chosen['host_bytes'] / GiB:.2f} GiB per GPU not checked (pass --host-memory)"
    else:
        host = "no host memory used"
    lines += [
        f"{'verdict':<18}{'fits' if result['fits'] else 'does NOT fit'} as configured (* column, {offload}): "
        f"GPU peak {chosen['gpu_peak_bytes'] / GiB:.2f} of {c['gpu_memory_gib']:g} GiB, {host}",
        "",
        f"boundary activations {_bytes(result['boundary_activations_bytes'], '.1f')} per GPU "
        f"(in host memory with activation offload)",
    ]
    if result["mtp_activation_bytes"]["not_checkpointed"]:
        mtp = result["mtp_activation_bytes"]
        lines.append(f"multi-token prediction activations {_bytes(mtp['checkpointed'])} per GPU with its "
                     f"blocks checkpointed (ActivationOffload mtp: true{', configured' if w['offload_mtp'] else ''}), "
                     f"{_bytes(mtp['not_checkpointed'])} without (mtp: false{'' if w['offload_mtp'] else ', configured'})")
    lines += [
        f"throughput        {result['tokens_per_s_per_gpu']:,.0f} tokens/s per GPU "
        f"({result['tokens_per_s_total']:,.0f} total): {result['tokens_per_gpu']:,} tokens per GPU in a "
        f"{result['step_seconds']:.3g} s step (step time below; compute alone at MFU {w['mfu']:.0%} of "
        f"{c['peak_tflops']:g} TFLOP/s: {result['step_time']['parts']['compute']:.3g} s)",
    ]
    lines += [f"warning           {warning}" for warning in result["warnings"]]
    lines += ep_traffic.format_traffic(result.get("ep_traffic"))
    lines += exchange_time.lines(result)
    return "\n".join(lines)


def _scaled(n: float, spec: str, unit: str = "") -> str:
    """``n`` in thousands (K), millions (M), billions (B, or G before a unit) or trillions (T), the largest that
    keeps it >= 1: a 1M-parameter model reads "1.07 M", not "0.00 B"."""
    prefixes = ("", "K", "M", "B", "T") if not unit else ("", "k", "M", "G", "T")
    i = min(int(math.log10(n)) // 3, 4) if n >= 1 else 0
    return f"{n / 1e3 ** i:,{spec}} {prefixes[i]}{unit}".rstrip()


def _bytes(n: float, spec: str = ".2f") -> str:
    """Bytes in GiB, or in MiB below a tenth of a GiB (the tiny configs' rows would read 0.00)."""
    return f"{n / GiB:{spec}} GiB" if n >= GiB / 10 or n == 0 else f"{n / 2**20:{spec}} MiB"


def _yes(flag: bool) -> str:
    return "yes" if flag else "NO"


# Inputs a config can set and a flag can override (``Cluster`` and ``Workload`` field names = flag names).
PLANNED = ("nodes", "gpus_per_node", "replicate_size", "shard_size", "expert_parallel_size", "context_parallel_size",
           "micro_batch", "seq_len", "optimizer", "cpu_offload", "prefetch_depth", "loss_chunk", "activation_offload",
           "offload_prefetch", "offload_mtp", "async_checkpoint", "accumulate_unsharded_grads", "ep_overlap_chunks",
           "dispatch_dtype", "ep_imbalance")


def plan_with_stages(config: MoEConfig, cluster: Cluster, work: Workload, size: int, schedule: str,
                     microbatches: int | None, stages_per_rank: int | None = None) -> dict:
    """``plan`` with its pipeline rows at ``size`` stages, refusing what ``fit`` refuses at that size: the stage
    layout is validated first. A stage's shard (``world / (replicate · size)``) can hold experts that a whole
    replica's cannot; then the layout without stages does not resolve, the base rows are priced at the stage's own
    shard layout (``replicate · size`` replicas of it: the same tokens, experts and shard per GPU) and the step
    without stages is not applicable, with the refusal as the reason."""
    resolve_layout(cluster.world_size, cluster.replicate_size, "auto", cluster.expert_parallel_size,
                   cluster.context_parallel_size, config, work.seq_len, size)
    try:
        result, without_refused = plan(config, cluster, work), None
    except ValueError as refusal:
        stage_shaped = replace(cluster, replicate_size=cluster.replicate_size * size, shard_size=None)
        result, without_refused = plan(config, stage_shaped, work), one_line(str(refusal))
    result["pipeline"] = pipeline.pipeline_rows(config, cluster, work, result, size, schedule, microbatches,
                                                stages_per_rank)
    if without_refused:
        result["pipeline"] |= {"step_seconds_without": None, "without_refused": without_refused}
    return result


def planned_inputs(args: argparse.Namespace, config: MoEConfig) -> dict[str, tuple[Any, str]]:
    """Each planned input with where it came from: ``flag``, ``config`` or ``default``."""
    from_config = read_run_config(args.config)
    defaults = {f.name: f.default for f in fields(Cluster) + fields(Workload)}
    defaults["seq_len"] = config.max_seq_len
    inputs = {}
    for name in PLANNED:
        if getattr(args, name) is not None:
            inputs[name] = (getattr(args, name), "flag")
        elif name in from_config:
            inputs[name] = (from_config[name], "config")
        else:  # a missing seq_len is the model's max_seq_len: that is the config too
            inputs[name] = (defaults[name], "config" if name == "seq_len" else "default")
    if inputs["loss_chunk"] == (0, "flag"):
        inputs["loss_chunk"] = (None, "flag")
    if inputs["dispatch_dtype"] == ("none", "flag"):
        inputs["dispatch_dtype"] = (None, "flag")
    seq_len, origin = inputs["seq_len"]
    if seq_len > config.max_seq_len:
        where = "--seq-len" if origin == "flag" else "data.init_args.seq_len"
        raise ValueError(f"{where}={seq_len} exceeds model.init_args.config.max_seq_len={config.max_seq_len}: "
                         "the model cannot train on longer sequences; lower it or raise max_seq_len.")
    optimizer, origin = inputs["optimizer"]
    if optimizer not in ("adamw", "muon"):
        raise ValueError(f"{' + '.join(args.config)}: model.init_args.optimizer {optimizer} is neither AdamW nor Muon; pass "
                         "--optimizer adamw or --optimizer muon to price its state like one of them.")
    return inputs


def main(argv: list[str]) -> None:
    parser = CommandParser(prog="moe-lightning plan", description=__doc__.split("\n")[0],
                           epilog="Flags without a default here take the config's value.")
    parser.add_argument("--config", required=True, action="append", help="LightningCLI YAML with "
                        "model.init_args.config; given again, the files compose as in fit (later ones override)")
    parser.add_argument("--nodes", type=int, help="default: trainer.num_nodes, else 1")
    parser.add_argument("--gpus-per-node", type=int, help="default: trainer.devices, else 8")
    parser.add_argument("--gpu-memory", type=float, help=f"GiB per GPU (default: {Cluster.gpu_memory_gib:g})")
    parser.add_argument("--host-memory", type=float, default=None, help="host GiB per GPU (checked if given)")
    parser.add_argument("--gpu", help=f"GPU model for the peak FLOP/s: {', '.join(PEAK_BF16_FLOPS)} "
                        f"(default: {Cluster.gpu})")
    parser.add_argument("--peak-tflops", type=float, default=None, help="dense bf16 peak per GPU (overrides --gpu)")
    parser.add_argument("--replicate-size", type=int, help="HSDP replicas")
    parser.add_argument("--shard-size", type=int, help="FSDP shard-group size (default: all GPUs of a replica)")
    parser.add_argument("--expert-parallel-size", type=int, help="ranks of a shard group splitting the experts")
    parser.add_argument("--context-parallel-size", type=int, help="neighbouring ranks sharing each sequence "
                        "(strategy.context_parallel_size)")
    parser.add_argument("--micro-batch", type=int, help="sequences per GPU per step (default: data.batch_size)")
    parser.add_argument("--seq-len", type=int, help="default: data.seq_len, else the model's max_seq_len")
    parser.add_argument("--optimizer", choices=("adamw", "muon"), help="default: the config's optimizer class")
    parser.add_argument("--cpu-offload", action=argparse.BooleanOptionalAction, help="FSDP keeps parameters, "
                        "gradients and optimizer state in host memory")
    parser.add_argument("--prefetch-depth", type=int, help="FSDP units all-gathered ahead")
    parser.add_argument("--async-checkpoint", action=argparse.BooleanOptionalAction, help="background saves "
                        "stage a host copy of the sharded state (default: the strategy's async_checkpoint)")
    parser.add_argument("--accumulate-unsharded-grads", action=argparse.BooleanOptionalAction, help="hold every "
                        "unit's full gradient across micro-batches (default: the strategy's argument)")
    parser.add_argument("--loss-chunk", type=int, help="tokens per loss chunk (default: model.loss_chunk_size; "
                        "0: unchunked)")
    parser.add_argument("--activation-offload", action=argparse.BooleanOptionalAction, help="the variant whose "
                        "fit is the verdict (default: whether ActivationOffload is among the callbacks)")
    parser.add_argument("--offload-prefetch", type=int, help="ActivationOffload's prefetch (default: the "
                        "callback's, else 1)")
    parser.add_argument("--doc-len", type=int, default=None, help="typical document length with document_masking: "
                        "attention FLOPs within documents (default: causal over the whole sequence, an upper bound)")
    parser.add_argument("--offload-mtp", action=argparse.BooleanOptionalAction, help="ActivationOffload also "
                        "checkpoints the multi-token prediction blocks (default: the callback's mtp, else on)")
    parser.add_argument("--mfu", type=float, default=0.3, help="assumed model FLOPs utilization")
    parser.add_argument("--reserve", type=float, default=3.0, help="GiB kept for CUDA context and slack")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    ep_traffic.add_arguments(parser)
    pipeline.add_arguments(parser)
    args = parser.parse_args(argv)

    def refuse(message: str):  # a bad value, not a usage error: its line alone (CommandParser adds "see --help")
        parser.exit(2, f"{parser.prog}: error: {one_line(message)}\n")
    if args.peak_tflops is not None and not args.peak_tflops > 0:
        refuse(f"--peak-tflops={args.peak_tflops:g} must be > 0 (dense bf16 TFLOP/s per GPU).")
    gpu = args.gpu or Cluster.gpu
    peak = args.peak_tflops or (peak_bf16_flops(gpu) or 0) / 1e12
    if not peak:
        refuse(f"--gpu={gpu!r} is not in the peak table ({', '.join(PEAK_BF16_FLOPS)}): pass --peak-tflops.")
    assumed = {"gpu": (gpu, "flag" if args.gpu else "default"),
               "gpu_memory_gib": (Cluster.gpu_memory_gib if args.gpu_memory is None else args.gpu_memory,
                                  "flag" if args.gpu_memory is not None else "default"),
               "peak_tflops": (peak, "flag" if args.peak_tflops or args.gpu else "default")}
    try:
        config = load_model_config(args.config)
        inputs = planned_inputs(args, config)
        values = {name: value for name, (value, _) in inputs.items()}
        cluster = Cluster(host_memory_gib=args.host_memory, ib_gbps=args.ib_gbps, nvlink_gbps=args.nvlink_gbps,
                          collective_latency_us=args.collective_latency_us, host_sync_us=args.host_sync_us,
                          **{name: v for name, (v, _) in assumed.items()},
                          **{f.name: values[f.name] for f in fields(Cluster) if f.name in values})
        work = Workload(mfu=args.mfu, reserve_gib=args.reserve, doc_len=args.doc_len,
                        **{f.name: values[f.name] for f in fields(Workload) if f.name in values})
        if args.pipeline_parallel_size:  # the same cluster and global batch in pipeline stages (planner/pipeline.py)
            result = plan_with_stages(config, cluster, work, args.pipeline_parallel_size, args.pipeline_schedule,
                                      args.pipeline_microbatches, args.pipeline_stages_per_rank)
        else:
            result = plan(config, cluster, work)
        if inputs["shard_size"][0] is None:  # "auto": report the size the mesh resolved, not None
            inputs["shard_size"] = (result["cluster"]["shard_size"], inputs["shard_size"][1])
        result["inputs"] = assumed | inputs
    except (ValueError, OSError) as e:
        if traceback_requested():
            raise
        refuse(str(e))
    print(json.dumps(result, indent=2) if args.json else "\n".join([format_plan(result),
                                                                  *pipeline.format_rows(result.get("pipeline"))]))
