"""One rank of a plain training loop over configs/tiny-fsdp.yaml's model with expert parallelism over 2 ranks: the
same 50 steps twice, fp32 dispatch then FP8 dispatch (``dispatch_dtype=float8_e4m3fn``), from the same weights.

No Lightning, no FSDP: ``apply_expert_parallel`` slices the experts (each block on one rank, so the exchange's
gradient scaling makes its gradient the data-parallel mean), every other gradient is averaged over the ranks by
hand, AdamW as the config (lr 3e-3, betas 0.9/0.95, constant: no schedule). Data: the bytes of Python's standard
library text (tokens < 256 of the 320-token vocabulary), 4 sequences of 128 tokens per rank per step, different
per rank. Rank 0 prints one JSON line: the per-step mean loss over the ranks of each run.
"""

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist

from moe_lightning.model.transformer import MoETransformer
from moe_lightning.parallel.expert_parallel import apply_expert_parallel
from moe_lightning.planner.run_config import load_model_config
from tests.support.ep_loop import train_steps

REPO_ROOT = Path(__file__).resolve().parents[2]
STEPS, BATCH, SEQ = 50, 4, 128


def batches(rank: int, world: int) -> list[torch.Tensor]:
    text = Path(argparse.__file__).read_bytes()  # ~100 KB; 50 steps use 51,600 bytes
    tokens = torch.tensor(list(text), dtype=torch.long)
    per_step = world * BATCH * (SEQ + 1)
    return [tokens[s * per_step:(s + 1) * per_step].view(world, BATCH, SEQ + 1)[rank] for s in range(STEPS)]


def train(dispatch_dtype, rank: int, world: int) -> list[float]:
    config = load_model_config(REPO_ROOT / "configs" / "tiny-fsdp.yaml")
    torch.manual_seed(0)
    model = MoETransformer(config)
    apply_expert_parallel(model.moe_layers(), dist.group.WORLD, dispatch_dtype=dispatch_dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95))
    return train_steps(model, optimizer, batches(rank, world))


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    runs = {"fp32": train(None, rank, world), "fp8": train(torch.float8_e4m3fn, rank, world)}
    if rank == 0:
        print(json.dumps(runs), flush=True)
    dist.barrier()  # no rank tears its groups down while another still talks (gloo aborts)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
