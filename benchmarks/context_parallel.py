"""Context parallelism, counted (nothing here is timed): exchange bytes, balance under document masks, activation
bytes per rank.

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python benchmarks/context_parallel.py [--parts wire balance memory]
        [--tokens 16384] [--sizes 1 2 4] [--batches 64]

- wire: bytes each GPU sends per layer and per step at the ``configs/1t.yaml`` shape (bf16), exchanging MLA's
  latent + shared rotary key (C + R = 576 values a token) against the expanded per-head K and V every other
  context-parallel implementation sends (H x (N + R + V) = 40,960): ``S x width x 2 B x (N-1)/N`` per exchange;
  a step exchanges three times per layer (forward, the checkpointed block's recompute, the backward's
  reduce-scatter).
- balance: attended (query, key) pairs per rank, max / mean, for head-tail chunks on real packed batches of
  the standard-library corpus (``TextDataModule(source="stdlib", seq_len=8192)``, byte tokens, documents
  masked at the end-of-document token): per sequence and per batch (what a step waits for).
- memory: real gloo ranks at CP 1, 2, 4 run one forward of ``configs/tiny.yaml``'s width (GQA, and the same
  with MLA) at ``--tokens`` positions; saved-tensor hooks add up the distinct storages autograd keeps (parameters
  excluded). SDPA is replaced during the count by a function that keeps what GPU kernels keep (q, k, v, the
  output and an fp32 log-sum-exp; computed in query chunks so the CPU never holds ``S x T`` scores): on CPU
  the math kernel would also keep the probabilities. The bytes the exchange puts on the wire are counted too.
"""

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from moe_lightning.model import MoEConfig, MoETransformer  # noqa: E402
from moe_lightning.model.attention import document_ids  # noqa: E402
from moe_lightning.parallel.context_parallel import attended_pairs, head_tail_positions  # noqa: E402

TINY = dict(vocab_size=320, dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden=384, n_dense_layers=1,
            num_experts=8, top_k=2, expert_hidden=128, n_shared_experts=1)
TINY_MLA = dict(attention="mla", q_lora_rank=0, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16,
                v_head_dim=32)


def wire(sizes: list[int]) -> None:
    from moe_lightning.planner.run_config import load_model_config

    c = load_model_config(ROOT / "configs" / "1t.yaml")
    latent = c.kv_lora_rank + c.qk_rope_head_dim
    expanded = c.n_heads * (c.qk_nope_head_dim + c.qk_rope_head_dim + c.v_head_dim)
    print(f"wire: configs/1t.yaml, bf16, {c.n_layers} layers; values a token: latent + rotary key {latent}, "
          f"expanded K and V {expanded} ({expanded / latent:.1f}x)")
    print(f"{'seq':>7} {'N':>2} {'latent/layer/pass':>18} {'expanded/layer/pass':>20} {'latent/step':>12} "
          f"{'expanded/step':>14}")
    for S in (65536, 131072):
        for N in sizes:
            if N == 1:
                continue
            per_pass = [S * w * 2 * (N - 1) / N for w in (latent, expanded)]
            per_step = [b * 3 * c.n_layers for b in per_pass]
            print(f"{S:>7} {N:>2} {per_pass[0] / 2**20:>14.1f} MiB {per_pass[1] / 2**20:>16.1f} MiB "
                  f"{per_step[0] / 2**30:>8.2f} GiB {per_step[1] / 2**30:>10.1f} GiB", flush=True)


def balance(sizes: list[int], batches: int) -> None:
    from moe_lightning import TextDataModule

    data = TextDataModule(source="stdlib", seq_len=8192, batch_size=4)
    data.prepare_data()
    data.setup("fit")
    rows = []
    for i, batch in enumerate(data.train_dataloader()):
        if i == batches:
            break
        rows += list(document_ids(batch[:, :-1], 256))
    print(f"balance: {len(rows)} stdlib sequences of 8192 byte tokens ({len(rows) // 4} batches of 4), documents "
          f"masked; {sum(int(r[-1]) for r in rows) / len(rows):.2f} document borders per sequence")
    for N in sizes:
        if N == 1:
            continue
        pairs_QN = torch.tensor([[attended_pairs(doc, head_tail_positions(8192, N, r)) for r in range(N)]
                                 for doc in rows], dtype=torch.float64)
        per_seq = pairs_QN.amax(1) / pairs_QN.mean(1)
        per_batch_BN = pairs_QN.view(-1, 4, N).sum(1)
        per_batch = per_batch_BN.amax(1) / per_batch_BN.mean(1)
        print(f"  N={N}: max/mean per sequence: mean {per_seq.mean():.3f}, worst {per_seq.max():.3f}; "
              f"per batch: mean {per_batch.mean():.3f}, worst {per_batch.max():.3f}", flush=True)


