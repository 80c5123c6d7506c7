"""One rank of the FSDP2 offload check (launched by tests/test_offload.py through ``run_ranks``).

Shards two identical models per block (gloo, CPU), wraps one with ActivationOffload after sharding,
and prints whether loss and every gradient shard match bit for bit, plus the offload order.
"""

import json
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard

from moe_lightning.callbacks import ActivationOffload
from moe_lightning.model import MoEConfig, MoETransformer

CONFIG = MoEConfig(vocab_size=64, dim=32, n_layers=3, n_heads=4, n_kv_heads=2, max_seq_len=16, ffn_hidden=64,
                   num_experts=4, top_k=2, expert_hidden=32, aux_loss_coef=0.01)


def sharded_model() -> MoETransformer:
    torch.manual_seed(0)
    model = MoETransformer(CONFIG)
    for block in model.layers:
        fully_shard(block)
    return fully_shard(model)


def step(model: MoETransformer, tokens_BS: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    logits_BSV = model(tokens_BS[:, :-1])
    loss = F.cross_entropy(logits_BSV.flatten(0, 1), tokens_BS[:, 1:].flatten())
    loss.backward()
    return loss.detach(), {name: p.grad.to_local().clone() for name, p in model.named_parameters()}


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    tokens_BS = torch.randint(0, CONFIG.vocab_size, (2, 17), generator=torch.Generator().manual_seed(rank))
    reference_loss, reference_grads = step(sharded_model(), tokens_BS)
    model = sharded_model()
    offload = ActivationOffload(prefetch=1, min_offload_bytes=0, blocks=[0, 1, 2])
    offload.apply(model.layers)
    loss, grads = step(model, tokens_BS)
    result = {"rank": rank, "loss_equal": torch.equal(loss, reference_loss),
              "grads_equal": all(torch.equal(grads[k], reference_grads[k]) for k in reference_grads),
              "n_grads": len(grads), "order": offload.order, "tensors_out": offload.tensors_offloaded}
    print(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
