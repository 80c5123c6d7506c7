"""One rank of a 2-rank gloo job with torch's flight recorder on: two all-reduces over a group described as a mesh
dimension's groups are (``mesh_shard``), then rank 0 launches a third that rank 1 never joins; each rank dumps its
recorder (``run.flight_recorder.dump``) into argv[1] and exits at once (rank 0's third can never complete)."""

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from moe_lightning.run import flight_recorder

os.environ["TORCH_FR_BUFFER_SIZE"] = "100"  # before the process group exists
dist.init_process_group("gloo")
rank = dist.get_rank()
group = dist.new_group([0, 1], group_desc="mesh_shard")  # not the world group: the barrier below stays apart
for _ in range(2):
    dist.all_reduce(torch.ones(4), group=group)
if rank == 0:
    dist.all_reduce(torch.ones(4), group=group, async_op=True)
dist.barrier()  # over the world group: both have issued what they will
path = flight_recorder.dump(rank, Path(sys.argv[1]))
print(path, flush=True)
os._exit(0)
