"""The optimizer step on one GPU as training runs it, and Newton–Schulz on host cores against the GPU at the 1T shard.

    python benchmarks/gpu_muon.py             # one CUDA device, ~1 minute
    python benchmarks/gpu_muon.py --dry-run   # CPU, toy sizes (configs/1t-mini.yaml's shard): the same code

Two measurements, each printed as it ends:
- ``ns_1t``: Newton–Schulz (5 quintic steps) of one GPU's share of the ~1T model's expert matrices
  (``configs/1t.yaml``: 384 GPUs per replica, expert parallel 96, each GPU holding one expert of each of the 55 MoE
  layers whole: 165 matrices of 2,048 x 7,168, listed by ``planner.plan.staged_muon_shapes``) on the GPU (bf16,
  batched by shape, median of 3 after a warm-up; also with each matrix copied in from pinned host memory and the
  result copied back, as a host-staged step does) and on ``--host-threads`` host cores (16 by default, in the dtype
  ``Muon`` picks there: bf16 with bf16 units, else fp32). The host runs matrices one at a time until
  ``--host-seconds`` (12) have passed (one input per shape drawn before the clock) and its time is scaled to all
  of them by their Newton–Schulz FLOPs (``newton_schulz_flops``); the line says how many it ran. Printed beside the reference run's 41.7 s on the host
  against 2.2 s on the GPU per optimizer step (GH200; its step also moves the matrices between host and GPU).
- ``step``: ``Muon`` (Newton–Schulz on the GPU) and fused ``AdamW`` stepping fp32 master weights and fp32
  gradients, as bf16-mixed training keeps them: 4 blocks of the recipe's model (``gpu_shapes.MUON_CONFIG``),
  gradients drawn at random (the step's cost does not depend on their values), median of 3 timed steps after a
  warm-up (which creates the state).
The figure line is printed after ``ns_1t``: the GPU's speed-up over the host cores.
"""

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from gpu_device import Device  # noqa: E402
from gpu_shapes import MUON_CONFIG, card_memory_gib, check_fits, fixed_shape  # noqa: E402
from moe_lightning.model import MoEConfig, MoETransformer  # noqa: E402
from moe_lightning.optim import Muon, param_groups  # noqa: E402
from moe_lightning.optim.newton_schulz import coefficient_schedule, newton_schulz, newton_schulz_flops  # noqa: E402
from moe_lightning.optim.newton_schulz import ns_dtype_for  # noqa: E402
from moe_lightning.planner import plan as planner  # noqa: E402
from moe_lightning.planner.run_config import read_config, read_run_config  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
REFERENCE_HOST_S, REFERENCE_GPU_S = 41.7, 2.2  # per optimizer step, the reference run (design.md)
QUINTIC5 = coefficient_schedule("quintic", 5)
DRY_CONFIG = MoEConfig(vocab_size=320, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64, ffn_hidden=128,
                       num_experts=4, top_k=2, expert_hidden=32)


def expert_shard_shapes(config_path: Path) -> list[tuple[int, ...]]:
    """The expert matrices one GPU orthogonalizes whole in the run ``config_path`` describes (its mesh from the
    config's nodes, devices and expert parallel size, as ``plan`` resolves it); read without jsonargparse."""
    fields = read_config(config_path)["model"]["init_args"]["config"]
    config = MoEConfig(**fields)
    run = read_run_config(str(config_path))
    world = run.get("nodes", 1) * run.get("gpus_per_node", 1)
    mesh = planner.resolve_layout(world, run.get("replicate_size", 1), run.get("shard_size") or "auto",
                                  run.get("expert_parallel_size", 1), 1, config, None)
    return [shape[1:] for shape in planner.staged_muon_shapes(config, mesh) if len(shape) == 3
            for _ in range(shape[0])]


def time_gpu_ns(shapes: list[tuple[int, ...]], device: Device, runs: int = 3) -> tuple[float, float]:
    """Median seconds of Newton–Schulz over all ``shapes`` on the device, batched by shape (bf16): the matrices
    already there, and with a round trip through pinned host memory (fp32 in, the result back into it), as a
    host-staged step moves them (the reference run's 2.2 s includes those copies)."""
    groups: dict[tuple, int] = {}
    for shape in shapes:
        groups[shape] = groups.get(shape, 0) + 1
    stacks = [torch.randn(n, *shape, device=device.device) for shape, n in groups.items()]
    hosts = [stack.cpu().pin_memory() if device.cuda else stack.clone() for stack in stacks]
    dtype = ns_dtype_for(device.device)

    def once(round_trip: bool) -> float:
        start, end = device.event(), device.event()
        start.record()
        for stack, host in zip(stacks, hosts):
            if round_trip:
                stack.copy_(host, non_blocking=True)
            result = newton_schulz(stack, QUINTIC5, dtype=dtype)
            if round_trip:
                host.copy_(result, non_blocking=True)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    once(round_trip=True)  # warm-up: cuBLAS handles and workspaces, the copy paths
    return tuple(statistics.median(once(round_trip) for _ in range(runs)) for round_trip in (False, True))


