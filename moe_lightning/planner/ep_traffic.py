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

# Per-GPU link speeds assumed, GB/s per direction (line rate; an all-to-all reaches less): InfiniBand NDR
# 400 Gb/s per GPU on HGX H100/H200 nodes, NDR200 per GPU on JUPITER's GH200 nodes (4 per node); NVLink 4
# 450 GB/s per GPU on HGX, 150 GB/s to each of the other three GH200s of a JUPITER node.
BANDWIDTH_GBPS = {"H100": (50.0, 450.0), "H200": (50.0, 450.0), "GH200": (25.0, 450.0)}
COUNT_BYTES = 8  # the count exchanges carry int64


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
                   copies: Copies, ranks: int = 1) -> dict[str, dict[str, dict[str, float]]]:
    """``{flat|hierarchical: {inter|intra: {forward|backward: bytes}}}`` one MoE layer sends, summed over ``ranks``.

    ``x_size``/``y_size``: element sizes of the tokens sent and of the experts' outputs (they differ under
    autocast with fp32 activations; FSDP's bf16 ``param_dtype`` makes both bf16). Forward: counts,
    dispatch (rows with their fp32 weights; hierarchical: with K weights and K int32 expert ids), combine.
    Backward: the combine's gradients out, the rows' (and weights') gradients back."""
    D, K = dim, top_k
    flat_row = flat_grad = packed_row_bytes((D, x_size), (1, 4))  # a row and its weight, or their gradients
    hier_row, hier_grad = packed_row_bytes((D, x_size), (K, 4), (K, 4)), packed_row_bytes((D, x_size), (K, 4))

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


def add_arguments(parser) -> None:
    parser.add_argument("--ib-gbps", type=float, help="InfiniBand GB/s per GPU per direction for the expert "
                        f"exchange (default by --gpu: {', '.join(f'{g} {b[0]:g}' for g, b in BANDWIDTH_GBPS.items())})")
    parser.add_argument("--nvlink-gbps", type=float, help="NVLink GB/s per GPU per direction (default by --gpu: "
                        f"{', '.join(f'{g} {b[1]:g}' for g, b in BANDWIDTH_GBPS.items())})")


def traffic(config: MoEConfig, plan: dict, ib_gbps: float | None = None, nvlink_gbps: float | None = None
            ) -> dict | str | None:
    """Expert-exchange bytes per GPU per step of a ``plan`` result (bf16 rows, every MoE layer, with and without
    recompute) and their time at the links' bandwidth beside the step's compute time; None without ``ep``, and
    why not when the layout has no whole nodes."""
    for flag, given in (("--ib-gbps", ib_gbps), ("--nvlink-gbps", nvlink_gbps)):
        if given is not None and not given > 0:
            raise ValueError(f"{flag}={given:g} must be > 0 (GB/s per GPU per direction).")
    c, w = plan["cluster"], plan["workload"]
    ep, per_node = c["expert_parallel_size"], c["gpus_per_node"]
    if ep == 1 or not config.n_moe_layers:
        return None
    if ep > per_node and ep % per_node:
        return (f"expert exchange   not priced: expert_parallel_size={ep} spans nodes but is not a multiple of "
                f"gpus_per_node={per_node}, so its groups are not whole nodes (the dispatch falls back to flat "
                f"all-to-all); choose expert_parallel_size <= {per_node} or a multiple of {per_node}.")
    local = min(ep, per_node)
    nodes, tokens = ep // local, w["micro_batch"] * w["seq_len"]
    ib, nvlink = BANDWIDTH_GBPS.get(c["gpu"], (None, None))
    ib, nvlink = ib_gbps or ib, nvlink_gbps or nvlink
    layer = exchange_bytes(config.dim, config.top_k, config.num_experts // ep, nodes, local, 2, 2,
                           uniform_copies(config, nodes, local, tokens))
    rows = {}
    for kind, scopes in layer.items():
        if kind == "hierarchical" and nodes == 1:
            continue
        for recompute in (False, True):
            inter, intra = (config.n_moe_layers * (s["forward"] * (2 if recompute else 1) + s["backward"])
                            for s in (scopes["inter"], scopes["intra"]))
            seconds = max(inter / (ib * 1e9), intra / (nvlink * 1e9)) if ib and nvlink else None
            rows[f"{kind}{' + recompute' if recompute else ''}"] = {
                "inter_node_bytes": inter, "intra_node_bytes": intra, "seconds": seconds}
    return {"nodes": nodes, "ranks_per_node": local, "tokens_per_gpu": tokens,
            "nodes_per_token": expected_nodes_per_token(config, nodes), "ib_gbps": ib, "nvlink_gbps": nvlink,
            "compute_seconds": tokens / plan["tokens_per_s_per_gpu"], "rows": rows}


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
             f"routing), bf16; per GPU per step {bw}",
             f"{'':<36}{'inter-node GB':>14}{'intra-node GB':>15}{'time s':>9}"]
    for name, r in t["rows"].items():
        time = f"{r['seconds']:>9.3g}" if r["seconds"] is not None else f"{'?':>9}"
        lines.append(f"{name:<36}{r['inter_node_bytes'] / 1e9:>14.4g}{r['intra_node_bytes'] / 1e9:>15.4g}{time}")
    lines.append(f"{'compute (at the planned MFU)':<36}{'':>29}{t['compute_seconds']:>9.3g}")
    return lines
