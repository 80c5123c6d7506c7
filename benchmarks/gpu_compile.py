"""Per-block ``torch.compile`` on one GPU against eager blocks: forward + backward tokens/s, and what compiling costs.

    python benchmarks/gpu_compile.py             # one CUDA device, the recipe's blocks (a dense one, a MoE one)
    python benchmarks/gpu_compile.py --dry-run   # CPU, toy size, dynamo's "eager" backend (traces, no codegen)

The model is ``gpu_shapes.COMPILE_CONFIG``: 2 of the recipe's blocks (the first dense, the second MoE, MLA,
document masking) at the recipe's 2 x 8,192 tokens, bf16 weights, without multi-token prediction. ``eager``
runs first (the FlexAttention kernel is compiled either way, as in training), then ``compiled``: the same blocks
through ``parallel.compile.compile_blocks`` as ``MoELanguageModel(compile=True)`` does. Each mode: one warm-up
step, then 3 timed steps (forward + backward of the cross-entropy), median and range; the compiled mode's warm-up
is its compile time (printed as "compile_s": the first step's time less a timed step's). One JSON line per mode;
a provisional figure line after ``eager`` (eager's tokens/s, FAIL: a cold Inductor compile may outlast the time
box), the figure line after ``compiled``: its speed-up over eager.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from gpu_device import Device  # noqa: E402
from gpu_shapes import BATCH_SIZE, COMPILE_CONFIG, DOC_LEN, DRY, SEQ_LEN, card_memory_gib, check_fits  # noqa: E402
from gpu_shapes import fixed_shape, packed_tokens  # noqa: E402
from moe_lightning.model import MoEConfig, MoETransformer  # noqa: E402
from moe_lightning.parallel.compile import compile_blocks  # noqa: E402

DRY_CONFIG = MoEConfig(**dict(DRY, n_layers=2, mtp_layers=0))
TARGET = 1.0  # compiled at least as fast as eager


def step(model: MoETransformer, tokens_BS: torch.Tensor, device: Device) -> float:
    """Seconds of one forward + backward, the device drained before and after."""
    device.synchronize()
    start = time.perf_counter()
    logits_BSV = model(tokens_BS[:, :-1])
    F.cross_entropy(logits_BSV.flatten(0, 1).float(), tokens_BS[:, 1:].flatten()).backward()
    device.synchronize()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def run_mode(model: MoETransformer, tokens_BS: torch.Tensor, device: Device, steps: int = 3) -> dict:
    first = step(model, tokens_BS, device)
    times = [step(model, tokens_BS, device) for _ in range(steps)]
    median = statistics.median(times)
    return {"first_step_s": round(first, 3), "step_s": round(median, 4), "min_s": round(min(times), 4),
            "max_s": round(max(times), 4), "tokens_per_s": round(tokens_BS[:, :-1].numel() / median, 1),
            "compile_s": round(max(first - median, 0.0), 2)}


def provisional_figure_line(eager: dict) -> str:
    """Printed before the compile (Inductor's cold compile may outlast the time box): eager's figure, no verdict."""
    return (f"figure: compile | eager {eager['tokens_per_s']:,.0f} tokens/s; compiled not measured (provisional: "
            f"the compile did not finish) | compiled >= eager | FAIL")


def figure_line(eager: dict, compiled: dict) -> str:
    speedup = eager["step_s"] / compiled["step_s"]
    return (f"figure: compile | compiled blocks {compiled['tokens_per_s']:,.0f} vs eager {eager['tokens_per_s']:,.0f} "
            f"tokens/s (x{speedup:.2f}), compile {compiled['compile_s']:.0f} s | compiled >= eager | "
            f"{'PASS' if speedup >= TARGET else 'FAIL'}")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="CPU, toy size, dynamo's eager backend")
    parser.add_argument("--gpu-memory", type=float, default=None, help="GiB to check the shape against")
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.dry_run
    if not cuda and not args.dry_run:
        parser.error("no CUDA device: run with --dry-run on CPU")
    device = Device(torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu"))
    if cuda:
        memory, source = card_memory_gib(args.gpu_memory)
        check_fits(fixed_shape("compile"), memory, source)
    config = COMPILE_CONFIG if cuda else DRY_CONFIG
    seq_len, batch, doc_len = (SEQ_LEN, BATCH_SIZE, DOC_LEN) if cuda else (64, 2, 16)
    torch.manual_seed(0)
    with torch.device(device.device):
        model = MoETransformer(config).to(torch.bfloat16)
    tokens_BS = packed_tokens(batch, seq_len, config.vocab_size, config.eod_token_id, doc_len).to(device.device)
    results = {"eager": run_mode(model, tokens_BS, device)}
    print(json.dumps({"mode": "eager", **results["eager"]}), flush=True)
    print(provisional_figure_line(results["eager"]), flush=True)  # gpu_all.sh keeps the last figure line
    compile_blocks(model.layers, backend="inductor" if cuda else "eager")
    results["compiled"] = run_mode(model, tokens_BS, device)
    print(json.dumps({"mode": "compiled", **results["compiled"]}), flush=True)
    print(figure_line(results["eager"], results["compiled"]), flush=True)
    return results


if __name__ == "__main__":
    main()
