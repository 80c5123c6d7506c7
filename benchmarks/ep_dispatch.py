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

``--fp8`` adds ``hierarchical_fp8`` (FP8 dispatch): its bytes, the bytes of the forward dispatch hops alone
(``dispatch_inter_bytes_per_rank``, where FP8 applies; every kind reports it) and its difference from the
unquantized hierarchical run. ``--chunks N`` pipelines every dispatcher's tokens in N chunks (the bytes are the
same up to the count exchange).

``--memory`` instead measures transient memory: one forward of the dispatcher alone (experts included, routing
given: ``even``, or ``skewed`` towards the first quarter of the experts, see :func:`routed`) at 1 chunk and at
``--chunks`` chunks, with and without FP8; per rank the peak bytes allocated above the start (torch's CPU memory
profiler: every allocation and free of the CPU allocator, in order) and the bytes still held at the end (saved for
backward, and the output), the least of 5 runs after one unmeasured warm-up (the first GEMMs allocate lasting
caches). Rank 0 prints one JSON line per case with every rank's figures, the rows each rank received, the
imbalance (the busiest receiver's rows over the mean) and, for the flat dispatcher at 1 chunk, the hand count
(see :func:`hand_count`).

    python benchmarks/ep_dispatch.py --memory   # under torchrun as above; or 2 ranks of one node
"""

import argparse
import gc
import json
import os
from collections import Counter

import torch
import torch.distributed as dist
import torch.utils.checkpoint

from moe_lightning.planner import ep_traffic
from moe_lightning.model import MoEConfig
from moe_lightning.model.moe import GroupedExperts, MoELayer
from moe_lightning.parallel.expert_parallel import AllToAllTokenDispatcher, make_dispatcher

SENT = Counter()  # scope -> bytes this rank sent ("dispatch": forward dispatch hops to another node)
READS = Counter()
PHASE = {"forward": False}  # set while a forward runs: its packed (uint8) exchanges are the dispatch hops


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
                inter = dest // per_node != me // per_node
                SENT["inter" if inter else "intra"] += n * row_bytes
                if inter and PHASE["forward"] and input.dtype == torch.uint8 and async_op:
                    SENT["dispatch"] += n * row_bytes
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
        PHASE["forward"] = True
        y = run(x[None])[0]
        PHASE["forward"] = False
        (y.float() * g_TD).sum().backward()
    finally:
        PHASE["forward"] = False
        restore()
    grads = {"x": x.grad, **{n: p.grad for n, p in moe.named_parameters()}}
    return y.detach(), grads


def peak_bytes(fn) -> tuple[int, int]:
    """Peak bytes allocated above the start while ``fn()`` runs and the bytes still held when it has returned (its
    result and what autograd saved for backward), from torch's CPU memory profiler: every allocation and free of
    the CPU allocator, in order."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    live = peak = 0
    for _, nbytes in sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                            if e.name() == "[memory]"):
        live += nbytes
        peak = max(peak, live)
    del result
    return peak, live


