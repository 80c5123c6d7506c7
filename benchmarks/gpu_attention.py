"""Document-masked attention on one GPU: FlexAttention (our CUDA path) against SDPA with the dense mask.

    python benchmarks/gpu_attention.py [--seq 8192] [--doc-len 1024]     # on a CUDA device
    python benchmarks/gpu_attention.py --dry-run                        # CPU, tiny, forward only

For a GQA shape and a DeepSeek-V3 MLA shape (query/key 192, value 128) it runs ``attend`` (FlexAttention
with the compiled block mask on CUDA) and plain SDPA given ``DocumentMask.dense``; prints the largest output
and gradient differences, forward+backward time and the peak memory of each. bf16 on CUDA (tolerance
3e-2: bf16 rounding of O(1) outputs), fp32 on CPU (1e-5).
"""

import argparse
import time

import torch
import torch.nn.functional as F

from moe_lightning.model.attention import DocumentMask, attend, document_ids, flex_attend

SHAPES = {"gqa": dict(heads=16, kv_heads=4, qk=128, v=128), "mla": dict(heads=16, kv_heads=16, qk=192, v=128)}


def run(fn, q, k, v, backward: bool):
    device = q.device
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    out = fn(q, k, v)
    grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out)) if backward else ()
    if device.type == "cuda":
        torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else float("nan")
    return out.detach(), grads, time.perf_counter() - start, peak


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--doc-len", type=int, default=1024, help="mean document length")
    parser.add_argument("--dry-run", action="store_true", help="CPU, sequence 96, forward only")
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.dry_run
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    seq, doc_len = (args.seq, args.doc_len) if not args.dry_run else (96, 20)
    tolerance = 3e-2 if cuda else 1e-5
    g = torch.Generator().manual_seed(0)
    tokens = (torch.rand(1, seq, generator=g) < 1 / doc_len).long()  # 1 = end of document
    mask = DocumentMask(document_ids(tokens, 1).to(device))
    report = {}
    for name, s in SHAPES.items():
        q = torch.randn(1, s["heads"], seq, s["qk"], generator=g).to(device, dtype).requires_grad_(cuda)
        k = torch.randn(1, s["kv_heads"], seq, s["qk"], generator=g).to(device, dtype).requires_grad_(cuda)
        v = torch.randn(1, s["kv_heads"], seq, s["v"], generator=g).to(device, dtype).requires_grad_(cuda)
        scale, gqa = s["qk"] ** -0.5, s["heads"] != s["kv_heads"]

        def ours(q, k, v):  # on CUDA the model's kernel choice; on CPU the same FlexAttention call, eager
            return attend(q, k, v, mask, scale) if cuda else flex_attend(q, k, v, mask, scale)

        def dense(q, k, v):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.dense(seq), scale=scale, enable_gqa=gqa)
        if cuda:
            run(ours, q, k, v, True)  # compile and warm up
        out, grads, seconds, peak = run(ours, q, k, v, cuda)
        ref_out, ref_grads, ref_seconds, ref_peak = run(dense, q, k, v, cuda)
        diff = max([(out - ref_out).abs().max().item()] + [(a - b).abs().max().item() for a, b in zip(grads, ref_grads)])
        report[name] = dict(max_diff=diff, flex_s=seconds, dense_s=ref_seconds, flex_mib=peak, dense_mib=ref_peak)
        print(f"{name}: seq {seq}, {int(tokens.sum()) + 1} documents, max diff {diff:.2e} "
              f"(tolerance {tolerance:.0e}); ours {seconds * 1e3:.1f} ms / {peak:.0f} MiB peak, "
              f"dense-mask SDPA {ref_seconds * 1e3:.1f} ms / {ref_peak:.0f} MiB", flush=True)
        assert diff < tolerance, f"{name}: FlexAttention differs from the dense-mask reference by {diff}"
    return report


if __name__ == "__main__":
    main()
