"""Bytes the expert exchange sends between nodes, flat vs hierarchical dispatch, counted on the wire (CPU, gloo).

Run it as 2 "nodes" x 2 ranks on one machine (two torchrun agents, as a two-node job starts):

    for n in 0 1; do torchrun --nnodes 2 --nproc-per-node 2 --node-rank $n --master-addr 127.0.0.1 \\
        --master-port 29531 benchmarks/ep_dispatch.py & done; wait

One MoE layer (configs/tiny-fsdp.yaml's shape by default: dim 128, 8 experts, top-2, 1,024 tokens per rank,
fp32) takes one forward and backward step with each dispatcher on the same tokens. Every ``all_to_all_single``
is counted by destination: another node, another rank of this node (the rank itself moves nothing). Routings:
``unrestricted`` top-k, ``node-limited`` (one group per node, 1 group per token) and ``empty-rank`` (the bias
keeps every token away from the last rank's experts: a rank that receives nothing). Rank 0 prints one JSON line
per routing: bytes per rank per MoE layer per step, per token, the analytic minimum (distinct remote nodes per
token x dim x element size, one crossing; and that times the step's crossings, 4 or 6 with recompute, beside
the measured ``inter_bytes_per_token`` of the whole step), ``ep_traffic``'s count for the same routing (must be
equal), the largest difference of outputs and gradients hierarchical vs flat vs one process, and host reads per
forward.
"""

import argparse
import json
import os
from collections import Counter

import torch
import torch.distributed as dist
import torch.utils.checkpoint

from moe_lightning.planner import ep_traffic
from moe_lightning.model import MoEConfig
from moe_lightning.model.moe import MoELayer
from moe_lightning.parallel.expert_parallel import AllToAllTokenDispatcher, make_dispatcher

SENT = Counter()  # (scope, direction) -> bytes this rank sent
READS = Counter()


