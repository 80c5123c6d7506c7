"""One rank of a plain training loop with FP8 dispatch and more overlap chunks than this rank has tokens: EP 2, 8
chunks, rank 0 trains on 5 tokens a step and rank 1 on 2, so every chunk of rank 1 past its second is empty (and
so is one of rank 0's). The same 12 steps with 1 chunk, from the same weights, are the reference: chunking moves
no value (a row is quantized alike in any chunk), so the two runs' losses agree to fp32 sum order.

A small MoE (dim 128: one full FP8 block per row, 8 experts top-2, O(1) initial weights), one fixed sequence per
rank (so the loss must fall), AdamW lr 1e-2; non-expert gradients averaged over the ranks by hand. Rank 0 prints
one JSON line: {"chunks_8": [...], "chunks_1": [...]}, the per-step mean loss over the ranks.
"""

import json

import torch
import torch.distributed as dist

from moe_lightning.model import MoEConfig, MoETransformer
from moe_lightning.parallel.expert_parallel import apply_expert_parallel
from tests.support.ep_loop import train_steps

STEPS = 12
TOKENS = {0: 5, 1: 2}  # positions predicted per rank and step (the sequence holds one more)
CONFIG = MoEConfig(vocab_size=64, dim=128, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=16, ffn_hidden=128,
                   num_experts=8, top_k=2, expert_hidden=64, n_shared_experts=1, n_dense_layers=1)


def train(chunks: int, rank: int) -> list[float]:
    torch.manual_seed(0)
    model = MoETransformer(CONFIG)
    apply_expert_parallel(model.moe_layers(), dist.group.WORLD, overlap_chunks=chunks,
                          dispatch_dtype=torch.float8_e4m3fn)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens = torch.randint(0, CONFIG.vocab_size, (1, TOKENS[rank] + 1), generator=torch.Generator().manual_seed(rank))
    return train_steps(model, optimizer, [tokens] * STEPS)


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    runs = {"chunks_8": train(8, rank), "chunks_1": train(1, rank)}
    if rank == 0:
        print(json.dumps(runs), flush=True)
    dist.barrier()  # no rank tears its groups down while another still talks (gloo aborts)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
