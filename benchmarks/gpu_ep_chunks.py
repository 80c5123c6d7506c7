"""What the expert exchange's chunked pipeline costs on one GPU: one MoE layer, unchunked vs chunked, with FP8 dispatch.

    python benchmarks/gpu_ep_chunks.py             # one GPU, a one-rank NCCL group, ~15 s
    python benchmarks/gpu_ep_chunks.py --dry-run   # CPU, a one-rank gloo group, tiny shapes (a test runs it)

One rank holds every expert, so the all-to-alls are copies on the device and nothing is there to hide: the time
difference between ``ep_overlap_chunks`` = N and 1 is what chunking itself costs (smaller grouped GEMMs, more
launches, the per-chunk counts and sorts), the price a multi-node run pays for overlapping its exchange. Modes:
``chunks1`` (the baseline), ``chunks2``, ``chunks4``, ``chunks4_fp8`` (FP8 dispatch: its quantization and
dequantization kernels). Each is forward + backward of the dispatcher through the layer (router, shared expert,
experts), timed with CUDA events around each step after a warm-up; the median of the timed steps. One JSON line per
mode as it ends (median ms, tokens/s, the largest difference of the output from ``chunks1`` relative to its largest
entry, host reads per forward); the figure line (4 chunks against 1, target at most 1.10x) as soon as
``chunks4`` is measured, and again with FP8 dispatch's ratio.
"""

import argparse
import json
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist

from moe_lightning.model import MoEConfig
from moe_lightning.model.moe import MoELayer
from moe_lightning.parallel.expert_parallel import apply_expert_parallel

# A DeepSeek-V3-like MoE layer scaled to one GPU: 7168 -> 2048 wide, 32 experts top-8, 1 shared
GPU_CONFIG = MoEConfig(dim=2048, num_experts=32, top_k=8, expert_hidden=512, n_shared_experts=1)
DRY_CONFIG = MoEConfig(dim=32, num_experts=4, top_k=2, expert_hidden=16, n_shared_experts=1)
MODES = {"chunks1": (1, None), "chunks2": (2, None), "chunks4": (4, None), "chunks4_fp8": (4, torch.float8_e4m3fn)}
TARGET = 1.10


def one_rank_group(backend: str) -> None:
    store = tempfile.NamedTemporaryFile(prefix="gpu_ep_chunks_", delete=False).name
    os.unlink(store)
    dist.init_process_group(backend, init_method=f"file://{store}", rank=0, world_size=1)


def time_mode(moe: MoELayer, x_BSD: torch.Tensor, g_BSD: torch.Tensor, warmup: int, steps: int) -> dict:
    """Median ms of forward + backward (CUDA events on a GPU, the wall clock on CPU) and this mode's output."""
    cuda = x_BSD.device.type == "cuda"
    reads, tolist = [], torch.Tensor.tolist
    times = []
    for step in range(warmup + steps):
        x = x_BSD.detach().requires_grad_()
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        else:
            t0 = time.perf_counter()
        torch.Tensor.tolist = lambda t: reads.append(1) or tolist(t)
        try:
            y = moe(x)
        finally:
            torch.Tensor.tolist = tolist
        (y * g_BSD).sum().backward()
        if cuda:
            end.record()
            end.synchronize()
            ms = start.elapsed_time(end)
        else:
            ms = (time.perf_counter() - t0) * 1e3
        if step >= warmup:
            times.append(ms)
        moe.zero_grad(set_to_none=True)
    return {"median_ms": statistics.median(times), "times_ms": times,
            "tokens_per_s": x_BSD.shape[0] * x_BSD.shape[1] / statistics.median(times) * 1e3,
            "host_reads_per_forward": len(reads) / (warmup + steps)}, y.detach()


def figure_line(results: dict) -> str:
    ratio = results["chunks4"]["median_ms"] / results["chunks1"]["median_ms"]
    fp8 = results.get("chunks4_fp8")
    extra = f", FP8 dispatch x{fp8['median_ms'] / results['chunks1']['median_ms']:.3f}" if fp8 else ""
    return (f"figure: ep_chunks | one MoE layer fwd+bwd, 4 chunks vs 1: x{ratio:.3f} "
            f"({results['chunks1']['median_ms']:.2f} ms unchunked){extra} | <= {TARGET:.2f}x | "
            f"{'PASS' if ratio <= TARGET else 'FAIL'}")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="CPU, gloo, tiny shapes, one timed step")
    parser.add_argument("--tokens", type=int, default=None, help="tokens per step (default 16384; dry run 64)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args(argv)
    if args.dry_run:
        device, config, dtype, backend = torch.device("cpu"), DRY_CONFIG, torch.float32, "gloo"
        tokens, warmup, steps = args.tokens or 64, 1, 1
    else:
        if not torch.cuda.is_available():
            parser.error("no CUDA device: run on a GPU, or pass --dry-run to check the script on CPU.")
        # with an index: set_device (and NCCL's device_id) refuse a bare "cuda"
        device = torch.device("cuda", torch.cuda.current_device())
        config, dtype, backend = GPU_CONFIG, torch.bfloat16, "nccl"
        tokens, warmup, steps = args.tokens or 16384, args.warmup, args.steps
        torch.cuda.set_device(device)
    one_rank_group(backend)
    try:
        gen = torch.Generator().manual_seed(0)
        x_BSD = torch.randn(1, tokens, config.dim, generator=gen).to(device, dtype)
        g_BSD = torch.randn(1, tokens, config.dim, generator=gen).to(device, dtype)
        results, reference = {}, None
        for mode, (chunks, dispatch_dtype) in MODES.items():
            torch.manual_seed(0)
            with torch.device(device):
                moe = MoELayer(config)
                moe.init_weights(std=config.dim ** -0.5, out_std=config.expert_hidden ** -0.5)  # O(1) outputs
            moe.to(dtype)
            how = apply_expert_parallel([moe], dist.group.WORLD, overlap_chunks=chunks, dispatch_dtype=dispatch_dtype)
            row, y = time_mode(moe, x_BSD, g_BSD, warmup, steps)
            reference = y if reference is None else reference
            row["relative_difference_vs_chunks1"] = ((y.float() - reference.float()).abs().max()
                                                     / reference.float().abs().max()).item()
            results[mode] = row
            print(json.dumps({"mode": mode, "dispatcher": how, "tokens": tokens, "dim": config.dim,
                              "experts": config.num_experts, "top_k": config.top_k, **row}), flush=True)
            if mode in ("chunks4", "chunks4_fp8"):  # the figure once it has its ratio, again with FP8's
                print(figure_line(results), flush=True)
    finally:
        dist.destroy_process_group()
    return results


if __name__ == "__main__":
    main()
