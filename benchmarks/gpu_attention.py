"""Document-masked attention on one GPU: FlexAttention with its max scores (the recipe's path) against SDPA with the
dense mask.

    python benchmarks/gpu_attention.py [--seq 8192] [--batch 2] [--doc-len 2048] [--runs 5]   # on a CUDA device
    python benchmarks/gpu_attention.py --dry-run                                               # CPU, tiny, forward only

For the recipe's MLA shape first (``gpu_shapes.RECIPE``: 16 heads, query/key 192, value 128; its 2 sequences of
8,192 tokens in ~2,048-token documents), then a GQA shape, it runs ``attend(..., return_max_logits=True)`` (on CUDA
the compiled FlexAttention kernel with ``AuxRequest(max_scores=True)``, as QK-clip makes the recipe call it) and
plain SDPA given the dense boolean mask; prints the largest output and gradient differences, and for each kernel
the median forward+backward time of ``--runs`` timed calls after two warm-up calls, and the peak memory. Queries,
keys and values are ``[B, S, H, D]`` tensors transposed to ``[B, H, S, D]``, as the model passes them (the compiled
kernel is specialised on strides: the recipe's, and gpu_paths', compile is reused). Each timed
call builds its own mask from the document ids (the BlockMask, or the dense ``[B, 1, S, S]`` mask), as every
training step does. Differences are relative to the reference's largest magnitude (gradients reach ~30 at 8k
tokens, where one bf16 step is 0.125): bf16 on CUDA (tolerance 2e-2: a few bf16 roundings, 2^-8 each, in two
kernels' different summation orders), fp32 on CPU (1e-5). The figure line (the MLA shape's FlexAttention time
against SDPA's) is printed as soon as the MLA shape is measured; every shape is measured and reported before any
failure is raised.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from gpu_shapes import BATCH_SIZE, DOC_LEN, RECIPE, SEQ_LEN  # noqa: E402
from moe_lightning.model.attention import DocumentMask, attend, dense_mask, document_ids  # noqa: E402

SHAPES = {"mla": dict(heads=RECIPE["n_heads"], kv_heads=RECIPE["n_heads"],
                      qk=RECIPE["qk_nope_head_dim"] + RECIPE["qk_rope_head_dim"], v=RECIPE["v_head_dim"]),
          "gqa": dict(heads=16, kv_heads=4, qk=128, v=128)}


def run(fn, q, k, v, backward: bool):
    """One call (mask building included): output, gradients, seconds, peak MiB (CUDA)."""
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


def relative_diff(got: torch.Tensor, reference: torch.Tensor) -> float:
    """Largest absolute difference over the reference's largest magnitude (fp32)."""
    return ((got.float() - reference.float()).abs().max() / reference.float().abs().max().clamp_min(1e-30)).item()


def timed(fn, q, k, v, backward: bool, warmup: int, runs: int):
    """Output and gradients of the last call; median seconds and largest peak over ``runs`` after ``warmup``."""
    for _ in range(warmup):
        run(fn, q, k, v, backward)
    results = [run(fn, q, k, v, backward) for _ in range(runs)]
    out, grads = results[-1][:2]
    return out, grads, statistics.median(r[2] for r in results), max(r[3] for r in results)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=SEQ_LEN)
    parser.add_argument("--batch", type=int, default=BATCH_SIZE)
    parser.add_argument("--doc-len", type=int, default=DOC_LEN, help="mean document length")
    parser.add_argument("--runs", type=int, default=5, help="timed calls per kernel (the median is reported)")
    parser.add_argument("--dry-run", action="store_true", help="CPU, sequence 96, forward only, 1 warm-up")
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.dry_run
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    seq, batch, doc_len = (args.seq, args.batch, args.doc_len) if not args.dry_run else (96, 2, 20)
    warmup, runs = (2, args.runs) if not args.dry_run else (1, args.runs)
    tolerance = 2e-2 if cuda else 1e-5
    g = torch.Generator().manual_seed(0)
    tokens = (torch.rand(batch, seq, generator=g) < 1 / doc_len).long()  # 1 = end of document
    doc_BS = document_ids(tokens, 1).to(device)
    report = {}
    for name, s in SHAPES.items():
        # [B, H, S, D] views of [B, S, H, D] tensors, the layout the model's projections hand the kernel
        q = torch.randn(batch, seq, s["heads"], s["qk"], generator=g).to(device, dtype).transpose(1, 2)
        k = torch.randn(batch, seq, s["kv_heads"], s["qk"], generator=g).to(device, dtype).transpose(1, 2)
        v = torch.randn(batch, seq, s["kv_heads"], s["v"], generator=g).to(device, dtype).transpose(1, 2)
        q, k, v = (t.requires_grad_(cuda) for t in (q, k, v))
        scale, gqa = s["qk"] ** -0.5, s["heads"] != s["kv_heads"]

        def ours(q, k, v):  # the path QK-clip makes the recipe take: FlexAttention + max scores (CPU: eager)
            mask = DocumentMask(doc_BS, flex=True)
            return attend(q, k, v, mask, scale, return_max_logits=True)[0]

        def dense(q, k, v):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=dense_mask(doc_BS, seq), scale=scale,
                                                  enable_gqa=gqa)
        out, grads, seconds, peak = timed(ours, q, k, v, cuda, warmup, runs)
        ref_out, ref_grads, ref_seconds, ref_peak = timed(dense, q, k, v, cuda, warmup, runs)
        diff = max(relative_diff(a, b) for a, b in zip((out, *grads), (ref_out, *ref_grads)))
        report[name] = dict(max_rel_diff=diff, flex_s=seconds, dense_s=ref_seconds, flex_mib=peak, dense_mib=ref_peak)
        print(f"{name}: batch {batch} x seq {seq}, {int(tokens.sum()) + batch} documents, max relative diff {diff:.2e} "
              f"(tolerance {tolerance:.0e}); median of {runs} (mask built in each): ours (with max scores) "
              f"{seconds * 1e3:.1f} ms / {peak:.0f} MiB peak, dense-mask SDPA {ref_seconds * 1e3:.1f} ms / "
              f"{ref_peak:.0f} MiB", flush=True)
        if name == "mla":
            print(figure_line(report["mla"], batch, seq, tolerance), flush=True)
    failed = {name: r["max_rel_diff"] for name, r in report.items() if not r["max_rel_diff"] < tolerance}
    assert not failed, f"FlexAttention differs from the dense-mask reference by (relative) {failed}"
    return report


def figure_line(mla: dict, batch: int, seq: int, tolerance: float) -> str:
    ok = mla["max_rel_diff"] < tolerance and mla["flex_s"] < mla["dense_s"]
    return (f"figure: attention | MLA {batch} x {seq}: FlexAttention + max scores {mla['flex_s'] * 1e3:.1f} ms vs "
            f"dense-mask SDPA {mla['dense_s'] * 1e3:.1f} ms, diff {mla['max_rel_diff']:.1e} | faster than SDPA, "
            f"diff < {tolerance:.0e} | {'PASS' if ok else 'FAIL'}")


if __name__ == "__main__":
    main()
