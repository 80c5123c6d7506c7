"""What context parallelism (``MoEFSDPStrategy(context_parallel_size=N)``) costs and saves per GPU, for ``plan``.

Layout (``docs/context_parallel.md``): CP is folded into FSDP's shard dimension (the N ranks of a CP group also
shard parameters, so the parameter, gradient and optimizer rows do not change), a CP group is N neighbouring ranks
(one node's NVLink when N divides the GPUs per node), and each rank holds ``seq_len / N`` positions of every
sequence of its micro-batch (head-tail chunks). The sampler's replicas are ``world / N``: a micro-batch of b
sequences is shared by the N ranks of a group.

- Activations: everything per token (boundary activations, the block working set, the loss) scales with the
  local tokens ``b · S / N``; attention's key side covers every position of the sequence on every rank
  (``activations.key_side_bytes``: at the 1T shape MLA up-projects all keys locally).
- Attention FLOPs per rank: the causal (or in-document) pairs of the sequences over N (head-tail chunks balance
  causal pairs exactly; document borders break the balance, ``docs/context_parallel.md`` measures by how much).
  Per local token the FLOPs are those without CP plus, with MLA, the ``wkv_b`` up-projection of the other N - 1
  ranks' keys (``flops.cp_key_upprojection_flops_per_token``).
- Exchange: per layer, an all-gather of the key side in forward (again in a checkpointed block's recompute),
  ``(N-1)/N · b · S · width · 2`` bytes per GPU (bf16), and a reduce-scatter of its gradient in backward, summed in
  fp32 (``(N-1)/N · b · S · width · 4``; ``width``: MLA ``kv_lora_rank + qk_rope_head_dim``, GQA
  ``2 · n_kv_heads · head_dim``).
- A group wider than a node, or not dividing it, exchanges over InfiniBand: ``warnings`` says so.
"""

from moe_lightning.model import MoEConfig
from moe_lightning.planner.flops import attended_pairs, attention_flops_per_pair


def key_width(config: MoEConfig) -> int:
    """Values one position's key side has on the wire: MLA the latent and the shared rotary key, GQA K and V."""
    if config.attention == "mla":
        return config.kv_lora_rank + config.qk_rope_head_dim
    return 2 * config.n_kv_heads * config.head_dim


def exchange(config: MoEConfig, cp: int, micro_batch: int, seq_len: int, gpus_per_node: int,
             nvlink_gbps: float | None, ib_gbps: float | None, element_size: int = 2) -> dict | None:
    """CP bytes each GPU sends per step (every attention layer; without and with the recompute's all-gather) and
    their time at the link the group sits on; None without CP."""
    if cp == 1:
        return None
    layers = config.n_layers + config.mtp_layers
    per_pass = (cp - 1) * micro_batch * seq_len * key_width(config) * element_size // cp
    gradient = (cp - 1) * micro_batch * seq_len * key_width(config) * 4 // cp  # summed in fp32
    within_node = gpus_per_node % cp == 0
    gbps = nvlink_gbps if within_node else ib_gbps
    rows = {}
    for name, gathers in (("forward + backward", 1), ("+ recompute", 2)):
        sent = layers * (gathers * per_pass + gradient)
        rows[name] = {"bytes": sent, "seconds": sent / (gbps * 1e9) if gbps else None}
    return {"cp": cp, "layers": layers, "width": key_width(config), "bytes_per_layer_and_pass": per_pass,
            "gradient_bytes_per_layer": gradient, "link": "NVLink" if within_node else "InfiniBand", "gbps": gbps,
            "rows": rows}


def warnings(cp: int, gpus_per_node: int) -> list[str]:
    """A context-parallel group that spans nodes exchanges over InfiniBand every layer: say so, with the sizes
    that keep it within a node."""
    if cp == 1 or gpus_per_node % cp == 0:
        return []
    within = [n for n in range(1, gpus_per_node + 1) if gpus_per_node % n == 0]
    return [f"context_parallel_size={cp} puts groups across nodes of {gpus_per_node} GPUs: their key-side exchange "
            f"(every layer, forward, recompute and backward) runs over InfiniBand; a size dividing gpus_per_node "
            f"keeps it on NVLink: {within} (docs/context_parallel.md)"]


def attention_flops_per_rank(config: MoEConfig, cp: int, micro_batch: int, seq_len: int,
                             doc_len: int | None) -> float:
    """Score and value matmul FLOPs (forward + backward) one rank runs per step: its micro-batch's attended pairs
    over ``cp`` (head-tail balanced)."""
    return micro_batch * attended_pairs(seq_len, doc_len) * attention_flops_per_pair(config) / cp


def format_lines(result: dict) -> list[str]:
    """The context-parallel lines of ``plan``'s table (none at CP 1)."""
    w, cp = result["workload"], result["cluster"]["context_parallel_size"]
    ex = result.get("cp_exchange")
    if ex is None:
        return []
    flops = result["attention_flops_per_rank"]
    local = w["micro_batch"] * w["seq_len"] // cp
    lines = ["", f"context parallel  {cp} ranks share each sequence (head-tail chunks): {local:,} tokens per GPU of "
                 f"{w['micro_batch']} x {w['seq_len']:,}; attention {flops / 1e15:,.2f} PFLOP per GPU per step "
                 f"(the {'in-document' if w['doc_len'] else 'causal'} pairs / {cp})"]
    bw = f"at {ex['gbps']:g} GB/s {ex['link']} (--{'nvlink' if ex['link'] == 'NVLink' else 'ib'}-gbps)" \
        if ex["gbps"] else f"({ex['link']}: no bandwidth known, pass --nvlink-gbps / --ib-gbps)"
    lines.append(f"{'':<18}exchange of the key side ({ex['width']} values a token, bf16; gradients fp32) per GPU per "
                 f"step {bw}: {ex['bytes_per_layer_and_pass'] / 2**20:,.1f} MiB per layer and gather, "
                 f"{ex['gradient_bytes_per_layer'] / 2**20:,.1f} MiB per layer's gradient x {ex['layers']} layers")
    for name, r in ex["rows"].items():
        time = f"{r['seconds']:.3g} s" if r["seconds"] is not None else "?"
        lines.append(f"{'':<18}{name:<22}{r['bytes'] / 2**30:>9.2f} GiB {time:>10}")
    return lines
