"""``plan``'s step time: one figure per GPU and step, built from its parts, and tokens/s derived from it.

``step = compute + exposed expert exchange + synchronisations + exposed FSDP collectives + CP exchange``

- **Compute**: the step's FLOPs at the planned MFU (model FLOPs per token, plus under context parallelism the key
  up-projection every rank repeats for the gathered keys: ``flops.cp_key_upprojection_flops_per_token``).
- **Expert exchange** (``MoEFSDPStrategy(ep_overlap_chunks=C)``): X is the exchange of the busiest rank, the mean
  rank's time under uniform routing (hops summed; ``ep_traffic``) times ``f = --ep-imbalance``: an all-to-all ends
  when its busiest receiver has its rows. A MoE layer's tokens go through in C chunks, software pipelined, so all
  but one chunk's exchange can hide, and only behind the other chunks' routed-expert compute:
  ``exposed = X - (C - 1) / C · min(X, E)``, E the routed experts' matmul time at the planned MFU
  (``8 · 3·d·F · K`` FLOPs a token with the recompute: forward twice, backward twice the forward). C = 1 exposes all
  of X (the shared experts' overlap with the first dispatch is left out). The busiest rank's extra expert matmuls
  (``(f - 1) · E``) are not added: the planned MFU is the step's average.
- **Synchronisations**: each MoE forward and its recompute exchange the per-expert counts in a blocking all-to-all
  (hierarchical dispatch: two, over the nodes then within the node) and read the split sizes back to the host
  (one ``.tolist()``). The GPU idles for each count exchange's latency (``--collective-latency-us``) and, after the
  host read, until the CPU has launched the next kernels (``--host-sync-us``). Assumed latencies, not measured.
- **FSDP collectives**: their traffic T per step (``fsdp_bytes``) at the link the shard group spans. With explicit
  prefetch (``prefetch_depth >= 1``) the all-gathers and reduce-scatters run behind compute, except the largest
  stage's all-gather and reduce-scatter at the edges of the step (nothing to compute before the first gather or
  after the last reduce), and only while their link is free: over InfiniBand the hidden part of the expert exchange
  holds the same NICs. ``exposed = edge + max(0, T - edge - window)``, ``window = compute - hidden exchange`` on
  InfiniBand (``compute`` on NVLink). With ``prefetch_depth 0`` the all-gathers are exposed whole (each MoE
  layer's host read stops the CPU from issuing the next unit's all-gather early); the reduce-scatters still hide.
- **Context-parallel exchange**: exposed whole (attention waits for its all-gather, the block's backward for the
  reduce-scatter of the key side's gradient), in forward, recompute and backward.

FSDP traffic per GPU per step (bytes it sends; ring collectives send ``(n-1)/n`` of the gathered size): every unit
but the root is all-gathered in bf16 twice (forward, and again in backward after ``reshard_after_forward``), the
root once, and every unit's gradient reduce-scattered in fp32; a routed-expert unit holds ``1/ep`` of the experts
and is sharded over ``shard / ep`` ranks; HSDP replicas all-reduce the fp32 gradient shards (``2 (r-1)/r``). Over
InfiniBand when the group spans nodes.
"""

from moe_lightning.model import MoEConfig
from moe_lightning.parallel import MeshLayout
from moe_lightning.parallel.units import Unit
from moe_lightning.planner import context_parallel

COLLECTIVE_LATENCY_US = 50.0  # a blocking all-to-all of a few KB of counts (assumed)
HOST_SYNC_US = 100.0  # GPU idle after a host read-back until the next kernels are launched (assumed)


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


def fsdp_link(cluster: dict, ib: float | None, nvlink: float | None) -> tuple[str, float | None]:
    """The link FSDP's collectives run on: InfiniBand when the shard group spans nodes or there are replicas."""
    if cluster["shard_size"] > cluster["gpus_per_node"] or cluster["replicate_size"] > 1:
        return "InfiniBand", ib
    return "NVLink", nvlink


