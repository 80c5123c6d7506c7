"""One rank of an expert-parallel MoE layer run through ``apply_expert_parallel``, checked against one process.

Every rank holds its own tokens; groups of ``--ep`` neighbouring ranks split the experts, whose stacks are
FSDP-sharded over the ranks holding the same experts (``MeshLayout``'s expert mesh), as the strategy shards them.
The reference is the whole layer run on the rank's tokens: output, input gradient and router/shared gradients
compare per rank; an expert's weight gradient with the world's mean (what data parallelism at ``ep = 1`` gives).
``--fp8``: FP8 dispatch, against a reference whose experts see their rows quantized the same way.
``--node-of`` gives each rank's node explicitly (e.g. a cyclic placement), else the launcher's identity is used.
Rank 0 prints one JSON line: every rank's dispatcher message, the largest relative differences, and the fraction
of input-gradient elements that are not bitwise equal to the reference.
"""

import argparse
import json

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from moe_lightning.model import MoEConfig
from moe_lightning.model.moe import MoELayer
from moe_lightning.parallel.expert_parallel import apply_expert_parallel, divide_expert_gradients, quantize_rows
from moe_lightning.parallel.expert_parallel import dequantize_rows
from moe_lightning.parallel.mesh import MeshLayout, ParallelMesh


def layer(config: MoEConfig, dtype: torch.dtype) -> MoELayer:
    torch.manual_seed(0)
    moe = MoELayer(config)
    moe.init_weights(std=config.dim ** -0.5, out_std=config.expert_hidden ** -0.5)  # O(1) activations
    return moe.to(dtype)


def fp8_expert_inputs(moe: MoELayer) -> None:
    """The reference for FP8 dispatch: its experts see each row quantized and dequantized as the dispatch sends it
    (per row, so the same whether done before or after copying rows), gradients passed straight through."""
    def hook(_, args):
        x_RD, *rest = args
        q, scale = quantize_rows(x_RD.detach(), torch.float8_e4m3fn)
        return (x_RD + (dequantize_rows(q, scale, x_RD.dtype) - x_RD).detach(), *rest)
    moe.experts.register_forward_pre_hook(hook)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ep", type=int, required=True)
    parser.add_argument("--node-of", help="comma-separated node of each rank (default: the launcher's)")
    parser.add_argument("--chunks", type=int, default=1)
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--scale", choices=("exchange", "fsdp"), default="exchange")
    parser.add_argument("--experts", type=int, default=12)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--fp8", action="store_true", help="FP8 dispatch; the reference quantizes its experts' input")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    config = MoEConfig(dim=32, num_experts=args.experts, top_k=args.top_k, expert_hidden=16, n_shared_experts=1)
    mesh = ParallelMesh(MeshLayout.resolve(world, 1, "auto", args.ep, args.experts), "cpu")
    efsdp = mesh.expert_fsdp

    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(1, args.tokens, config.dim, generator=gen).to(dtype)
    g = torch.randn(1, args.tokens, config.dim, generator=gen).to(dtype)

    full = layer(config, dtype)
    if args.fp8:
        fp8_expert_inputs(full)
    x_ref = x.clone().requires_grad_()
    y_ref = full(x_ref)
    (y_ref * g).sum().backward()

    moe = layer(config, torch.float32)
    moe.router.to(dtype), moe.shared_experts.to(dtype)
    node = args.node_of.split(",")[rank] if args.node_of else None
    message = apply_expert_parallel([moe], mesh.group("ep"), node=node, overlap_chunks=args.chunks,
                                    scale_in_exchange=args.scale == "exchange",
                                    dispatch_dtype=torch.float8_e4m3fn if args.fp8 else None)
    unit = fully_shard(moe.experts, mesh=efsdp, mp_policy=MixedPrecisionPolicy(param_dtype=dtype,
                                                                               reduce_dtype=torch.float32))
    if args.scale == "fsdp":
        divide_expert_gradients(unit, efsdp, args.ep)
    x_ep = x.clone().requires_grad_()
    y = moe(x_ep)
    (y * g).sum().backward()

    def relative(a, b):
        b = b.double()
        return ((a.double() - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()

    ep_rank, per_rank = rank % args.ep, args.experts // args.ep
    diffs = {"y": relative(y, y_ref), "x_grad": relative(x_ep.grad, x_ref.grad)}
    for name, p in moe.named_parameters():
        expected = dict(full.named_parameters())[name].grad.float()
        if name.startswith("experts."):
            dist.all_reduce(expected)
            expected = (expected / world)[ep_rank * per_rank:(ep_rank + 1) * per_rank]
            expected = expected.chunk(efsdp.size())[efsdp.get_local_rank()]  # Shard(0): this rank's rows
            p = p.grad.to_local()
        else:
            p = p.grad
        diffs[name] = relative(p, expected)
    x_grad_changed = (x_ep.grad != x_ref.grad).float().mean().item()
    worst = torch.tensor([*diffs.values(), x_grad_changed], dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    messages = [None] * world
    dist.all_gather_object(messages, message)
    if rank == 0:
        print(json.dumps({"messages": messages, "relative_max_differences": dict(zip(diffs, worst.tolist())),
                          "x_grad_changed_fraction": worst[-1].item()}), flush=True)
    dist.barrier()  # no rank tears its groups down while another still talks (gloo aborts)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
