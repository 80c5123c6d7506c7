"""One rank of EP 2 (4 experts, top-2, 64 tokens a rank): a balanced forward, then two forwards whose router sends
every token to experts 0 and 1 (both on rank 0, so rank 0 receives 2 x 64 x 2 rows: 2.0x its own tokens x top-k).
Prints one JSON line per rank: the skew warnings it raised, in order."""

import json
import warnings

import torch
import torch.distributed as dist

from moe_lightning.model import MoEConfig
from moe_lightning.model.moe import MoELayer
from moe_lightning.parallel.expert_parallel import apply_expert_parallel


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    moe = MoELayer(MoEConfig(dim=16, num_experts=4, top_k=2, expert_hidden=8, n_shared_experts=0))
    apply_expert_parallel([moe], dist.group.WORLD)
    moe.dispatcher.skew.name_layers([moe])
    x = torch.rand(1, 64, 16, generator=torch.Generator().manual_seed(rank))  # positive entries
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        moe.router.gate.weight.normal_(0, 0.1)
        moe(x)  # balanced (random gate)
        balanced = len(caught)
        moe.router.gate.weight.copy_(torch.tensor([1.0, 1.0, -1.0, -1.0])[:, None].expand(4, 16))
        moe(x)
        moe(x)
    said = [str(w.message) for w in caught if "expert parallelism:" in str(w.message)]
    print(json.dumps({"rank": rank, "balanced": balanced, "warnings": said}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
