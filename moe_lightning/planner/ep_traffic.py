"""What the expert-parallel exchange sends per GPU per step, flat vs hierarchical dispatch, and how long it takes.

The byte counts are exact functions of the routing (how many token copies, or token rows, cross a node or
stay inside one) and of the packed row layouts of ``parallel/expert_parallel.py``; ``benchmarks/ep_dispatch.py``
counts the same bytes on the wire and ``tests/parallel/test_expert_parallel.py`` checks that they are equal. ``plan`` feeds
them the expectation under uniform routing (balanced experts, independent of the node), which is what the
balancing bias aims at; real routing may be more or less local.
"""

import math
import random
from dataclasses import dataclass
from itertools import combinations

from moe_lightning.model import MoEConfig
from moe_lightning.parallel.expert_parallel import FP8_BLOCK

# Per-GPU link speeds assumed, GB/s per direction (line rate; an all-to-all reaches less): InfiniBand NDR
# 400 Gb/s per GPU on HGX H100/H200 nodes, NDR200 per GPU on JUPITER's GH200 nodes (4 per node); NVLink 4
# 450 GB/s per GPU on HGX, 150 GB/s to each of the other three GH200s of a JUPITER node.
BANDWIDTH_GBPS = {"H100": (50.0, 450.0), "H200": (50.0, 450.0), "GH200": (25.0, 450.0)}
COUNT_BYTES = 8  # the count exchanges carry int64
DISPATCH_DTYPES = (None, "float8_e4m3fn")


