"""Optimizer step as a fraction of the training step on one GPU: Muon (NS on the GPU) vs AdamW, and Muon
with parameters and optimizer state in host memory (as under FSDP CPU offload) with NS on the GPU vs on CPU.
The host-resident NS-on-GPU case is measured twice, side by side: ``muon_offload_ns_gpu`` (the staged schedule:
pinned reused buffers, copies on a side stream overlapping NS, one wait) and ``muon_offload_ns_gpu_serial`` (one
blocking pageable copy each way per matrix, ``Muon.stage_host_copies = False``).

    python benchmarks/muon_gpu_step.py                 # one H200: a 16B-class layer stack, bf16 params
    python benchmarks/muon_gpu_step.py --dry-run       # CPU, tiny shapes: checks the script runs

Prints one JSON line per case: median fwd+bwd ms, optimizer-step ms and step / (fwd+bwd+step).
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from moe_lightning.model import MoEConfig, MoETransformer  # noqa: E402
from moe_lightning.optim import Muon, param_groups  # noqa: E402

GPU_CONFIG = dict(vocab_size=32768, dim=2048, n_layers=6, n_heads=16, n_kv_heads=4, max_seq_len=4096,
                  ffn_hidden=10944, n_dense_layers=1, num_experts=64, top_k=6, expert_hidden=1408,
                  n_shared_experts=2, score_func="sigmoid")
DRY_CONFIG = dict(vocab_size=320, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64, ffn_hidden=128,
                  num_experts=4, top_k=2, expert_hidden=32)


def timed(fn, device: torch.device) -> float:
    """Wall milliseconds of ``fn`` with the device drained before and after."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - start)


def build(config: MoEConfig, device: torch.device, dtype: torch.dtype) -> MoETransformer:
    """Build on the meta device and materialise straight on ``device``: no full-size CPU init to wait for."""
    with torch.device("meta"):
        model = MoETransformer(config)
    model.to_empty(device=device).to(dtype)
    model.init_weights()
    return model


def run_case(name: str, config: MoEConfig, make_opt, args, device: torch.device, offloaded: bool,
             warmup: int, steps: int) -> dict:
    """Median fwd+bwd and optimizer-step times. ``offloaded``: parameters, gradients and optimizer state live in
    (pinned) host memory, as under FSDP CPU offload; each step copies parameters in and gradients out."""
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    compute = build(config, device, dtype)
    if offloaded:  # the optimizer's copy in host memory, copied from the compute copy (host-side init of 3B
        pin = device.type == "cuda"  # parameters with serial normal_ would take minutes)
        with torch.device("meta"):
            host = MoETransformer(config)
        for (name, p), p_dev in zip(list(host.named_parameters()), compute.parameters()):
            module_name, _, leaf = name.rpartition(".")
            data = torch.empty(p_dev.shape, dtype=dtype, pin_memory=pin).copy_(p_dev)
            host.get_submodule(module_name)._parameters[leaf] = torch.nn.Parameter(data)
            host.get_parameter(name).grad = torch.empty_like(data, pin_memory=pin)
        model = host
    else:
        model = compute
    opt = make_opt(param_groups(model, 0.1))
    tokens = torch.randint(0, config.vocab_size, (args.batch, args.seq + 1), device=device)

    def fwd_bwd():
        if offloaded:
            with torch.no_grad():
                for p_dev, p in zip(compute.parameters(), model.parameters()):
                    p_dev.copy_(p, non_blocking=True)
        logits = compute(tokens[:, :-1])
        F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten()).backward()
        if offloaded:
            for p_dev, p in zip(compute.parameters(), model.parameters()):
                p.grad.copy_(p_dev.grad, non_blocking=True)
                p_dev.grad = None

    fb, st = [], []
    for i in range(warmup + steps):
        t_fb = timed(fwd_bwd, device)
        t_st = timed(opt.step, device)
        if not offloaded:  # the offloaded case reuses its pinned gradient buffers
            opt.zero_grad(set_to_none=True)
        if i >= warmup:
            fb.append(t_fb)
            st.append(t_st)
    fb_ms, st_ms = statistics.median(fb), statistics.median(st)
    return {"case": name, "fwd_bwd_ms": round(fb_ms, 2), "step_ms": round(st_ms, 2),
            "step_fraction": round(st_ms / (fb_ms + st_ms), 4),
            "params_M": round(sum(p.numel() for p in model.parameters()) / 1e6, 1)}


def serial(opt: Muon) -> Muon:
    """The serial blocking host path, to compare the staged schedule against in the same run."""
    opt.stage_host_copies = False
    return opt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--cases",
                        default="adamw,muon,muon_offload_ns_gpu,muon_offload_ns_gpu_serial,muon_offload_ns_cpu")
    args = parser.parse_args()
    if args.dry_run:
        args.batch, args.seq, args.steps, args.warmup = 2, 32, 1, 1
        device = torch.device("cpu")
    elif not torch.cuda.is_available():
        raise SystemExit("muon_gpu_step.py needs a CUDA device; use --dry-run to check it on CPU.")
    else:
        device = torch.device("cuda")
    config = MoEConfig(**(DRY_CONFIG if args.dry_run else GPU_CONFIG))
    cpu = torch.device("cpu")
    cases = {
        "adamw": (lambda g: torch.optim.AdamW(g, lr=3e-4, betas=(0.9, 0.95), fused=device.type == "cuda"), device),
        "muon": (lambda g: Muon(g, lr=3e-4), device),
        "muon_offload_ns_gpu": (lambda g: Muon(g, lr=3e-4, ns_device=str(device)), cpu),
        "muon_offload_ns_gpu_serial": (lambda g: serial(Muon(g, lr=3e-4, ns_device=str(device))), cpu),
        "muon_offload_ns_cpu": (lambda g: Muon(g, lr=3e-4, ns_device="cpu"), cpu),
    }
    failed = []
    for name in args.cases.split(","):
        make_opt, param_device = cases[name]
        # Host-resident state: each step moves every matrix both ways (and NS on host cores takes minutes), so
        # fewer steps fit the time box: one (ns_cpu) or one warm-up and one timed (each ns_gpu variant).
        offload_steps = (0, 1) if name.endswith("ns_cpu") else (1, 1)
        warmup, steps = offload_steps if param_device != device else (args.warmup, args.steps)
        try:
            result = run_case(name, config, make_opt, args, device, param_device != device, warmup, steps)
        except Exception as error:  # report it and measure the other cases
            failed.append(name)
            result = {"case": name, "status": "failed", "error": f"{type(error).__name__}: {error}"[:800]}
        print(json.dumps(result), flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if failed:
        raise SystemExit(f"muon_gpu_step: failed cases: {', '.join(failed)}")

if __name__ == "__main__":
    main()
