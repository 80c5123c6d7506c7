"""CPU figures for activation offload on a config's real shapes: bytes offloaded per step, tensors moved.

    python benchmarks/offload_cpu.py                        # configs/tiny.yaml
    python benchmarks/offload_cpu.py --config configs/small.yaml --prefetch 2

On CPU the copies are host to host, so this checks what moves (and that the loss is unchanged), not
speed or memory; ``benchmarks/gpu_offload.py`` measures those on a GPU.
"""

import argparse
import json

import torch
import yaml
from gpu_offload import run_mode

from moe_lightning.model import MoETransformer
from moe_lightning.planner.run_config import load_model_config


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/tiny.yaml", help="LightningCLI YAML with model and data")
    parser.add_argument("--prefetch", type=int, default=1)
    parser.add_argument("--min-offload-bytes", type=int, default=1 << 20)
    args = parser.parse_args(argv)
    with open(args.config) as f:
        cli_config = yaml.safe_load(f)
    config = load_model_config(args.config)
    data = cli_config["data"]["init_args"]
    seq_len, batch_size = data["seq_len"], data["batch_size"]
    torch.manual_seed(0)
    model = MoETransformer(config)
    tokens_BS = torch.randint(0, config.vocab_size, (batch_size, seq_len + 1))
    reference = run_mode(model, tokens_BS, None, warmup=0, steps=1)
    result = run_mode(model, tokens_BS, {"prefetch": args.prefetch}, warmup=0, steps=1,
                      min_offload_bytes=args.min_offload_bytes)
    boundary_bytes = batch_size * seq_len * config.dim * torch.get_default_dtype().itemsize
    report = {"config": args.config, "batch_size": batch_size, "seq_len": seq_len, "dim": config.dim,
              "n_layers": config.n_layers, "boundary_bytes": boundary_bytes,
              "expected_bytes_per_step": boundary_bytes * (config.n_layers - 1)
              if boundary_bytes >= args.min_offload_bytes else 0,
              "bytes_offloaded_per_step": result["bytes_offloaded_per_step"],
              "tensors_out_per_step": result["tensors_out_per_step"],
              "tensors_in_per_step": result["tensors_in_per_step"],
              "loss_unchanged": result["loss"] == reference["loss"], "copy_order": result["copy_order"]}
    print(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
