"""``plan``'s step-time lines: compute beside the expert exchange as it runs (hops summed, then what the chunked
overlap leaves exposed), FSDP's parameter and gradient traffic over the same network, and the context-parallel
exchange.

Overlap model (``MoEFSDPStrategy(ep_overlap_chunks=C)``): a MoE layer's tokens go through in C chunks, software
pipelined, so while one chunk's experts run the next chunk's dispatch and the previous chunk's combine are in
flight. All but one chunk's exchange can hide, and only behind the other chunks' routed-expert compute:
``exposed = X - (C - 1) / C · min(X, E)``, with X the layer's exchange time (hops summed) and E its routed
experts' matmul time at the planned MFU (``8 · 3·d·F · K`` FLOPs a token with the recompute: forward twice,
backward twice the forward). C = 1 exposes all of X (the shared experts' overlap with the first dispatch is left
out: a few percent of it at the 1T shape). Every MoE layer has the same shape, so the step's totals obey it too.

FSDP traffic per GPU per step (bytes it sends; ring collectives send ``(n-1)/n`` of the gathered size): every unit
but the root is all-gathered in bf16 twice (forward, and again in backward after ``reshard_after_forward``), the
root once, and every unit's gradient reduce-scattered in fp32; a routed-expert unit holds ``1/ep`` of the experts
and is sharded over ``shard / ep`` ranks; HSDP replicas all-reduce the fp32 gradient shards (``2 (r-1)/r``). Over
InfiniBand when the group spans nodes. It runs on the same NICs as the expert exchange: their times add up on the
wire even where FSDP's prefetch hides them behind compute.
"""

from moe_lightning.parallel import MeshLayout
from moe_lightning.parallel.units import Unit
from moe_lightning.planner import context_parallel


def exposed(exchange_s: float, expert_s: float, chunks: int) -> float:
    return exchange_s - (chunks - 1) / chunks * min(exchange_s, expert_s)


def fsdp_bytes(units: list[Unit], mesh: MeshLayout) -> dict[str, float]:
    """Bytes one GPU sends per step in FSDP's collectives (see the module docstring)."""
    dense_ring, expert_ring = (mesh.shard - 1) / mesh.shard, (mesh.expert_shard - 1) / mesh.expert_shard
    gather = reduce = replicas = 0.0
    for unit in units:
        numel, ring = (unit.numel / mesh.ep, expert_ring) if unit.experts else (unit.numel, dense_ring)
        shards = mesh.expert_shard if unit.experts else mesh.shard
        gather += (1 if unit.stage is None else 2) * 2 * numel * ring
        reduce += 4 * numel * ring
        replicas += 2 * (mesh.replicate - 1) / mesh.replicate * 4 * numel / shards
    return {"all-gather (bf16)": gather, "reduce-scatter (fp32)": reduce, "replica all-reduce (fp32)": replicas}


def lines(result: dict) -> list[str]:
    c, w, t = result["cluster"], result["workload"], result.get("ep_traffic")
    ib, nvlink = result["bandwidths"]
    compute = result["tokens_per_gpu"] / result["tokens_per_s_per_gpu"]
    out = ["", f"step time per GPU at MFU {w['mfu']:.0%} of {c['peak_tflops']:g} TFLOP/s"
           + (f", {ib:g} GB/s InfiniBand, {nvlink:g} GB/s NVLink per GPU" if ib and nvlink else "")]
    out.append(f"  {'compute (at the planned MFU)':<58}{compute:>9.3g} s")
    if result["document_masking"] and not w["doc_len"]:
        out.append("    an upper bound: document_masking is on, but attention is counted causal over the whole "
                   "sequence; pass --doc-len N (the typical document length in tokens) to count the pairs in "
                   "documents")
    if isinstance(t, dict):
        kind = "hierarchical + recompute" if "hierarchical + recompute" in t["rows"] else "flat + recompute"
        ex = t["rows"][kind]["seconds"]
        if ex is not None:
            chunks = w["ep_overlap_chunks"]
            hidden_by = t["expert_seconds"]
            how = "hops summed" if kind.startswith("hier") else "NVLink and InfiniBand side by side"
            out.append(f"  {'expert exchange (' + kind + ', ' + how + ')':<58}{ex:>9.3g} s")
            out.append(f"  {f'  exposed with {chunks} overlap chunk' + ('s' if chunks > 1 else ''):<58}"
                       f"{exposed(ex, hidden_by, chunks):>9.3g} s   = X - (C-1)/C x min(X, E), C = {chunks}, "
                       f"E = {hidden_by:.3g} s of routed-expert compute (--ep-overlap-chunks)")
    fsdp = result["fsdp_bytes"]
    total = sum(fsdp.values())
    link, gbps = ("InfiniBand", ib) if c["shard_size"] > c["gpus_per_node"] or c["replicate_size"] > 1 \
        else ("NVLink", nvlink)
    time = f"{total / (gbps * 1e9):>9.3g} s" if gbps else f"{'?':>11}"
    out.append(f"  {'FSDP collectives (' + link + ')':<58}{time}   "
               + ", ".join(f"{k} {v / 1e9:,.4g} GB" for k, v in fsdp.items() if v))
    ex = result.get("cp_exchange")
    if ex is not None and ex["rows"]["+ recompute"]["seconds"] is not None:
        out.append(f"  {'context-parallel exchange (' + ex['link'] + ', + recompute)':<58}"
                   f"{ex['rows']['+ recompute']['seconds']:>9.3g} s")
    return out + context_parallel.format_lines(result)
