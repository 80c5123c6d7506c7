"""One rank of FlexShard Muon under pipeline stages (launched by tests/optim/test_flexshard.py on 4 ranks): ranks
{0, 1} are stage 0, ranks {2, 3} stage 1, each stage's blocks FSDP-sharded over its own 2 ranks (the shard mesh of a
(stage, shard) mesh, as ``MoEFSDPStrategy`` builds it) and its optimizer holding its own parameters only, with
``Muon.trainers_group`` the stage's ranks. Stage 0 trains blocks 0-1; stage 1 the final norm and head (AdamW only:
no Muon matrix) in mode ``muon_free``, and block 2 too in mode ``both``; mode ``frozen`` is ``both`` with one of
block 2's matrices left out on rank 3 only (stage 1 refuses, naming global rank 3; stage 0 steps). Every rank also
steps ``torch.optim.Muon`` on whole copies of its stage's Muon matrices with the same gradients and prints one JSON
line per mode: the largest difference after 3 steps, or the error. Expert stacks go to AdamW (``torch.optim.Muon``
takes matrices only)."""

import json
import sys
import zlib

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from moe_lightning.model import MoEConfig, MoETransformer
from moe_lightning.optim import Muon, param_groups

# Uneven row shards: ffn_hidden 14 and dim 24 split over 2 ranks as torch.chunk does.
CONFIG = MoEConfig(vocab_size=40, dim=24, n_layers=3, n_heads=2, n_kv_heads=1, max_seq_len=16, ffn_hidden=14,
                   n_dense_layers=1, num_experts=4, top_k=2, expert_hidden=10, n_shared_experts=1)
MUON_KW = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True, adjust_lr_fn="match_rms_adamw")
STAGE_PREFIXES = {"muon_free": (("layers.0.", "layers.1."), ("norm.", "output.")),
                  "both": (("layers.0.", "layers.1."), ("layers.2.", "norm.", "output."))}
STAGE_PREFIXES["frozen"] = STAGE_PREFIXES["both"]
LEFT_OUT_ON_RANK_3 = "layers.2.attention.wq.weight"


def check(mode: str, mesh, stage_group) -> dict:
    stage = dist.get_rank() // 2
    torch.manual_seed(0)
    model = MoETransformer(CONFIG)
    for block in model.layers:
        fully_shard(block, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    def trains(name: str) -> bool:
        return name.startswith(STAGE_PREFIXES[mode][stage]) and not (
            mode == "frozen" and dist.get_rank() == 3 and name == LEFT_OUT_ON_RANK_3)
    groups = [{**g, "params": [p for n, p in zip(g["param_names"], g["params"]) if trains(n)],
               "param_names": [n for n in g["param_names"] if trains(n)]} for g in param_groups(model, 0.1)]
    optimizer = Muon([g for g in groups if g["params"]], adamw_patterns=["*.experts.*"], ns_dtype="bfloat16",
                     **MUON_KW)
    optimizer.trainers_group = stage_group
    muon = {n: p for g in optimizer.param_groups if g["algorithm"] == "muon" for n, p in zip(g["param_names"],
                                                                                            g["params"])}
    whole = {n: p.full_tensor() for n, p in model.named_parameters()  # every stage rank gathers the same ones
             if n.startswith(STAGE_PREFIXES[mode][stage])}
    copies = {n: torch.nn.Parameter(whole[n].detach().clone()) for n in muon}
    reference = torch.optim.Muon(list(copies.values()), **MUON_KW) if copies else None
    for step in range(3):
        for name, p in model.named_parameters():  # the stage's, also one left out of the optimizer: same scatters
            if name.startswith(STAGE_PREFIXES[mode][stage]):
                seed = 1000 * step + zlib.crc32(name.encode()) % 997
                full = torch.randn(p.shape, generator=torch.Generator().manual_seed(seed))
                p.grad = distribute_tensor(full, p.device_mesh, p.placements) if isinstance(p, DTensor) else full
                if name in copies:
                    copies[name].grad = full.clone()
        try:
            optimizer.step()
        except ValueError as error:  # FlexShardLayoutError
            return {"mode": mode, "rank": dist.get_rank(), "error": str(error)}
        if reference is not None:
            reference.step()
    diff = max([(muon[n].full_tensor() - copies[n]).abs().max().item() for n in muon], default=0.0)
    return {"mode": mode, "rank": dist.get_rank(), "muon_matrices": len(muon), "max_diff": diff}


def main() -> None:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("stage", "shard"))
    stages = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank makes both, in the same order
    for mode in sys.argv[1].split(","):
        print(json.dumps(check(mode, mesh, stages[dist.get_rank() // 2])), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