def count_bytes(all_to_all_single):
    """Wrap ``dist.all_to_all_single``: add each destination's bytes to SENT by scope (inter / intra node)."""
    per_node = int(os.environ["LOCAL_WORLD_SIZE"])
    me = dist.get_rank()

    def counted(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
        size = dist.get_world_size(group)
        rows = input_split_sizes or [input.shape[0] // size] * size
        row_bytes = input[0].numel() * input.element_size() if input.shape[0] else 0
        for i, n in enumerate(rows):
            dest = dist.get_global_rank(group, i) if group is not None else i
            if dest != me:
                SENT["inter" if dest // per_node != me // per_node else "intra"] += n * row_bytes
        return all_to_all_single(output, input, output_split_sizes, input_split_sizes, group=group,
                                 async_op=async_op)
    return counted


def count_reads():
    """Count host reads (``tolist``/``item``/...) like tests/training/test_host_syncs.py; returns a restore function."""
    originals = {name: getattr(torch.Tensor, name) for name in ("item", "tolist", "cpu", "__bool__", "__float__",
                                                                 "__int__")}
    for name, original in originals.items():
        def read(tensor, *args, _name=name, _original=original, **kwargs):
            READS[_name] += 1
            return _original(tensor, *args, **kwargs)
        setattr(torch.Tensor, name, read)
    return lambda: [setattr(torch.Tensor, n, o) for n, o in originals.items()]


def layer(config: MoEConfig, dtype: torch.dtype) -> MoELayer:
    torch.manual_seed(0)
    moe = MoELayer(config)
    moe.init_weights(std=config.dim ** -0.5, out_std=config.expert_hidden ** -0.5)  # O(1) activations
    return moe.to(dtype)


def slice_experts(moe: MoELayer, rank: int, ep: int) -> MoELayer:
    local = moe.num_experts // ep
    for name, p in list(moe.experts.named_parameters(recurse=False)):
        setattr(moe.experts, name, torch.nn.Parameter(p.detach()[rank * local:(rank + 1) * local].clone()))
    return moe


def step(moe: MoELayer, x_TD: torch.Tensor, g_TD: torch.Tensor, recompute: bool):
    x = x_TD.clone().requires_grad_()
    run = (lambda t: torch.utils.checkpoint.checkpoint(moe, t, use_reentrant=False)) if recompute else moe
    restore = count_reads()  # forward and backward (where recompute runs the forward again)
    try:
        y = run(x[None])[0]
        (y.float() * g_TD).sum().backward()
    finally:
        restore()
    grads = {"x": x.grad, **{n: p.grad for n, p in moe.named_parameters()}}
    return y.detach(), grads


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=1024, help="tokens per rank")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--recompute", action="store_true", help="checkpoint the layer (forward runs twice)")
    parser.add_argument("--routing", nargs="+", default=["unrestricted", "node-limited", "empty-rank"])
    args = parser.parse_args(argv)
    dist.init_process_group("gloo")
    rank, ep = dist.get_rank(), dist.get_world_size()
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    group = dist.group.WORLD
    hierarchical, _ = make_dispatcher(group, args.experts // ep)
    nodes, local = hierarchical.nodes, hierarchical.local
    dist.all_to_all_single = count_bytes(dist.all_to_all_single)
    for routing in args.routing:
        limited = routing == "node-limited"
        config = MoEConfig(vocab_size=32, dim=args.dim, n_layers=1, n_heads=4, n_kv_heads=4, ffn_hidden=64,
                           num_experts=args.experts, top_k=args.top_k, expert_hidden=args.dim, n_shared_experts=1,
                           n_expert_groups=nodes if limited else 1, n_limited_groups=1)
        gen = torch.Generator().manual_seed(1000 + rank)
        x_TD = torch.randn(args.tokens, args.dim, generator=gen).to(dtype)
        g_TD = torch.randn(args.tokens, args.dim, generator=gen)
        full = layer(config, dtype)
        if routing == "empty-rank":
            full.router.expert_bias[-(args.experts // ep):] = -1e4  # selection only: weights are unchanged
        y_ref, g_ref = step(full, x_TD, g_TD, False)
        experts_TK = full.router(x_TD)[1]
        result = {"routing": routing, "nodes": nodes, "ranks_per_node": local, "dtype": args.dtype,
                  "tokens_per_rank": args.tokens, "recompute": args.recompute}
        outputs = {}
        for kind in ("flat", "hierarchical"):
            moe = slice_experts(layer(config, dtype), rank, ep)
            moe.router.expert_bias.copy_(full.router.expert_bias)
            moe.dispatcher = AllToAllTokenDispatcher(group) if kind == "flat" else hierarchical
            SENT.clear()
            READS.clear()
            dist.barrier()
            outputs[kind] = step(moe, x_TD, g_TD, args.recompute)
            sent = torch.tensor([SENT["inter"], SENT["intra"], sum(READS.values())], dtype=torch.float64)
            dist.all_reduce(sent)
            result[kind] = {"inter_bytes_per_rank": sent[0].item() / ep, "intra_bytes_per_rank": sent[1].item() / ep,
                            "inter_bytes_per_token": sent[0].item() / ep / args.tokens,
                            "host_reads_per_forward": sent[2].item() / ep / (2 if args.recompute else 1)}
        # Routing statistics from the tokens' chosen experts, summed over ranks: what ep_traffic prices.
        el, per_node_experts = args.experts // ep, args.experts // nodes
        node_TK, rank_TK = experts_TK // per_node_experts, experts_TK // el
        my_node, my_local = rank // local, rank % local
        distinct_TN = torch.zeros(args.tokens, nodes, dtype=torch.bool).scatter_(1, node_TK, True)
        stats = torch.tensor([(node_TK != my_node).sum(), ((node_TK == my_node) & (rank_TK != rank)).sum(),
                              distinct_TN.sum() - distinct_TN[:, my_node].sum(), (rank_TK % local != my_local).sum()],
                             dtype=torch.float64)
        dist.all_reduce(stats)
        copies = ep_traffic.Copies(*stats.tolist())
        size = torch.finfo(dtype).bits // 8
        priced = ep_traffic.exchange_bytes(args.dim, args.top_k, el, nodes, local, size, size, copies, ranks=ep)
        passes = 2 if args.recompute else 1
        for kind in ("flat", "hierarchical"):
            result[kind]["plan_inter_bytes_per_rank"] = (priced[kind]["inter"]["forward"] * passes
                                                         + priced[kind]["inter"]["backward"]) / ep
            result[kind]["plan_intra_bytes_per_rank"] = (priced[kind]["intra"]["forward"] * passes
                                                         + priced[kind]["intra"]["backward"]) / ep
        # One crossing's minimum: each token once to each remote node it needs, dim x element size. The step
        # crosses 4 times (dispatch and combine, forward and backward; 6 with recompute's second forward), so
        # inter_bytes_per_token (the whole step, routing metadata and counts included) compares with the step's.
        one_way = stats[2].item() / ep / args.tokens * args.dim * size
        crossings = 2 * passes + 2
        result["minimum_bytes_per_token_one_way"] = one_way
        result["minimum_inter_bytes_per_token_step"] = one_way * crossings
        result["crossings_per_step"] = crossings
        result["hierarchical_over_flat_inter"] = result["hierarchical"]["inter_bytes_per_rank"] / \
            result["flat"]["inter_bytes_per_rank"]
        diffs = {}
        for name, (y, grads) in (("flat", outputs["flat"]), ("hierarchical", outputs["hierarchical"])):
            ref = {"y": y_ref, **g_ref}
            mine = {"y": y, **grads}
            worst = 0.0
            for key, value in mine.items():
                expected = ref[key]
                if key.startswith("experts."):  # this rank's slice of the ep-averaged whole-batch gradient
                    expected = expected.double()
                    dist.all_reduce(expected)
                    expected = (expected / ep)[rank * el:(rank + 1) * el]
                scale = expected.double().abs().max().clamp_min(1e-30)
                worst = max(worst, ((value.double() - expected.double()).abs().max() / scale).item())
            diffs[f"{name}_vs_one_process"] = worst
        flat_y, flat_g = outputs["flat"]
        hier_y, hier_g = outputs["hierarchical"]
        diffs["hierarchical_vs_flat"] = max(((a.double() - b.double()).abs().max() /
                                             b.double().abs().max().clamp_min(1e-30)).item()
                                            for a, b in zip([hier_y, *hier_g.values()], [flat_y, *flat_g.values()]))
        diffs["forward_bitwise"] = bool(torch.equal(hier_y, flat_y))
        out = torch.tensor([v for v in diffs.values()], dtype=torch.float64)
        dist.all_reduce(out, op=dist.ReduceOp.MAX)
        out_min = torch.tensor([float(diffs["forward_bitwise"])])
        dist.all_reduce(out_min, op=dist.ReduceOp.MIN)
        result["relative_max_differences"] = dict(zip(list(diffs)[:3], out[:3].tolist()))
        result["forward_bitwise_equal"] = bool(out_min.item())
        if rank == 0:
            print(json.dumps(result), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
