"""Optimizer step as a fraction of the training step on one GPU, with the optimizer's state in host memory as FSDP2's
``cpu_offload`` keeps it (fp32 parameters, fp32 gradients, fp32 momentum, pinned) and Newton–Schulz on the GPU:
``muon_offload_ns_gpu`` (the staged schedule: pinned ring of buffers, copies on their own streams overlapping NS,
one host wait) against ``muon_offload_ns_gpu_serial`` (one blocking pageable copy each way per matrix,
``Muon.stage_host_copies = False``), measured back to back on the same host copy of the model; then Muon and AdamW
with everything on the device. ``muon_offload_ns_cpu`` (NS on host cores, minutes at this size) runs only when
named in ``--cases``.

    python benchmarks/muon_gpu_step.py                 # one H200: a 3-block 16B-class stack (~1.3B parameters)
    python benchmarks/muon_gpu_step.py --dry-run       # CPU, tiny shapes: checks the script runs

Prints one JSON line per case (median fwd+bwd ms, optimizer-step ms, step / (fwd+bwd+step)) and, once both host
cases are measured, the part's figure: the staged step against the serial one. The cache is emptied only between
cases, never inside a timed window.
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

GPU_CONFIG = dict(vocab_size=32768, dim=2048, n_layers=3, n_heads=16, n_kv_heads=4, max_seq_len=4096,
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


def host_copy(compute: MoETransformer, config: MoEConfig, pin: bool) -> MoETransformer:
    """The optimizer's copy in host memory as FSDP2 ``cpu_offload`` keeps it: fp32 parameters and fp32 gradients
    (pinned on CUDA), copied from the compute copy (a host-side init of a billion parameters with serial
    ``normal_`` would take minutes)."""
    with torch.device("meta"):
        host = MoETransformer(config)
    for (name, p), p_dev in zip(list(host.named_parameters()), compute.parameters()):
        module_name, _, leaf = name.rpartition(".")
        data = torch.empty(p_dev.shape, dtype=torch.float32, pin_memory=pin).copy_(p_dev)
        host.get_submodule(module_name)._parameters[leaf] = torch.nn.Parameter(data)
        host.get_parameter(name).grad = torch.empty_like(data, pin_memory=pin)
    return host


def run_case(name: str, compute: MoETransformer, host: MoETransformer | None, make_opt, args,
             device: torch.device, warmup: int, steps: int) -> dict:
    """Median fwd+bwd and optimizer-step times. With ``host``: parameters, gradients and optimizer state live in
    host memory; each step copies parameters in and gradients out."""
    torch.manual_seed(0)
    model = host if host is not None else compute
    opt = make_opt(param_groups(model, 0.1))
    tokens = torch.randint(0, compute.config.vocab_size, (args.batch, args.seq + 1), device=device)

    def fwd_bwd():
        if host is not None:
            with torch.no_grad():
                for p_dev, p in zip(compute.parameters(), host.parameters()):
                    p_dev.copy_(p, non_blocking=True)
        logits = compute(tokens[:, :-1])
        F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten()).backward()
        if host is not None:
            for p_dev, p in zip(compute.parameters(), host.parameters()):
                p.grad.copy_(p_dev.grad, non_blocking=True)
                p_dev.grad = None

    fb, st = [], []
    for i in range(warmup + steps):
        t_fb = timed(fwd_bwd, device)
        t_st = timed(opt.step, device)
        if host is None:  # the host cases reuse their pinned gradient buffers
            opt.zero_grad(set_to_none=True)
        if i >= warmup:
            fb.append(t_fb)
            st.append(t_st)
    fb_ms, st_ms = statistics.median(fb), statistics.median(st)
    return {"case": name, "fwd_bwd_ms": round(fb_ms, 2), "step_ms": round(st_ms, 2),
            "step_fraction": round(st_ms / (fb_ms + st_ms), 4),
            "params_M": round(sum(p.numel() for p in model.parameters()) / 1e6, 1),
            "state_dtype": str(next(model.parameters()).dtype)}


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
    parser.add_argument("--cases", default="muon_offload_ns_gpu,muon_offload_ns_gpu_serial,muon,adamw",
                        help="comma-separated; also muon_offload_ns_cpu")
    args = parser.parse_args()
    if args.dry_run:
        args.batch, args.seq, args.steps, args.warmup = 2, 32, 1, 1
        device = torch.device("cpu")
    elif not torch.cuda.is_available():
        raise SystemExit("muon_gpu_step.py needs a CUDA device; use --dry-run to check it on CPU.")
    else:
        device = torch.device("cuda")
    config = MoEConfig(**(DRY_CONFIG if args.dry_run else GPU_CONFIG))
    cases = {
        "adamw": (lambda g: torch.optim.AdamW(g, lr=3e-4, betas=(0.9, 0.95), fused=device.type == "cuda"), False),
        "muon": (lambda g: Muon(g, lr=3e-4), False),
        "muon_offload_ns_gpu": (lambda g: Muon(g, lr=3e-4, ns_device=str(device)), True),
        "muon_offload_ns_gpu_serial": (lambda g: serial(Muon(g, lr=3e-4, ns_device=str(device))), True),
        "muon_offload_ns_cpu": (lambda g: Muon(g, lr=3e-4, ns_device="cpu"), True),
    }
    torch.manual_seed(0)
    compute = build(config, device, torch.bfloat16 if device.type == "cuda" else torch.float32)
    host = None
    failed, results = [], {}
    for name in args.cases.split(","):
        make_opt, on_host = cases[name]
        # host-resident state moves every matrix both ways each step (and NS on host cores takes minutes): one
        # warm-up and one timed step (ns_cpu: one step)
        warmup, steps = ((0, 1) if name.endswith("ns_cpu") else (1, 1)) if on_host else (args.warmup, args.steps)
        try:
            if on_host and host is None:
                host = host_copy(compute, config, pin=device.type == "cuda")
            result = run_case(name, compute, host if on_host else None, make_opt, args, device, warmup, steps)
            results[name] = result
        except Exception as error:  # report it and measure the other cases
            failed.append(name)
            result = {"case": name, "status": "failed", "error": f"{type(error).__name__}: {error}"[:800]}
        print(json.dumps(result), flush=True)
        if {"muon_offload_ns_gpu", "muon_offload_ns_gpu_serial"} <= results.keys() and name.startswith("muon_offload_ns_gpu"):
            staged, plain = results["muon_offload_ns_gpu"]["step_ms"], results["muon_offload_ns_gpu_serial"]["step_ms"]
            print(f"figure: muon | host-state Muon step, NS on GPU: staged {staged:.0f} ms vs serial {plain:.0f} ms "
                  f"(x{plain / staged:.2f}) | staged faster than serial | {'PASS' if staged < plain else 'FAIL'}",
                  flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()  # between cases: no timed window is open
    if failed:
        raise SystemExit(f"muon_gpu_step: failed cases: {', '.join(failed)}")


if __name__ == "__main__":
    main()
