"""One rank of a FlexShard check (launched by tests/optim/test_flexshard.py via run_ranks).

Every rank also builds the unsharded model and steps a single-process Muon with the same gradients,
so each rank can compare its sharded result against the single-process one. Prints one JSON line.
Modes (comma-separated, run in turn): fsdp (1-D mesh), hsdp (replicate x shard), ep (experts sliced
over ep ranks, dense FSDP over all), experts_only (only expert stacks in Muon), expert_rows (expert
stacks Shard(1): per-expert owners), offload (FSDP CPUOffloadPolicy), bad_layout (a column-sharded matrix),
missing_grad (fsdp, with a row-sharded matrix's gradient None on the last rank only at step 1 (the reference's
gradient has that rank's rows zero) and another's None on every rank at step 2 (the reference has None too)),
frozen_one_rank (a row-sharded matrix frozen on the last rank only).
"""

import json
import os
import sys
import zlib

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode

from moe_lightning.model import MoEConfig, MoETransformer
from moe_lightning.optim import FlexShardLayoutError, Muon, param_groups

# Uneven row shards on purpose: ffn_hidden 14 and expert_hidden 10 do not divide by 4.
CONFIG = MoEConfig(vocab_size=40, dim=24, n_layers=3, n_heads=2, n_kv_heads=1, max_seq_len=16, ffn_hidden=14,
                   n_dense_layers=1, num_experts=4, top_k=2, expert_hidden=10, n_shared_experts=1)