class _KernelSaves(torch.autograd.Function):
    """SDPA that keeps what fused GPU kernels keep (q, k, v, output, fp32 log-sum-exp); counting only."""

    @staticmethod
    def forward(ctx, q, k, v, mask, is_causal, scale):
        B, H, S, _ = q.shape
        G, T = k.shape[1], k.shape[2]
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        out = q.new_empty(B, H, S, v.shape[-1])
        for start in range(0, S, 1024):
            rows = slice(start, min(start + 1024, S))
            q_c = q[:, :, rows].reshape(B, G, -1, q.shape[-1])  # H/G query heads per key head
            scores = (q_c @ k.transpose(-1, -2)).to(torch.promote_types(q.dtype, torch.float32))
            scores = scores.view(B, G, H // G, -1, T) * scale
            if mask is not None:
                scores = scores.masked_fill(~mask[:, :, None, rows], float("-inf"))
            elif is_causal:
                q_pos = torch.arange(T - S + rows.start, T - S + rows.stop)
                scores = scores.masked_fill(q_pos[:, None] < torch.arange(T), float("-inf"))
            probs = scores.softmax(-1).to(v.dtype).view(B, G, -1, T)
            out[:, :, rows] = (probs @ v).view(B, H, -1, v.shape[-1])
        ctx.save_for_backward(q, k, v, out, q.new_empty(B, H, S, dtype=torch.float32))
        return out

    @staticmethod
    def backward(ctx, grad_out):
        raise NotImplementedError("benchmarks/context_parallel.py counts saved bytes; it never runs backward")


def _kernel_sdpa(q, k, v, attn_mask=None, is_causal=False, scale=None, enable_gqa=False):
    return _KernelSaves.apply(q, k, v, attn_mask, is_causal, scale)


def memory_worker(tokens: int, attention: str) -> None:
    """One rank's saved bytes and wire bytes; prints one JSON line."""
    import torch.distributed as dist

    from moe_lightning.parallel.context_parallel import ContextParallelShard

    torch.set_num_threads(1)
    N = int(os.environ.get("WORLD_SIZE", "1"))
    torch.manual_seed(0)
    config = MoEConfig(**TINY, **(TINY_MLA if attention == "mla" else {}), max_seq_len=tokens)
    model = MoETransformer(config)
    sent = []
    if N > 1:
        dist.init_process_group("gloo")
        model.sequence_shard = ContextParallelShard(dist.group.WORLD)
        gather = dist.all_gather_into_tensor

        def counted(out, inp, *args, **kwargs):
            sent.append(inp.numel() * inp.element_size() * (N - 1))
            return gather(out, inp, *args, **kwargs)
        dist.all_gather_into_tensor = counted
    tokens_BS = torch.randint(0, 256, (1, tokens), generator=torch.Generator().manual_seed(1))
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    F_sdpa = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = _kernel_sdpa
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = model(tokens_BS, return_hidden=True)
    finally:
        F.scaled_dot_product_attention = F_sdpa
    del out
    print(json.dumps(dict(saved=sum(saved.values()), wire_per_layer=sent[0] if sent else 0,
                          exchanges=len(sent))), flush=True)
    if N > 1:
        dist.destroy_process_group()


def memory(sizes: list[int], tokens: int) -> None:
    from tests.support.distributed import run_ranks

    for attention in ("gqa", "mla"):
        c = MoEConfig(**TINY, **(TINY_MLA if attention == "mla" else {}))
        width = (c.kv_lora_rank + c.qk_rope_head_dim) if attention == "mla" else 2 * c.n_kv_heads * c.head_dim
        print(f"memory: {attention}, tiny width, {tokens} tokens, fp32; exchanged width {width} values a token")
        base = None
        for N in sizes:
            outputs = run_ranks(Path(__file__), N, "--worker", attention, "--tokens", str(tokens), timeout=3600)
            ranks = [json.loads(out.strip().splitlines()[-1]) for out in outputs]
            peak = max(r["saved"] for r in ranks)
            base = peak if N == 1 else base
            expected = tokens * width * 4 * (N - 1) // N
            ratio = f", {peak / base:.3f} of CP 1 (1/N = {1 / N:.3f})" if base else ""
            print(f"  CP {N}: saved activations per rank max {peak / 2**20:.1f} MiB{ratio}; wire per layer and "
                  f"pass {ranks[0]['wire_per_layer']} B (S x width x 4 B x (N-1)/N = {expected}), "
                  f"{ranks[0]['exchanges']} exchanges per forward", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", nargs="+", default=["wire", "balance", "memory"],
                        choices=["wire", "balance", "memory"])
    parser.add_argument("--sizes", nargs="+", type=int, default=[1, 2, 4])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--batches", type=int, default=64)
    parser.add_argument("--worker", choices=["gqa", "mla"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return memory_worker(args.tokens, args.worker)
    for part in args.parts:
        {"wire": lambda: wire(args.sizes), "balance": lambda: balance([2, 4, 8], args.batches),
         "memory": lambda: memory(args.sizes, args.tokens)}[part]()


if __name__ == "__main__":
    main()
