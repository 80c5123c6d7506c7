"""Activation offload on one GPU, judged against activation checkpointing: peak memory and tokens/s.

    python benchmarks/gpu_offload.py             # one H200: a small MoE at 65,536 tokens, ~1 minute
    python benchmarks/gpu_offload.py --dry-run   # CPU, tiny shapes: the same code end to end (a test runs it)

Modes, in order of value: ``checkpoint`` (every block recomputed, its input kept on the device: the baseline,
since offload is checkpointing plus the copies), ``prefetch1``/``prefetch2``/``prefetch0`` (ActivationOffload,
default blocks: all but the last), then ``off`` (plain autograd, for information: recomputation cannot reach it by
construction). Each step is forward + backward (no optimizer state, which offload does not touch). The cache is
never emptied between the warm-up and the timed steps (that would time the allocator growing again); the peak
statistics are reset there. One JSON line per mode as it ends; the figure line as soon as ``checkpoint`` and
``prefetch1`` are measured. Targets, prefetch 1 against checkpoint: tokens/s >= 0.95x, and peak memory lower by at
least half the bytes offloaded per step.
"""

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from gpu_shapes import OFFLOAD_CONFIG as GPU_CONFIG, card_memory_gib, check_fits, fixed_shape  # noqa: E402
from moe_lightning.training.callbacks import ActivationOffload  # noqa: E402
from moe_lightning.model import MoEConfig, MoETransformer  # noqa: E402

DRY_CONFIG = MoEConfig(vocab_size=64, dim=32, n_layers=4, n_heads=4, n_kv_heads=2, max_seq_len=32, ffn_hidden=64,
                       n_dense_layers=1, num_experts=4, top_k=2, expert_hidden=32, n_shared_experts=1)
MODES: dict[str, dict | None] = {"checkpoint": {"blocks": []}, "prefetch1": {"prefetch": 1},
                                 "prefetch2": {"prefetch": 2}, "prefetch0": {"prefetch": 0}, "off": None}
GIB = float(1 << 30)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_mode(model: MoETransformer, tokens_BS: torch.Tensor, offload_kwargs: dict | None, warmup: int, steps: int,
             min_offload_bytes: int = 1 << 20) -> dict:
    """Train-step timing and memory for one mode; the model is left unwrapped afterwards."""
    device = tokens_BS.device
    offload = None
    if offload_kwargs is not None:
        offload = ActivationOffload(min_offload_bytes=min_offload_bytes, **offload_kwargs)
        offload.apply(model.layers)
    try:
        for step in range(warmup + steps):
            if step == warmup:
                synchronize(device)
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
                start = time.perf_counter()
            if offload is not None:
                offload.reset_counters()
            logits_BSV = model(tokens_BS[:, :-1])
            loss = F.cross_entropy(logits_BSV.flatten(0, 1).float(), tokens_BS[:, 1:].flatten())
            del logits_BSV
            loss.backward()
            model.zero_grad(set_to_none=True)
        synchronize(device)
        seconds = time.perf_counter() - start
    finally:
        if offload is not None:
            offload.remove()
    return {"tokens_per_s": tokens_BS[:, :-1].numel() * steps / seconds,
            "peak_gib": torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else None,
            "loss": loss.item(),
            "bytes_offloaded_per_step": offload.bytes_offloaded if offload else 0,
            "tensors_out_per_step": offload.tensors_offloaded if offload else 0,
            "tensors_in_per_step": offload.tensors_copied_in if offload else 0,
            "copy_order": [f"{kind} {i}" for kind, i in offload.order] if offload else []}


def summarize(results: dict[str, dict]) -> dict:
    """Ratios of each offload mode to ``checkpoint`` (the baseline) and to ``off``, and whether the targets hold."""
    summary = {}
    for mode in ("prefetch1", "prefetch2", "prefetch0"):
        row = {}
        for base in ("checkpoint", "off"):
            if mode not in results or base not in results:
                continue
            row[f"throughput_vs_{base}"] = results[mode]["tokens_per_s"] / results[base]["tokens_per_s"]
            if results[mode]["peak_gib"] is not None:
                row[f"peak_memory_vs_{base}"] = results[mode]["peak_gib"] / results[base]["peak_gib"]
        if "checkpoint" in results and mode in results and results[mode]["peak_gib"] is not None:
            saved_gib = results["checkpoint"]["peak_gib"] - results[mode]["peak_gib"]
            offloaded_gib = results[mode]["bytes_offloaded_per_step"] / GIB
            row["peak_saved_gib"], row["offloaded_gib"] = saved_gib, offloaded_gib
            if mode != "prefetch0":
                row["targets_met"] = row["throughput_vs_checkpoint"] >= 0.95 and saved_gib >= 0.5 * offloaded_gib
        summary[mode] = row
    return summary


def figure_line(results: dict[str, dict]) -> str:
    row = summarize(results)["prefetch1"]
    speed = row["throughput_vs_checkpoint"]
    saved = f", peak -{row['peak_saved_gib']:.2f} GiB of {row['offloaded_gib']:.2f} offloaded" if "peak_saved_gib" in row else ""
    return (f"figure: offload | prefetch 1 vs checkpointing: tokens/s x{speed:.3f}{saved} | tokens/s >= 0.95x, peak "
            f"lower by >= half the offloaded bytes | {'PASS' if row.get('targets_met') else 'FAIL'}")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, one step per mode")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default 65536; dry run 32)")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args(argv)
    if args.dry_run:
        device, config, dtype = torch.device("cpu"), DRY_CONFIG, torch.float32
        seq_len, warmup, steps, min_bytes = args.seq_len or 32, 0, 1, 0
    else:
        if not torch.cuda.is_available():
            parser.error("no CUDA device: run on a GPU, or pass --dry-run to check the script on CPU.")
        memory, source = card_memory_gib()
        check_fits(fixed_shape("offload"), memory, source)
        device, config, dtype = torch.device("cuda"), GPU_CONFIG, torch.bfloat16
        seq_len, warmup, steps, min_bytes = args.seq_len or 65536, args.warmup, args.steps, 1 << 20
        config = dataclasses.replace(config, max_seq_len=max(config.max_seq_len, seq_len))  # GPU_CONFIG stays as is
    torch.manual_seed(0)
    with torch.device(device):
        model = MoETransformer(config).to(dtype)
    tokens_BS = torch.randint(0, config.vocab_size, (args.batch_size, seq_len + 1), device=device)
    results, failed = {}, []
    for mode, kwargs in MODES.items():
        try:
            results[mode] = run_mode(model, tokens_BS, kwargs, warmup, steps, min_bytes)
        except Exception as error:  # e.g. out of memory: report it, free what it held, measure the others
            failed.append(mode)
            print(json.dumps({"mode": mode, "status": "failed", "error": f"{type(error).__name__}: {error}"[:800]}),
                  flush=True)
            model.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()
            continue
        print(json.dumps({"mode": mode, **results[mode]}), flush=True)
        if mode == "prefetch1" and "checkpoint" in results:
            print(figure_line(results), flush=True)
    report = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "seq_len": seq_len, "batch_size": args.batch_size, "summary": summarize(results), "results": results,
              "failed": failed}
    print(json.dumps({"summary": report["summary"]}, indent=1))
    if failed and not args.dry_run:
        raise SystemExit(f"gpu_offload: failed modes: {', '.join(failed)}")
    return report


if __name__ == "__main__":
    main()