def time_host_ns(shapes: list[tuple[int, ...]], threads: int, seconds: float) -> tuple[float, int, torch.dtype]:
    """Host seconds for all ``shapes`` on ``threads`` cores, scaled from the matrices done within ``seconds`` (at
    least one) by their share of the Newton–Schulz FLOPs; also how many ran and in which dtype."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    dtype = ns_dtype_for(torch.device("cpu"))
    inputs = {shape: torch.randn(shape) for shape in dict.fromkeys(shapes)}  # drawn once, outside the clock
    try:
        newton_schulz(torch.randn(256, 256), QUINTIC5, dtype=dtype)  # warm-up: thread pool
        done, start = 0, time.perf_counter()
        while done < len(shapes) and (done == 0 or time.perf_counter() - start < seconds):
            newton_schulz(inputs[shapes[done]], QUINTIC5, dtype=dtype)
            done += 1
        elapsed = time.perf_counter() - start
    finally:
        torch.set_num_threads(previous)
    flops = [newton_schulz_flops(*shape, len(QUINTIC5)) for shape in shapes]
    return elapsed * sum(flops) / sum(flops[:done]), done, dtype


def ns_figure(gpu_s: float, round_trip_s: float, host_s: float, matrices: int) -> str:
    return (f"figure: muon | NS of one GPU's 1T expert shard ({matrices} matrices): host {host_s:.1f} s vs GPU "
            f"{gpu_s:.2f} s (x{host_s / gpu_s:.0f}), {round_trip_s:.2f} s with the pinned host round trip; reference "
            f"run 41.7 s vs 2.2 s (with copies) | GPU faster than host | "
            f"{'PASS' if gpu_s < host_s else 'FAIL'}")


def fp32_model(config: MoEConfig, device: torch.device) -> MoETransformer:
    """fp32 master weights with fp32 gradients drawn at random (O(1)), built on the meta device and materialised on
    ``device``."""
    with torch.device("meta"):
        model = MoETransformer(config)
    model.to_empty(device=device)
    model.init_weights()
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    return model


def time_step(model: MoETransformer, make_optimizer, device: Device, steps: int = 3) -> dict:
    """Median and range of ``steps`` optimizer steps after one warm-up step (which creates the state)."""
    optimizer = make_optimizer(param_groups(model, 0.1))
    optimizer.step()
    times = []
    for _ in range(steps):
        device.synchronize()
        start = time.perf_counter()
        optimizer.step()
        device.synchronize()
        times.append(1e3 * (time.perf_counter() - start))
    del optimizer
    return {"median_ms": round(statistics.median(times), 2), "min_ms": round(min(times), 2),
            "max_ms": round(max(times), 2)}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="CPU, toy sizes")
    parser.add_argument("--host-threads", type=int, default=16, help="host cores for the host Newton–Schulz")
    parser.add_argument("--host-seconds", type=float, default=12.0, help="host time spent before scaling")
    parser.add_argument("--gpu-memory", type=float, default=None, help="GiB to check the step's shape against")
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.dry_run
    if not cuda and not args.dry_run:
        parser.error("no CUDA device: run with --dry-run on CPU")
    if args.host_threads < 1 or not args.host_seconds > 0:
        parser.error(f"--host-threads={args.host_threads} must be >= 1 and --host-seconds={args.host_seconds:g} > 0")
    device = Device(torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu"))
    config = MUON_CONFIG if cuda else DRY_CONFIG
    if cuda:
        memory, source = card_memory_gib(args.gpu_memory)
        check_fits(fixed_shape("muon"), memory, source)
    shapes = expert_shard_shapes(REPO / "configs" / ("1t.yaml" if cuda else "1t-mini.yaml"))
    threads = min(args.host_threads, os.cpu_count() or 1) if cuda else 1  # a dry run on a shared CPU: one
    report = {}
    gpu_s, round_trip_s = time_gpu_ns(shapes, device)
    host_s, done, host_dtype = time_host_ns(shapes, threads, args.host_seconds if cuda else 0.01)
    report["ns_1t"] = {"matrices": len(shapes), "shape": list(shapes[0]), "device_s": round(gpu_s, 4),
                       "device_with_pinned_round_trip_s": round(round_trip_s, 4),
                       "host_s": round(host_s, 3), "host_threads": threads, "host_dtype": str(host_dtype),
                       "host_matrices_run": done, "reference_host_s": REFERENCE_HOST_S,
                       "reference_gpu_s": REFERENCE_GPU_S}
    print(json.dumps({"ns_1t": report["ns_1t"]}), flush=True)
    print(ns_figure(gpu_s, round_trip_s, host_s, len(shapes)), flush=True)
    model = fp32_model(config, device.device)
    muon = time_step(model, lambda groups: Muon(groups, lr=0.02, ns_device=str(device.device)), device)
    adamw = time_step(model, lambda groups: torch.optim.AdamW(groups, lr=3e-4, betas=(0.9, 0.95), fused=cuda),
                      device)
    report["step"] = {"parameters_B": round(sum(p.numel() for p in model.parameters()) / 1e9, 3),
                      "weights": "fp32 master weights, fp32 gradients", "muon": muon, "adamw": adamw,
                      "muon_over_adamw": round(muon["median_ms"] / adamw["median_ms"], 2)}
    print(json.dumps({"step": report["step"]}), flush=True)
    return report


if __name__ == "__main__":
    main()