def routed(tokens: int, experts: int, top_k: int, skewed: bool, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights_TK, experts_TK)``: distinct experts per token, uniform (``even``) or ``skewed``: each expert of the
    first quarter drawn 729 times as often as any other (on 2 or 4 ranks nearly every copy goes to rank 0's
    experts: the imbalance approaches the number of ranks)."""
    gen = torch.Generator().manual_seed(seed)
    weights_E = torch.ones(experts)
    if skewed:
        weights_E[:experts // 4] = 729.0
    experts_TK = torch.multinomial(weights_E.expand(tokens, -1), top_k, generator=gen)
    return torch.rand(tokens, top_k, generator=gen) + 0.5, experts_TK


def hand_count(tokens: int, rows_in: int, rows_out: int, dim: int, hidden: int, size: int) -> tuple[int, int]:
    """The flat dispatcher's peak at 1 chunk (the probe's input copy included), counted by hand as the largest of
    the moments where it can occur (``s`` bytes per element, ``T`` tokens, rows received ``R_in``, sent ``R_out``;
    the experts keep their input rows ``R_in x D`` and the gate and up projections ``2 x R_in x F`` for backward):

    - dispatch landed: the receive buffer ``R_in x (D s + 4)`` (rows, routing weight) and its regrouped copy
      ``R_in x D s``;
    - regrouping undone: the experts' output ``R_in x D s`` and its copy in source order (the combine's send buffer);
    - combine landed: its receive buffer ``R_out x D s`` and the layer's output ``T x D s``; the send buffer too
      when the backend lets go of it only after the output is allocated (gloo's worker thread drops its reference
      when it gets round to it: the second figure);

    each beside the input ``T x D s`` and the experts' saved activations once made. Returns ``(low, high)``: without
    and with that late send buffer. Index tensors (8 bytes per row, a few of them) are left out: the stated margin
    covers them."""
    x, saved = tokens * dim * size, rows_in * (dim + 2 * hidden) * size
    landed = x + rows_in * (dim * size + 4) + rows_in * dim * size
    regrouped = x + saved + 2 * rows_in * dim * size
    combined = x + saved + rows_out * dim * size + tokens * dim * size
    return max(landed, regrouped, combined), max(landed, regrouped, combined + rows_in * dim * size)


def memory_probe(args, group, dispatcher_of) -> None:
    """Transient memory of one dispatcher forward per routing, chunk count and dispatch dtype (see the docstring)."""
    rank, ep = dist.get_rank(), dist.get_world_size()
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    el, size = args.experts // ep, torch.finfo(dtype).bits // 8
    torch.manual_seed(0)
    experts = GroupedExperts(args.experts, args.dim, args.hidden)
    experts.init_weights(std=args.dim ** -0.5, out_std=args.hidden ** -0.5)
    experts = slice_experts_of(experts, rank, ep).to(dtype)
    for routing in ("even", "skewed"):
        weights_TK, experts_TK = routed(args.tokens, args.experts, args.top_k, routing == "skewed", 7 + rank)
        x_TD = torch.randn(args.tokens, args.dim, generator=torch.Generator().manual_seed(rank)).to(dtype)
        counts_E = torch.bincount(experts_TK.flatten(), minlength=args.experts)
        dist.all_reduce(counts_E)
        rows_in = counts_E.view(ep, el).sum(1)[rank].item()
        rows_out = args.tokens * args.top_k
        for chunks in sorted({1, args.chunks}):
            for fp8 in (False, True) if args.fp8 else (False,):
                dispatcher, how = dispatcher_of(chunks, fp8)
                run = lambda: dispatcher(x_TD.clone().requires_grad_(), weights_TK.to(dtype), experts_TK,
                                         torch.bincount(experts_TK.flatten(), minlength=args.experts), experts)
                run()  # warm-up: the first GEMMs allocate lasting caches
                # The least of 5: gloo's worker thread drops its references to finished buffers when it gets
                # round to it (on a loaded machine, after the next buffer is allocated), which can only add to
                # the program's own peak.
                repeats = []
                for _ in range(5):
                    gc.collect()
                    dist.barrier()
                    repeats.append(peak_bytes(run))
                peak, held = min(repeats)
                figures = torch.tensor([peak, held, rows_in, rows_out], dtype=torch.float64)
                table = [torch.zeros_like(figures) for _ in range(ep)]
                dist.all_gather(table, figures)
                if rank == 0:
                    table = [t.tolist() for t in table]
                    received = [t[2] for t in table]
                    result = {"memory": routing, "chunks": chunks, "fp8": fp8, "dispatcher": how,
                              "dtype": args.dtype, "tokens_per_rank": args.tokens, "dim": args.dim,
                              "hidden": args.hidden, "top_k": args.top_k,
                              "peak_bytes": [int(t[0]) for t in table], "held_bytes": [int(t[1]) for t in table],
                              "rows_in": [int(t[2]) for t in table], "rows_out": [int(t[3]) for t in table],
                              "imbalance": max(received) / (sum(received) / ep)}
                    if chunks == 1 and "flat" in how and not fp8:
                        result["hand_count"] = [hand_count(args.tokens, int(t[2]), int(t[3]), args.dim,
                                                           args.hidden, size) for t in table]
                    print(json.dumps(result), flush=True)


def slice_experts_of(experts: GroupedExperts, rank: int, ep: int) -> GroupedExperts:
    local = experts.num_experts // ep
    for name, p in list(experts.named_parameters(recurse=False)):
        setattr(experts, name, torch.nn.Parameter(p.detach()[rank * local:(rank + 1) * local].clone()))
    return experts


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=1024, help="tokens per rank")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--recompute", action="store_true", help="checkpoint the layer (forward runs twice)")
    parser.add_argument("--routing", nargs="+", default=["unrestricted", "node-limited", "empty-rank"])
    parser.add_argument("--chunks", type=int, default=1, help="overlap chunks (--memory: compared with 1)")
    parser.add_argument("--fp8", action="store_true", help="also FP8 dispatch (dispatch_dtype=float8_e4m3fn)")
    parser.add_argument("--memory", action="store_true", help="measure transient memory instead (see above)")
    parser.add_argument("--hidden", type=int, default=32, help="--memory: expert hidden size")
    args = parser.parse_args(argv)
    dist.init_process_group("gloo")
    rank, ep = dist.get_rank(), dist.get_world_size()
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    group = dist.group.WORLD
    if args.memory:
        def dispatcher_of(chunks, fp8):
            return make_dispatcher(group, args.experts // ep, overlap_chunks=chunks,
                                   dispatch_dtype=torch.float8_e4m3fn if fp8 else None)
        memory_probe(args, group, dispatcher_of)
        dist.destroy_process_group()
        return
    hierarchical, _ = make_dispatcher(group, args.experts // ep, overlap_chunks=args.chunks)
    fp8 = make_dispatcher(group, args.experts // ep, overlap_chunks=args.chunks,
                          dispatch_dtype=torch.float8_e4m3fn)[0] if args.fp8 else None
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
        kinds = ("flat", "hierarchical", "hierarchical_fp8") if args.fp8 else ("flat", "hierarchical")
        for kind in kinds:
            moe = slice_experts(layer(config, dtype), rank, ep)
            moe.router.expert_bias.copy_(full.router.expert_bias)
            moe.dispatcher = {"flat": AllToAllTokenDispatcher(group, overlap_chunks=args.chunks),
                              "hierarchical": hierarchical, "hierarchical_fp8": fp8}[kind]
            SENT.clear()
            READS.clear()
            dist.barrier()
            outputs[kind] = step(moe, x_TD, g_TD, args.recompute)
            sent = torch.tensor([SENT["inter"], SENT["intra"], sum(READS.values()), SENT["dispatch"]],
                                dtype=torch.float64)
            dist.all_reduce(sent)
            result[kind] = {"inter_bytes_per_rank": sent[0].item() / ep, "intra_bytes_per_rank": sent[1].item() / ep,
                            "dispatch_inter_bytes_per_rank": sent[3].item() / ep,
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
        if args.fp8:
            hier, fp8_run = result["hierarchical"], result["hierarchical_fp8"]
            result["fp8_over_hierarchical_dispatch_inter"] = (fp8_run["dispatch_inter_bytes_per_rank"]
                                                              / hier["dispatch_inter_bytes_per_rank"])
            result["fp8_over_hierarchical_inter"] = fp8_run["inter_bytes_per_rank"] / hier["inter_bytes_per_rank"]
            y8, g8 = outputs.pop("hierarchical_fp8")
            hy, hg = outputs["hierarchical"]
            worst = torch.tensor([((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))
                                  for a, b in zip([y8, *g8.values()], [hy, *hg.values()])])
            dist.all_reduce(worst, op=dist.ReduceOp.MAX)
            result["fp8_relative_max_differences"] = dict(zip(["y", *g8], worst.tolist()))
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
