"""Muon optimizer step on FSDP2 (CPU, gloo): FlexShard vs torch.optim.Muon on DTensors vs gather-everything.

    python benchmarks/muon_flexshard.py                      # 2 and 4 processes, tiny-config shapes
    python benchmarks/muon_flexshard.py --dim 256 --steps 10

Each rank builds the tiny-config model, ``fully_shard``s every block (expert stacks Shard(0), dense rows
Shard(0)) and times ``optimizer.step()`` on fixed gradients (median after a warm-up step). Bytes are
per rank and per step: the largest tensor of each collective (what one rank sends or receives),
counted by a dispatch mode that sees both c10d and functional (DTensor) collectives.
- FlexShard: ``moe_lightning.optim.Muon``; experts local, dense matrices gathered to LPT owners in the Newton–Schulz dtype (bf16, or fp32 on CPUs without bf16 units).
- torch.optim.Muon: on the FSDP2 DTensors; it rejects 3-D stacks, so it only gets the dense matrices
  and is compared against FlexShard on the same dense-only set.
- gather-all: every rank all-gathers every fp32 update (``full_tensor``), orthogonalizes all of them
  and keeps its shard: the simplest correct distributed Muon.
On CPU the processes share cores: times compare communication and redundant work, not GPU speed.
"""

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.distributed.tensor import DTensor, Shard  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from moe_lightning.model import MoEConfig, MoETransformer  # noqa: E402
from moe_lightning.optim import Muon, muon_param_groups, newton_schulz  # noqa: E402
from tests.support.distributed import run_ranks  # noqa: E402


class CollectiveBytes(TorchDispatchMode):
    """Counts c10d / functional collectives and the bytes of their largest tensor."""

    def __init__(self):
        super().__init__()
        self.calls, self.bytes = 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if DTensor in types:  # let DTensor desugar into the collectives it needs; they come back here
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        if func.namespace in ("c10d", "_c10d_functional") and "wait" not in func.__name__:
            tensors = [t for t in torch.utils._pytree.tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)]
            self.calls += 1
            self.bytes += max((t.numel() * t.element_size() for t in tensors), default=0)
        return out


class GatherAllMuon(Muon):
    """Baseline: all-gather each whole update to every rank, orthogonalize everything everywhere."""

    def _muon_step(self, muon):
        for group, p in muon:
            U = self._momentum_update(group, p)
            if isinstance(p, DTensor):
                U = DTensor.from_local(U, p.device_mesh, p.placements, shape=p.shape, stride=p.stride()).full_tensor()
            O = newton_schulz(U, self._schedule(group), group["eps"], self._ns_dtype(U.device))  # as Muon's
            if isinstance(p, DTensor):
                O = torch.chunk(O, p.device_mesh.size(), dim=0)[p.device_mesh.get_local_rank()]
            self._apply(group, p, O)


def worker(args) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    world, rank = dist.get_world_size(), dist.get_rank()
    config = MoEConfig(vocab_size=320, dim=args.dim, n_layers=args.layers, n_heads=4, n_kv_heads=2,
                       ffn_hidden=3 * args.dim, num_experts=args.experts, expert_hidden=args.dim, n_shared_experts=1)
    torch.manual_seed(0)
    model = MoETransformer(config)
    mesh = init_device_mesh("cpu", (world,))
    for block in model.layers:
        fully_shard(block, mesh=mesh, shard_placement_fn=lambda p: Shard(0) if p.ndim == 3 else None)
    fully_shard(model, mesh=mesh)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    dense = [g for g in muon_param_groups(model, 0.1) if g["role"] == "hidden_matrix"]
    muon_all = [g for g in muon_param_groups(model, 0.1) if g["algorithm"] == "muon"]
    cases = {
        "all/flexshard": lambda: Muon(muon_all, lr=1e-3),
        "all/gather-all": lambda: GatherAllMuon(muon_all, lr=1e-3),
        "dense/flexshard": lambda: Muon(dense, lr=1e-3),
        "dense/gather-all": lambda: GatherAllMuon(dense, lr=1e-3),
        "dense/torch.optim.Muon": lambda: torch.optim.Muon([p for g in dense for p in g["params"]], lr=1e-3,
                                                           adjust_lr_fn="match_rms_adamw"),
    }
    results = {}
    for name, make in cases.items():
        opt = make()
        opt.step()  # warm-up: state allocation, owner plan
        times = []
        for _ in range(args.steps):
            dist.barrier()
            counter = CollectiveBytes()
            start = time.perf_counter()
            with counter:
                opt.step()
            times.append(time.perf_counter() - start)
        slowest = torch.tensor(times)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # a step lasts as long as its slowest rank
        results[name] = {"ms": 1e3 * statistics.median(slowest.tolist()), "collectives": counter.calls,
                         "MB": counter.bytes / 2 ** 20}
    if rank == 0:
        n_muon = sum(p.numel() for g in muon_all for p in g["params"])
        print(json.dumps({"world": world, "muon_params": n_muon, "results": results}))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--worlds", default="2,4")
    args = parser.parse_args()
    if "RANK" in os.environ:
        return worker(args)
    argv = ["--dim", str(args.dim), "--layers", str(args.layers), "--experts", str(args.experts),
            "--steps", str(args.steps)]
    for world in map(int, args.worlds.split(",")):
        out = next(line for line in run_ranks(__file__, world, *argv, timeout=1800)[0].splitlines()
                   if line.startswith("{"))
        report = json.loads(out)
        r = report["results"]
        print(f"\n{world} processes, {report['muon_params'] / 1e6:.2f}M Muon parameters "
              f"(dim {args.dim}, {args.layers} layers, {args.experts} experts)")
        print(f"{'set/method':26s} {'step ms':>9s} {'collectives':>12s} {'MB/rank':>9s} {'time ratio':>11s} "
              f"{'bytes ratio':>12s}")
        for name, row in r.items():
            base = r[name.split("/")[0] + "/flexshard"]
            print(f"{name:26s} {row['ms']:9.1f} {row['collectives']:12d} {row['MB']:9.3f} "
                  f"{row['ms'] / base['ms']:10.2f}x {row['MB'] / base['MB'] if base['MB'] else float('nan'):11.2f}x")
        print("JSON", out)


if __name__ == "__main__":
    main()