def packed_row_bytes(*widths: tuple[int, int]) -> int:
    """Bytes of one packed row: ``(columns, element size)`` pieces side by side, padded to the widest element."""
    total = sum(c * e for c, e in widths)
    align = max(e for _, e in widths) if len(widths) > 1 else 1
    return -(-total // align) * align


@dataclass(frozen=True)
class Copies:
    """Routing statistics per MoE layer: rows a rank sends (summed over the ranks counted).

    ``copies_inter``/``copies_intra``: (token, expert) copies to another node / another rank of the node (flat).
    ``rows_inter``: (token, remote node) rows (hierarchical first hop); ``fanout_intra``: copies its second hop
    moves to another rank of the node."""

    copies_inter: float
    copies_intra: float
    rows_inter: float
    fanout_intra: float


def exchange_bytes(dim: int, top_k: int, local_experts: int, nodes: int, local: int, x_size: int, y_size: int,
                   copies: Copies, ranks: int = 1, fp8: bool = False) -> dict[str, dict[str, dict[str, float]]]:
    """``{flat|hierarchical: {inter|intra: {forward|backward: bytes}}}`` one MoE layer sends, summed over ``ranks``.

    ``x_size``/``y_size``: element sizes of the tokens sent and of the experts' outputs (they differ under
    autocast with fp32 activations; FSDP's bf16 ``param_dtype`` makes both bf16). Forward: counts,
    dispatch (rows with their fp32 weights; hierarchical: with K weights and K int32 expert ids), combine.
    Backward: the combine's gradients out, the rows' (and weights') gradients back. ``fp8``: the dispatch hops'
    hidden rows go as 1 byte an element with an fp32 scale per ``FP8_BLOCK`` columns (``dispatch_dtype``); the
    combine and every gradient stay in the training dtype."""
    D, K = dim, top_k
    hidden = ((D, 1), (-(-D // FP8_BLOCK), 4)) if fp8 else ((D, x_size),)
    flat_row, flat_grad = packed_row_bytes(*hidden, (1, 4)), packed_row_bytes((D, x_size), (1, 4))
    hier_row, hier_grad = packed_row_bytes(*hidden, (K, 4), (K, 4)), packed_row_bytes((D, x_size), (K, 4))

    def two_way(n, row, grad, counts, y=D * y_size):
        return {"forward": n * (row + y) + counts * ranks, "backward": n * (y + grad)}

    ep = nodes * local
    count_flat_inter = (ep - local) * local_experts * COUNT_BYTES
    count_intra = (local - 1) * local_experts * COUNT_BYTES
    count_hier_inter = (nodes - 1) * (1 + local * local_experts) * COUNT_BYTES
    return {
        "flat": {"inter": two_way(copies.copies_inter, flat_row, flat_grad, count_flat_inter),
                 "intra": two_way(copies.copies_intra, flat_row, flat_grad, count_intra)},
        # the node's sum of its experts' outputs is in the tokens' dtype
        "hierarchical": {"inter": two_way(copies.rows_inter, hier_row, hier_grad, count_hier_inter, D * x_size),
                         "intra": two_way(copies.fanout_intra, flat_row, flat_grad, count_intra)},
    }


def expected_nodes_per_token(config: MoEConfig, nodes: int, draws: int = 20000) -> float:
    """Distinct nodes a token's ``top_k`` experts sit on, expected under uniform routing within its groups.

    Experts are node-major (``E / nodes`` per node). Exact over every choice of groups when there are at most
    ``draws`` choices, else averaged over that many seeded draws."""
    E, K, G, M = config.num_experts, config.top_k, config.n_expert_groups, config.n_limited_groups
    per_node, per_group = E // nodes, E // G

    def distinct(groups) -> float:
        reach = [0] * nodes
        for g in groups:
            for e in range(g * per_group, (g + 1) * per_group):
                reach[e // per_node] += 1
        S = sum(reach)
        return sum(1 - math.comb(S - s, K) / math.comb(S, K) for s in reach if s)

    if G == 1:
        return distinct([0])
    if math.comb(G, M) <= draws:
        choices = list(combinations(range(G), M))
    else:
        rng = random.Random(0)
        choices = [rng.sample(range(G), M) for _ in range(draws)]
    return sum(distinct(c) for c in choices) / len(choices)


def uniform_copies(config: MoEConfig, nodes: int, local: int, tokens: int) -> Copies:
    """Per-GPU routing statistics of ``tokens`` tokens under uniform routing (each rank equally likely)."""
    K, remote = config.top_k, (nodes - 1) / nodes
    return Copies(copies_inter=tokens * K * remote, copies_intra=tokens * K * (local - 1) / (nodes * local),
                  rows_inter=tokens * expected_nodes_per_token(config, nodes) * remote,
                  fanout_intra=tokens * K * (local - 1) / local)


def check_options(chunks: int, dispatch_dtype: str | None, imbalance: float) -> None:
    if not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 1:
        raise ValueError(f"--ep-overlap-chunks={chunks!r} (strategy.ep_overlap_chunks): must be a positive integer "
                         "(1: no overlap).")
    if dispatch_dtype not in DISPATCH_DTYPES:
        raise ValueError(f"--dispatch-dtype={dispatch_dtype!r} (strategy.dispatch_dtype): use null (the training "
                         "dtype) or float8_e4m3fn.")
    if not imbalance >= 1:
        raise ValueError(f"--ep-imbalance={imbalance:g}: the busiest rank's rows over the mean, must be >= 1.")


def add_arguments(parser) -> None:
    parser.add_argument("--ib-gbps", type=float, help="InfiniBand GB/s per GPU per direction for the expert "
                        f"exchange (default by --gpu: {', '.join(f'{g} {b[0]:g}' for g, b in BANDWIDTH_GBPS.items())})")
    parser.add_argument("--nvlink-gbps", type=float, help="NVLink GB/s per GPU per direction (default by --gpu: "
                        f"{', '.join(f'{g} {b[1]:g}' for g, b in BANDWIDTH_GBPS.items())})")
    parser.add_argument("--ep-overlap-chunks", type=int, help="chunks a MoE layer's exchange is pipelined in "
                        "(default: strategy.ep_overlap_chunks, else the strategy's default)")
    parser.add_argument("--dispatch-dtype", choices=("float8_e4m3fn", "none"), help="dispatch hops' row dtype "
                        "(default: strategy.dispatch_dtype; none: the training dtype)")
    parser.add_argument("--ep-imbalance", type=float, help="busiest rank's exchange rows over the mean, for the "
                        "exchange's transient buffers (default 1.5)")


def bandwidths(gpu: str, ib_gbps: float | None, nvlink_gbps: float | None) -> tuple[float | None, float | None]:
    """(InfiniBand, NVLink) GB/s per GPU per direction: the flags, else ``BANDWIDTH_GBPS`` by GPU model."""
    for flag, given in (("--ib-gbps", ib_gbps), ("--nvlink-gbps", nvlink_gbps)):
        if given is not None and not given > 0:
            raise ValueError(f"{flag}={given:g} must be > 0 (GB/s per GPU per direction).")
    ib, nvlink = BANDWIDTH_GBPS.get(gpu, (None, None))
    return ib_gbps or ib, nvlink_gbps or nvlink


def layout(ep: int, gpus_per_node: int) -> tuple[int, int] | str:
    """(nodes, ranks per node) of an expert-parallel group, or why its exchange cannot be priced."""
    if ep > gpus_per_node and ep % gpus_per_node:
        return (f"expert exchange   not priced: expert_parallel_size={ep} spans nodes but is not a multiple of "
                f"gpus_per_node={gpus_per_node}, so its groups are not whole nodes (the dispatch falls back to flat "
                f"all-to-all); choose expert_parallel_size <= {gpus_per_node} or a multiple of {gpus_per_node}.")
    local = min(ep, gpus_per_node)
    return ep // local, local


def layer_bytes(config: MoEConfig, ep: int, gpus_per_node: int, tokens: int, fp8: bool = False):
    nodes, local = layout(ep, gpus_per_node)
    return exchange_bytes(config.dim, config.top_k, config.num_experts // ep, nodes, local, 2, 2,
                          uniform_copies(config, nodes, local, tokens), fp8=fp8)


def transient_bytes(config: MoEConfig, ep: int, tokens: int, chunks: int, imbalance: float,
                    element_size: int = 2) -> int:
    """GPU bytes the exchange of one MoE layer holds beyond what autograd saves, at its worst moment.

    Counted by ``benchmarks/ep_dispatch.py --memory`` (torch's CPU memory profiler over one dispatcher forward,
    flat and hierarchical alike): with one chunk, the experts' output rows and their copy in source order (the
    combine's send buffer), as large as the dispatch's receive buffer and its regrouped copy,
    ``2 · f · K · D · s`` a token, ``f`` the busiest receiver's rows over the mean; with ``C > 1`` chunks at most
    ``4 · f · K · D · s / C + D · s`` (a chunk's regrouped copy and the next chunk's dispatch in flight, and the
    chunks' outputs joined at the end). FP8 dispatch does not lower it: the peak is in the training dtype."""
    if ep == 1 or not config.n_moe_layers:
        return 0
    row = config.top_k * config.dim * element_size * imbalance
    per_token = 2 * row if chunks == 1 else 4 * row / chunks + config.dim * element_size
    return math.ceil(per_token * tokens)


def traffic(config: MoEConfig, plan: dict, ib_gbps: float | None = None, nvlink_gbps: float | None = None
            ) -> dict | str | None:
    """Expert-exchange bytes per GPU per step of a ``plan`` result (every MoE layer, with and without recompute)
    and their time at the links' bandwidth; None without ``ep``, and why not when the layout has no whole nodes.

    Time: a flat all-to-all sends to every peer at once, its NVLink and InfiniBand parts side by side (the
    larger); the hierarchical dispatcher's hops run one after the other (their sum)."""
    c, w = plan["cluster"], plan["workload"]
    ep, per_node = c["expert_parallel_size"], c["gpus_per_node"]
    if ep == 1 or not config.n_moe_layers:
        return None
    if isinstance(layout(ep, per_node), str):
        return layout(ep, per_node)
    nodes, local = layout(ep, per_node)
    tokens, fp8 = plan["tokens_per_gpu"], w["dispatch_dtype"] == "float8_e4m3fn"
    ib, nvlink = bandwidths(c["gpu"], ib_gbps, nvlink_gbps)
    layer = layer_bytes(config, ep, per_node, tokens, fp8)
    rows = {}
    for kind, scopes in layer.items():
        if kind == "hierarchical" and nodes == 1:
            continue
        for recompute in (False, True):
            inter, intra = (config.n_moe_layers * (s["forward"] * (2 if recompute else 1) + s["backward"])
                            for s in (scopes["inter"], scopes["intra"]))
            times = (inter / (ib * 1e9), intra / (nvlink * 1e9)) if ib and nvlink else None
            seconds = None if times is None else (max(times) if kind == "flat" else sum(times))
            rows[f"{kind}{' + recompute' if recompute else ''}"] = {
                "inter_node_bytes": inter, "intra_node_bytes": intra, "seconds": seconds}
    return {"nodes": nodes, "ranks_per_node": local, "tokens_per_gpu": tokens,
            "nodes_per_token": expected_nodes_per_token(config, nodes), "ib_gbps": ib, "nvlink_gbps": nvlink,
            "dispatch_dtype": w["dispatch_dtype"], "compute_seconds": tokens / plan["tokens_per_s_per_gpu"],
            "expert_seconds": expert_seconds(config, tokens, w["mfu"] * c["peak_tflops"] * 1e12), "rows": rows}


def expert_seconds(config: MoEConfig, tokens: int, flops_per_s: float) -> float:
    """Routed-expert matmul time of one step (every MoE layer: forward, recompute and backward, ``8 · 3dFK``)."""
    return config.n_moe_layers * 8 * 3 * config.dim * config.expert_hidden * config.top_k * tokens / flops_per_s


def format_traffic(t: dict | str | None) -> list[str]:
    if t is None:
        return []
    if isinstance(t, str):
        return ["", t]
    bw = (f"at {t['ib_gbps']:g} GB/s InfiniBand and {t['nvlink_gbps']:g} GB/s NVLink per GPU (--ib-gbps, "
          f"--nvlink-gbps)" if t["ib_gbps"] and t["nvlink_gbps"]
          else "(no bandwidth known for this GPU: pass --ib-gbps, --nvlink-gbps)")
    lines = ["", f"expert exchange   ep over {t['nodes']} node(s) x {t['ranks_per_node']} GPUs, "
             f"{t['tokens_per_gpu']:,} tokens per GPU, {t['nodes_per_token']:.2f} nodes per token (uniform "
             f"routing), {'FP8 dispatch rows' if t['dispatch_dtype'] else 'bf16'}; per GPU per step {bw}",
             f"{'':<36}{'inter-node GB':>14}{'intra-node GB':>15}{'time s':>9}"]
    for name, r in t["rows"].items():
        time = f"{r['seconds']:>9.3g}" if r["seconds"] is not None else f"{'?':>9}"
        lines.append(f"{name:<36}{r['inter_node_bytes'] / 1e9:>14.4g}{r['intra_node_bytes'] / 1e9:>15.4g}{time}")
    return lines
