"""What the expert-parallel exchange sends per GPU per step, flat vs hierarchical dispatch, and how long it takes.

The byte counts are exact functions of the routing (how many token copies, or token rows, cross a node or
stay inside one) and of the packed row layouts of ``parallel/expert_parallel.py``; ``benchmarks/ep_dispatch.py``
counts the same bytes on the wire and ``tests/parallel/test_expert_parallel.py`` checks that they are equal. ``plan`` feeds
them the expectation under uniform routing (balanced experts, independent of the node), which is what the
balancing bias aims at; real routing may be more or less local.

Each expert-parallel group is priced as the runtime lays it out: ``group_layouts`` feeds the mesh's groups and the
ranks' nodes to the dispatcher's own ``expert_parallel.plan_layout`` (hierarchical over whole nodes, flat within
one node, or flat across nodes when the nodes hold unequal shares of the group), and the step waits for the
slowest group. Ranks are placed node-major (rank ``// gpus_per_node``), as torchrun and SLURM's block distribution
place them.
"""

import math
import random
from dataclasses import dataclass
from itertools import combinations

from moe_lightning.model import MoEConfig
from moe_lightning.parallel import MeshLayout
from moe_lightning.parallel.expert_parallel import FP8_BLOCK, plan_layout
from moe_lightning.planner.exchange_time import COLLECTIVE_LATENCY_US, HOST_SYNC_US

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
                   copies: Copies, ranks: int = 1, fp8: bool = False, ep: int | None = None
                   ) -> dict[str, dict[str, dict[str, float]]]:
    """``{flat|hierarchical: {inter|intra: {forward|backward: bytes}}}`` one MoE layer sends, summed over ``ranks``.

    ``x_size``/``y_size``: element sizes of the tokens sent and of the experts' outputs (they differ under
    autocast with fp32 activations; FSDP's bf16 ``param_dtype`` makes both bf16). Forward: counts,
    dispatch (rows with their fp32 weights; hierarchical: with K weights and K int32 expert ids), combine.
    Backward: the combine's gradients out, the rows' (and weights') gradients back. ``fp8``: the dispatch hops'
    hidden rows go as 1 byte an element with an fp32 scale per ``FP8_BLOCK`` columns (``dispatch_dtype``); the
    combine and every gradient stay in the training dtype. ``ep``: the group's size when its nodes hold unequal
    shares of it (flat dispatch; ``local`` is then the sending rank's share), else ``nodes * local``."""
    D, K = dim, top_k
    hidden = ((D, 1), (-(-D // FP8_BLOCK), 4)) if fp8 else ((D, x_size),)
    flat_row, flat_grad = packed_row_bytes(*hidden, (1, 4)), packed_row_bytes((D, x_size), (1, 4))
    hier_row, hier_grad = packed_row_bytes(*hidden, (K, 4), (K, 4)), packed_row_bytes((D, x_size), (K, 4))

    def two_way(n, row, grad, counts, y=D * y_size):
        return {"forward": n * (row + y) + counts * ranks, "backward": n * (y + grad)}

    ep = ep or nodes * local
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
                        "exchange's transient buffers and its time (default 1.5)")
    parser.add_argument("--collective-latency-us", type=float, default=COLLECTIVE_LATENCY_US, help="GPU idle per "
                        f"blocking count exchange of a MoE forward (default {COLLECTIVE_LATENCY_US:g}, assumed)")
    parser.add_argument("--host-sync-us", type=float, default=HOST_SYNC_US, help="GPU idle after each MoE forward's "
                        f"host read of the split sizes until the next kernels run (default {HOST_SYNC_US:g}, assumed)")


def bandwidths(gpu: str, ib_gbps: float | None, nvlink_gbps: float | None) -> tuple[float | None, float | None]:
    """(InfiniBand, NVLink) GB/s per GPU per direction: the flags, else ``BANDWIDTH_GBPS`` by GPU model."""
    for flag, given in (("--ib-gbps", ib_gbps), ("--nvlink-gbps", nvlink_gbps)):
        if given is not None and not given > 0:
            raise ValueError(f"{flag}={given:g} must be > 0 (GB/s per GPU per direction).")
    ib, nvlink = BANDWIDTH_GBPS.get(gpu, (None, None))
    return ib_gbps or ib, nvlink_gbps or nvlink


@dataclass(frozen=True)
class GroupShape:
    """One expert-parallel group as its dispatcher runs it: hierarchical over ``nodes`` x ``local`` ranks, or flat
    with ``local`` of its ``ep`` ranks on the node of its busiest sender (the one with the fewest peers there)."""

    hierarchical: bool
    nodes: int
    local: int
    ep: int

    def describe(self) -> str:
        if self.hierarchical:
            return f"hierarchical over {self.nodes} nodes x {self.local} GPUs"
        if self.local == self.ep:
            return f"flat within one node of {self.ep} GPUs"
        return (f"flat across nodes (unequal shares of the group per node: the busiest sender has {self.local} of "
                f"{self.ep} ranks on its node)")


def group_shapes(mesh: MeshLayout, gpus_per_node: int) -> dict[GroupShape, int]:
    """How many expert-parallel groups of each shape the mesh has, decided by the dispatcher's own
    ``expert_parallel.plan_layout``: rank g's group is the ``ep`` neighbouring shard ranks around it
    (``parallel/mesh.py``), its node ``g // gpus_per_node``."""
    table = []
    for rank in range(mesh.world_size):
        first = rank - rank % mesh.shard % mesh.ep
        table.append((rank // gpus_per_node, tuple(range(first, first + mesh.ep))))
    shapes: dict[GroupShape, int] = {}
    for ranks, layout in plan_layout(table).items():
        if isinstance(layout, str):
            share = {}
            for rank in ranks:
                share[rank // gpus_per_node] = share.get(rank // gpus_per_node, 0) + 1
            shape = GroupShape(False, len(share), min(share.values()), mesh.ep)
        else:
            shape = GroupShape(True, len(layout), len(layout[0]), mesh.ep)
        shapes[shape] = shapes.get(shape, 0) + 1
    return shapes


def shape_bytes(config: MoEConfig, shape: GroupShape, tokens: int, fp8: bool = False):
    """``exchange_bytes`` of one MoE layer for a sender of a group of ``shape`` under uniform routing."""
    local_experts = config.num_experts // shape.ep
    if shape.hierarchical:
        copies = uniform_copies(config, shape.nodes, shape.local, tokens)
        return exchange_bytes(config.dim, config.top_k, local_experts, shape.nodes, shape.local, 2, 2, copies, fp8=fp8)
    K, ep, local = config.top_k, shape.ep, shape.local
    copies = Copies(copies_inter=tokens * K * (ep - local) / ep, copies_intra=tokens * K * (local - 1) / ep,
                    rows_inter=0, fanout_intra=0)
    return exchange_bytes(config.dim, K, local_experts, 1, local, 2, 2, copies, fp8=fp8, ep=ep)


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


def traffic(config: MoEConfig, plan: dict, mesh: MeshLayout, ib_gbps: float | None = None,
            nvlink_gbps: float | None = None) -> dict | None:
    """Expert-exchange bytes per GPU per step of a ``plan`` result (every MoE layer, with and without recompute)
    and their time at the links' bandwidth, for the slowest of the mesh's group shapes (``group_shapes``); None
    without ``ep``.

    Time: a flat all-to-all sends to every peer at once, its NVLink and InfiniBand parts side by side (the
    larger); the hierarchical dispatcher's hops run one after the other (their sum). ``used``: the row of the
    dispatcher the runtime picks, with recompute."""
    c, w = plan["cluster"], plan["workload"]
    if mesh.ep == 1 or not config.n_moe_layers:
        return None
    tokens, fp8 = plan["tokens_per_gpu"], w["dispatch_dtype"] == "float8_e4m3fn"
    ib, nvlink = bandwidths(c["gpu"], ib_gbps, nvlink_gbps)
    shapes = group_shapes(mesh, c["gpus_per_node"])
    priced = {shape: _rows(config, shape, tokens, fp8, ib, nvlink) for shape in shapes}

    def cost(shape):
        used = priced[shape][_used(shape)]
        return (used["seconds"] or 0, used["inter_node_bytes"], used["intra_node_bytes"])
    slowest = max(priced, key=cost)
    return {"nodes": slowest.nodes, "ranks_per_node": slowest.local, "hierarchical": slowest.hierarchical,
            "layout": slowest.describe(), "used": _used(slowest), "tokens_per_gpu": tokens,
            "groups": [{"layout": shape.describe(), "count": n, "seconds": priced[shape][_used(shape)]["seconds"]}
                       for shape, n in shapes.items()],
            "nodes_per_token": expected_nodes_per_token(config, slowest.nodes) if slowest.hierarchical else None,
            "ib_gbps": ib, "nvlink_gbps": nvlink, "dispatch_dtype": w["dispatch_dtype"],
            "expert_seconds": expert_seconds(config, tokens, w["mfu"] * c["peak_tflops"] * 1e12),
            "rows": priced[slowest]}


def _used(shape: GroupShape) -> str:
    return "hierarchical + recompute" if shape.hierarchical else "flat + recompute"


def _rows(config: MoEConfig, shape: GroupShape, tokens: int, fp8: bool, ib: float | None, nvlink: float | None
          ) -> dict[str, dict]:
    rows = {}
    for kind, scopes in shape_bytes(config, shape, tokens, fp8).items():
        if kind == "hierarchical" and not shape.hierarchical:
            continue
        for recompute in (False, True):
            inter, intra = (config.n_routed_passes * (s["forward"] * (2 if recompute else 1) + s["backward"])
                            for s in (scopes["inter"], scopes["intra"]))
            times = (inter / (ib * 1e9), intra / (nvlink * 1e9)) if ib and nvlink else None
            seconds = None if times is None else (max(times) if kind == "flat" else sum(times))
            rows[f"{kind}{' + recompute' if recompute else ''}"] = {
                "inter_node_bytes": inter, "intra_node_bytes": intra, "seconds": seconds}
    return rows


def expert_seconds(config: MoEConfig, tokens: int, flops_per_s: float) -> float:
    """Routed-expert matmul time of one step (every MoE layer: forward, recompute and backward, ``8 · 3dFK``)."""
    return config.n_routed_passes * 8 * 3 * config.dim * config.expert_hidden * config.top_k * tokens / flops_per_s


def format_traffic(t: dict | None) -> list[str]:
    if t is None:
        return []
    bw = (f"at {t['ib_gbps']:g} GB/s InfiniBand and {t['nvlink_gbps']:g} GB/s NVLink per GPU (--ib-gbps, "
          f"--nvlink-gbps)" if t["ib_gbps"] and t["nvlink_gbps"]
          else "(no bandwidth known for this GPU: pass --ib-gbps, --nvlink-gbps)")
    where = (f"ep over {t['nodes']} node(s) x {t['ranks_per_node']} GPUs, {t['nodes_per_token']:.2f} nodes per token "
             "(uniform routing)" if t["hierarchical"] else t["layout"])
    lines = ["", f"expert exchange   {where}, {t['tokens_per_gpu']:,} tokens per GPU, "
             f"{'FP8 dispatch rows' if t['dispatch_dtype'] else 'bf16'}; per GPU per step {bw}"]
    if len(t["groups"]) > 1:
        lines.append(f"{'':<18}groups: " + "; ".join(f"{g['count']} {g['layout']}" for g in t["groups"])
                     + " (the dispatcher's plan_layout); priced: the slowest, below")
    lines.append(f"{'':<36}{'inter-node GB':>14}{'intra-node GB':>15}{'time s':>9}")
    for name, r in t["rows"].items():
        time = f"{r['seconds']:>9.3g}" if r["seconds"] is not None else f"{'?':>9}"
        lines.append(f"{name:<36}{r['inter_node_bytes'] / 1e9:>14.4g}{r['intra_node_bytes'] / 1e9:>15.4g}{time}")
    return lines