MUON_KW = dict(lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")


def build(mode: str, world: int):
    """The sharded model under test and the (ep_rank, ep_size) its experts are sliced by."""
    torch.manual_seed(0)
    model = MoETransformer(CONFIG)
    experts_dim0 = lambda p: Shard(0) if p.ndim == 3 else None  # noqa: E731 - experts: whole experts per rank
    rows_or_cols = lambda p: Shard(1) if p.ndim == 2 else Shard(0)  # noqa: E731
    ep = (0, 1)
    if mode == "hsdp":
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    if mode == "ep":
        ep_size = 2
        ep_mesh = init_device_mesh("cpu", (ep_size, world // ep_size), mesh_dim_names=("ep", "edp"))
        ep = (ep_mesh.get_local_rank("ep"), ep_size)
        for moe in model.moe_layers():
            e = moe.experts.num_experts // ep_size
            for name, p in list(moe.experts.named_parameters()):  # what an EP strategy does: keep local experts
                setattr(moe.experts, name, torch.nn.Parameter(p.detach()[ep[0] * e:(ep[0] + 1) * e].clone()))
            fully_shard(moe.experts, mesh=ep_mesh["edp"], shard_placement_fn=experts_dim0)
    expert_rows = lambda p: Shard(1) if p.ndim == 3 else None  # noqa: E731 - the strategy's fallback layout
    placement = {"bad_layout": rows_or_cols, "expert_rows": expert_rows}.get(mode, experts_dim0)
    offload = CPUOffloadPolicy(pin_memory=False) if mode == "offload" else OffloadPolicy()
    for block in model.layers:
        fully_shard(block, mesh=mesh, shard_placement_fn=placement, offload_policy=offload)
    fully_shard(model, mesh=mesh, offload_policy=offload)
    return model, ep


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def expert_slice(name: str, t: torch.Tensor, ep: tuple[int, int]) -> torch.Tensor:
    """The part of a full-model tensor that this rank's (possibly EP-sliced) parameter holds."""
    if ".experts." not in name or ep[1] == 1:
        return t
    e = t.shape[0] // ep[1]
    return t[ep[0] * e:(ep[0] + 1) * e]


def make_optimizer(model, mode):
    groups = param_groups(model, 0.1)
    adamw = ["*attention*", "*shared_experts*", "layers.0.ffn.*"] if mode == "experts_only" else None
    return Muon(groups, adamw_patterns=adamw, **MUON_KW)


def set_grads(models_eps, step: int) -> None:
    """Identical pseudo-random full gradients on every rank, sharded like each parameter."""
    ref = models_eps[0][0]
    for name, p_ref in ref.named_parameters():
        seed = 1000 * step + zlib.crc32(name.encode()) % 997
        g = torch.randn(p_ref.shape, generator=torch.Generator().manual_seed(seed))
        p_ref.grad = g
        for model, ep in models_eps[1:]:
            p = model.get_parameter(name)
            g_local = expert_slice(name, g, ep)
            p.grad = distribute_tensor(g_local, p.device_mesh, p.placements) if isinstance(p, DTensor) else g_local


def max_diff(model, ep, ref) -> float:
    return max((full(p.detach()) - expert_slice(n, ref.get_parameter(n).detach(), ep)).abs().max().item()
               for n, p in model.named_parameters())


DROPPED_ON_LAST_RANK, DROPPED_EVERYWHERE = "layers.1.attention.wq.weight", "layers.2.attention.wo.weight"


def drop_grads(ref, model, step: int, rank: int, world: int) -> None:
    """``missing_grad``: the gradients missing at ``step``, and what they mean in the one-process reference."""
    if step == 1:
        rows = model.get_parameter(DROPPED_ON_LAST_RANK).to_local().shape[0]
        ref.get_parameter(DROPPED_ON_LAST_RANK).grad[-rows:] = 0  # torch.chunk: the last rank holds the last rows
        if rank == world - 1:
            model.get_parameter(DROPPED_ON_LAST_RANK).grad = None
    if step == 2:
        ref.get_parameter(DROPPED_EVERYWHERE).grad = None
        model.get_parameter(DROPPED_EVERYWHERE).grad = None


def check(mode: str, ckpt_dir: str) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    ref = MoETransformer(CONFIG)
    ref_opt = make_optimizer(ref, mode)
    model, ep = build(mode, world)
    opt = make_optimizer(model, mode)
    result = {"mode": mode, "rank": rank}
    if mode == "frozen_one_rank":
        if rank == world - 1:
            model.get_parameter(DROPPED_ON_LAST_RANK).requires_grad_(False)
        set_grads([(ref, None), (model, ep)], 0)
        before = full(model.get_parameter("layers.0.attention.wq.weight").detach()).clone()
        try:
            opt.step()
        except FlexShardLayoutError as err:
            result["error"] = str(err)
        result["unchanged"] = torch.equal(before, full(model.get_parameter("layers.0.attention.wq.weight").detach()))
        print(json.dumps(result))
        return
    if mode == "bad_layout":
        set_grads([(ref, None), (model, ep)], 0)
        try:
            opt.step()
        except FlexShardLayoutError as err:
            result["error"] = str(err)
        print(json.dumps(result))
        return
    comm_counts = []
    for step in range(3):
        set_grads([(ref, None), (model, ep)], step)
        if mode == "missing_grad":
            drop_grads(ref, model, step, rank, world)
            before = full(model.get_parameter(DROPPED_EVERYWHERE).detach()).clone()
        ref_opt.step()
        with CommDebugMode() as comm:
            opt.step()
        comm_counts.append({str(k): v for k, v in comm.get_comm_counts().items()})
        if mode == "missing_grad" and step == 2:  # skipped like the reference's, not just left out of max_diff
            result["everywhere_moved"] = (before - full(model.get_parameter(DROPPED_EVERYWHERE).detach())).abs().max().item()
    result["max_diff"] = max_diff(model, ep, ref)
    result["comm_counts"] = comm_counts
    plan = opt._plan[1]
    result["owners"] = [sg.owners for sg in plan]
    result["shapes"] = [sg.shapes for sg in plan]
    result["group_sizes"] = [sg.size for sg in plan]

    if mode == "ep":  # EP slices share FQNs across ep ranks: DCP needs the strategy's ep-aware state dict
        print(json.dumps(result))
        return
    # Checkpoint round trip through DCP: a fresh optimizer restored from disk continues identically.
    dcp.save({"optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=ckpt_dir)
    model2, _ = build(mode, world)
    model2.load_state_dict(model.state_dict())
    opt2 = make_optimizer(model2, mode)
    state = {"optim": get_optimizer_state_dict(model2, opt2)}
    dcp.load(state, checkpoint_id=ckpt_dir)
    set_optimizer_state_dict(model2, opt2, state["optim"])
    set_grads([(ref, None), (model, ep), (model2, ep)], 3)
    opt.step()
    opt2.step()
    result["ckpt_diff"] = max((full(p.detach()) - full(model2.get_parameter(n).detach())).abs().max().item()
                              for n, p in model.named_parameters())
    print(json.dumps(result))


if __name__ == "__main__":
    dist.init_process_group("gloo")
    for mode in sys.argv[1].split(","):
        check(mode, os.path.join(sys.argv[2], mode))
    dist.barrier()  # no rank tears its groups down while another still talks
    dist.destroy_process_group()
