"""One rank of a ``ParallelMesh`` built over gloo: prints, as one JSON line, the ranks of every named group this
rank belongs to, the dimension ``name_of`` gives each, the sampler's replica and, with ``--nodes``, the node groups
of hierarchical expert dispatch (``--nodes`` ranks per node, consecutive)."""

import argparse
import json

import torch.distributed as dist

from moe_lightning.parallel.expert_parallel import plan_layout
from moe_lightning.parallel.mesh import MeshLayout, ParallelMesh, name_of, node_groups


def ranks(group):
    return None if group is None else dist.get_process_group_ranks(group)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--replicate", type=int, default=1)
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--cp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--per-node", type=int, default=0)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    mesh = ParallelMesh(MeshLayout.resolve(world, args.replicate, "auto", args.ep, None, args.cp,
                                           pipeline_parallel_size=args.pp), "cpu")
    names = ("replicate", "shard", "ep", "efsdp", "cp") + (("pp", "stage", "pp_ends") if args.pp > 1 else ())
    groups = {name: mesh.group(name) for name in names}
    report = {"groups": {name: ranks(g) for name, g in groups.items()},
              "names": {name: name_of(g) for name, g in groups.items() if g is not None},
              "data_parallel": [mesh.data_parallel_rank, mesh.data_parallel_size],
              "side": [ranks(mesh.side_channel(name)) for name in ParallelMesh.SIDE_CHANNELS]}
    if mesh.expert is not None:  # the checkpoint's 3-D expert mesh and the expert stacks' FSDP mesh, as rank lists
        report["expert"] = [mesh.expert.mesh_dim_names, mesh.expert.mesh.tolist(), mesh.expert_fsdp.mesh.tolist()]
    if args.per_node:
        ep_group = mesh.group("ep")
        table = [None] * world
        dist.all_gather_object(table, (dist.get_rank() // args.per_node, tuple(ranks(ep_group))))
        inter, intra = node_groups(plan_layout(table), "cpu")
        report["nodes"] = {"inter": ranks(inter), "intra": ranks(intra), "names": [name_of(inter), name_of(intra)]}
    dist.barrier()
    print(json.dumps(report), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
