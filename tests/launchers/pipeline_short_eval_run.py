"""Evaluation through ``PipelineRunner`` on 2 gloo ranks (1F1B, 2 micro-batches) of a held-out batch of
``argv[1]`` sequences, against the one-process loss of the same float64 model. A batch of 1 (fewer sequences than
stages) runs as GPipe with one micro-batch. Rank 0 prints one JSON line. Launched by tests/parallel/test_pipeline.py.
"""

import copy
import json
import sys

import torch
import torch.distributed as dist

from moe_lightning.model import MoEConfig
from moe_lightning.parallel.pipeline import PipelineRunner, keep_stage, resolve_pipeline
from pipeline_run import SHAPE, build  # the same model (this folder is the script's first import path)


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    config = MoEConfig(**SHAPE)
    layout = resolve_pipeline(config, 2, "1F1B", 2)
    batch_BS1 = torch.randint(0, config.vocab_size, (int(sys.argv[1]), config.max_seq_len + 1),
                              generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = build(config).eval()._loss(batch_BS1).item()
        part = keep_stage(copy.deepcopy(build(config).model), rank, layout).eval()
        runner = PipelineRunner([part], layout, dist.group.WORLD, torch.device("cpu"), torch.float64)
        losses = runner.run(batch_BS1, training=False).tolist()
    if rank == 0:
        B = batch_BS1.shape[0]
        print(json.dumps({"pipeline": losses[0], "one_process": expected, "microbatches": runner.microbatches(B, False),
                          "schedule": runner.schedule_name(runner.microbatches(B, False), False)}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