def step_time(config: MoEConfig, result: dict) -> dict:
    """The step's parts in seconds (a part without a known link speed is left out and named in ``not_priced``),
    their sum, and what each part was built from."""
    c, w, t = result["cluster"], result["workload"], result.get("ep_traffic")
    ib, nvlink = result["bandwidths"]
    compute = result["tokens_per_gpu"] * result["flops_per_token"] / (w["mfu"] * c["peak_tflops"] * 1e12)
    parts, detail, not_priced = {"compute": compute}, {}, []
    hidden_exchange = 0.0
    if t is not None:
        mean = t["rows"][t["used"]]["seconds"]
        passes = 2 * config.n_routed_passes  # forward and its recompute
        collectives = 2 if t["hierarchical"] else 1
        syncs = passes * (collectives * c["collective_latency_us"] + c["host_sync_us"]) * 1e-6
        parts["count exchanges and host reads"] = syncs
        detail["syncs"] = {"passes": passes, "count_exchanges_per_pass": collectives, "host_reads_per_pass": 1}
        if mean is None:
            not_priced.append("expert exchange")
        else:
            busiest = mean * w["ep_imbalance"]
            parts["expert exchange (exposed)"] = exposed(busiest, t["expert_seconds"], w["ep_overlap_chunks"])
            hidden_exchange = busiest - parts["expert exchange (exposed)"]
            detail["expert_exchange"] = {"mean_rank": mean, "busiest_rank": busiest, "hidden": hidden_exchange}
    fsdp = result["fsdp_bytes"]
    link, gbps = fsdp_link(c, ib, nvlink)
    if gbps:
        total = sum(fsdp.values()) / (gbps * 1e9)
        gathers = fsdp["all-gather (bf16)"] / (gbps * 1e9)
        window = max(0.0, compute - (hidden_exchange if link == "InfiniBand" else 0.0))
        # exposed whole: with prefetch the edges of the step, without it every all-gather
        unhidden = min(result["fsdp_edge_bytes"] / (gbps * 1e9) if w["prefetch_depth"] >= 1 else gathers, total)
        parts["FSDP collectives (exposed)"] = unhidden + max(0.0, total - unhidden - window)
        detail["fsdp"] = {"link": link, "seconds": total, "unhidden": unhidden, "window": window}
    else:
        not_priced.append("FSDP collectives")
    ex = result.get("cp_exchange")
    if ex is not None:
        seconds = ex["rows"]["+ recompute"]["seconds"]
        if seconds is None:
            not_priced.append("context-parallel exchange")
        else:
            parts["context-parallel exchange"] = seconds
    return {"parts": parts, "seconds": sum(parts.values()), "not_priced": not_priced, "detail": detail}


def lines(result: dict) -> list[str]:
    c, w, t, step = result["cluster"], result["workload"], result.get("ep_traffic"), result["step_time"]
    ib, nvlink = result["bandwidths"]
    parts, detail = step["parts"], step["detail"]
    out = ["", f"step time per GPU at MFU {w['mfu']:.0%} of {c['peak_tflops']:g} TFLOP/s"
           + (f", {ib:g} GB/s InfiniBand, {nvlink:g} GB/s NVLink per GPU" if ib and nvlink else "")
           + " (planner/exchange_time.py states the overlap model)"]
    out.append(f"  {'compute (at the planned MFU)':<58}{parts['compute']:>9.3g} s")
    if result["document_masking"] and not w["doc_len"]:
        out.append("    an upper bound: document_masking is on, but attention is counted causal over the whole "
                   "sequence; pass --doc-len N (the typical document length in tokens) to count the pairs in "
                   "documents")
    if "expert_exchange" in detail:
        ex, chunks = detail["expert_exchange"], w["ep_overlap_chunks"]
        how = "hops summed" if t["hierarchical"] else "NVLink and InfiniBand side by side"
        out.append(f"  {'expert exchange (' + t['used'] + ', ' + how + ')':<58}{ex['mean_rank']:>9.3g} s   mean rank, "
                   "uniform routing")
        out.append(f"  {'  busiest rank':<58}{ex['busiest_rank']:>9.3g} s   x {w['ep_imbalance']:g} (--ep-imbalance)")
        out.append(f"  {f'  exposed with {chunks} overlap chunk' + ('s' if chunks > 1 else ''):<58}"
                   f"{parts['expert exchange (exposed)']:>9.3g} s   = X - (C-1)/C x min(X, E), C = {chunks}, "
                   f"E = {t['expert_seconds']:.3g} s of routed-expert compute (--ep-overlap-chunks)")
    if "syncs" in detail:
        s = detail["syncs"]
        out.append(f"  {'count exchanges and host reads':<58}{parts['count exchanges and host reads']:>9.3g} s   "
                   f"{s['passes']} MoE passes x ({s['count_exchanges_per_pass']} x {c['collective_latency_us']:g} us + "
                   f"{c['host_sync_us']:g} us) (--collective-latency-us, --host-sync-us)")
    fsdp = result["fsdp_bytes"]
    link = fsdp_link(c, ib, nvlink)[0]
    traffic = ", ".join(f"{k} {v / 1e9:,.4g} GB" for k, v in fsdp.items() if v)
    if "fsdp" in detail:
        out.append(f"  {'FSDP collectives (' + link + ')':<58}{detail['fsdp']['seconds']:>9.3g} s   {traffic}")
        f, depth = detail["fsdp"], w["prefetch_depth"]
        unhidden = "the step's edges" if depth >= 1 else "every all-gather"
        out.append(f"  {f'  exposed (prefetch_depth {depth})':<58}{parts['FSDP collectives (exposed)']:>9.3g} s   "
                   f"{unhidden} {f['unhidden']:.3g} s + what does not fit in the {f['window']:.3g} s of compute "
                   "its link has free")
    else:
        out.append(f"  {'FSDP collectives (' + link + ')':<58}{'?':>11}   {traffic}")
    if "context-parallel exchange" in parts:
        ex = result["cp_exchange"]
        out.append(f"  {'context-parallel exchange (' + ex['link'] + ', + recompute)':<58}"
                   f"{parts['context-parallel exchange']:>9.3g} s")
    out.append(f"  {'step':<58}{step['seconds']:>9.3g} s   -> {result['tokens_per_s_per_gpu']:,.0f} tokens/s per GPU"
               + (f" (not priced, no link speed: {', '.join(step['not_priced'])})" if step["not_priced"] else ""))
    return out + context_parallel.format_lines(result)
