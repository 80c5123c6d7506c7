"""Pipeline stages on CPU processes: each stage's measured idle fraction beside the bubble ``plan`` predicts, and the
bytes sent between stages counted on the wire beside the planned count.

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python benchmarks/pipeline.py [--size 2] [--microbatches 2 4 8]
        [--schedules 1F1B GPipe Interleaved1F1B ZBVZeroBubble] [--steps 3]

Each schedule runs ``--steps`` training steps of configs/tiny-fsdp.yaml's model (fp32, 4 blocks, sequences of 128
tokens, 2 sequences a micro-batch) over ``--size`` gloo processes through torch's schedule and ``PipelineStage``
(``parallel.pipeline.keep_stage``). Busy time is what a rank spends inside its stages' forward and backward
(``PipelineStage.forward_one_chunk`` / ``backward_one_chunk`` / ``backward_weight_one_chunk``); idle is the rest
of the step (waiting for a neighbour: on CPU processes a bubble shows as idle time, there is no overlap). The first
step is a warm-up and not counted. Predicted: ``planner.pipeline.simulate`` over the same schedule's action order
with each stage's forward time the measured one-process forward of its blocks (backward twice that). Bytes: every
send a rank's stages hand the schedule (``PipelineStage.get_fwd_send_ops`` / ``get_bwd_send_ops``), against
``M x b·S·D·4`` per direction and stage boundary between ranks. Wall times depend on the machine and its load: say which when quoting them.
"""

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import yaml  # noqa: E402

from moe_lightning.model import MoEConfig, MoETransformer  # noqa: E402
from moe_lightning.parallel.pipeline import (PipelineLoss, keep_stage, resolve_pipeline,  # noqa: E402
                                             schedule_class)
from moe_lightning.planner.pipeline import schedule_actions, simulate  # noqa: E402

SEQUENCES_PER_MICROBATCH, SEQ = 2, 128


def tiny_config() -> MoEConfig:
    shape = yaml.safe_load((ROOT / "configs" / "tiny-fsdp.yaml").read_text())["model"]["init_args"]["config"]
    return MoEConfig(**shape)


def worker(schedule: str, microbatches: int, steps: int) -> None:
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, size = dist.get_rank(), dist.get_world_size()
    config = tiny_config()
    layout = resolve_pipeline(config, size, schedule, microbatches)
    torch.manual_seed(0)
    full = MoETransformer(config)
    b, M = SEQUENCES_PER_MICROBATCH, layout.microbatches
    hidden = torch.empty(b, SEQ, config.dim, device="meta", requires_grad=True)
    sums = torch.empty(1, device="meta", requires_grad=True)
    tokens = torch.empty(b, SEQ + 1, dtype=torch.long, device="meta")
    busy, sent = [0.0], [0]
    stages = []
    for stage in layout.stages_of(rank):
        part = keep_stage(copy.deepcopy(full), stage, layout).train()
        pipeline_stage = PipelineStage(part, stage, layout.num_stages, torch.device("cpu"),
                                       input_args=(tokens if stage == 0 else hidden,),
                                       output_args=sums if stage == layout.num_stages - 1 else hidden)
        for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
            method = getattr(pipeline_stage, name)

            def timed(*args, _method=method, **kwargs):
                start = time.perf_counter()
                try:
                    return _method(*args, **kwargs)
                finally:
                    busy[0] += time.perf_counter() - start
            setattr(pipeline_stage, name, timed)
        for name in ("get_fwd_send_ops", "get_bwd_send_ops"):  # the sends the stage hands the schedule
            method = getattr(pipeline_stage, name)

            def counted(*args, _method=method, **kwargs):
                ops = _method(*args, **kwargs)
                sent[0] += sum(op.tensor.numel() * op.tensor.element_size() for op in ops)
                return ops
            setattr(pipeline_stage, name, counted)
        stages.append(pipeline_stage)
    loss_fn = PipelineLoss(config)
    runner = schedule_class(schedule)(stages[0] if len(stages) == 1 else stages, M, loss_fn=loss_fn,
                                      scale_grads=False)
    g = torch.Generator().manual_seed(1)
    walls, busies, bytes_sent = [], [], []
    for step in range(steps + 1):
        batch = torch.randint(0, config.vocab_size, (b * M, SEQ + 1), generator=g)
        loss_fn.set_batch(batch)
        dist.barrier()
        busy[0], sent[0], start = 0.0, 0, time.perf_counter()
        runner.step(batch, batch_BS1=batch, target=batch, return_outputs=False)
        wall = time.perf_counter() - start
        if step:  # the first step is a warm-up
            walls.append(wall)
            busies.append(busy[0])
            bytes_sent.append(sent[0])
    result = [None] * size
    dist.all_gather_object(result, {"wall": walls, "busy": busies, "sent": bytes_sent})
    if rank == 0:
        print(json.dumps({"ranks": result, "blocks_per_stage": layout.blocks_per_stage,
                          "stages": [layout.stages_of(r) for r in range(size)], "V": layout.stages_per_rank}))
    dist.destroy_process_group()


def stage_forward_seconds(config: MoEConfig, blocks_per_stage: tuple[int, ...], repeats: int = 3) -> list[float]:
    """One process: each stage's forward of one micro-batch, timed (the best of ``repeats``)."""
    torch.manual_seed(0)
    full = MoETransformer(config)
    from moe_lightning.parallel.pipeline import PipelineLayout
    layout = PipelineLayout(len(blocks_per_stage), "1F1B", 1, 1, tuple(blocks_per_stage))
    batch = torch.randint(0, config.vocab_size, (SEQUENCES_PER_MICROBATCH, SEQ + 1))
    x = batch
    seconds = []
    for stage in range(len(blocks_per_stage)):
        part = keep_stage(copy.deepcopy(full), stage, layout).train()
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            with torch.no_grad():
                out = part(x, batch)
            best = min(best, time.perf_counter() - start)
        seconds.append(best)
        x = out
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=2)
    parser.add_argument("--microbatches", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--schedules", nargs="+", default=["1F1B", "GPipe", "Interleaved1F1B", "ZBVZeroBubble"])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker[0], int(args.worker[1]), args.steps)
    from tests.support.distributed import run_ranks
    torch.set_num_threads(1)
    config = tiny_config()
    print(f"pipeline benchmark: configs/tiny-fsdp.yaml's model, fp32, {args.size} gloo processes, "
          f"{SEQUENCES_PER_MICROBATCH} x {SEQ} tokens a micro-batch, {torch.get_num_threads()} thread each")
    for schedule in args.schedules:
        for M in args.microbatches:
            try:
                layout = resolve_pipeline(config, args.size, schedule, M)
            except ValueError as e:
                print(f"{schedule} M={M}: refused: {e}")
                continue
            out = run_ranks(Path(__file__), args.size, "--worker", schedule, str(M), "--steps", str(args.steps),
                            timeout=1800)
            run = json.loads([line for line in out[0].splitlines() if line.startswith("{")][-1])
            forward_s = stage_forward_seconds(config, layout.blocks_per_stage)
            predicted = simulate(schedule_actions(schedule, args.size, M, layout.stages_per_rank), forward_s, 0.0)
            hop = SEQUENCES_PER_MICROBATCH * SEQ * config.dim * 4
            measured_idle = [1 - sum(r["busy"]) / sum(r["wall"]) for r in run["ranks"]]
            planned_bytes = [M * hop * layout.sends_between_ranks(r) for r in range(args.size)]
            print(f"{schedule} M={M} blocks {list(layout.blocks_per_stage)}: idle per rank measured "
                  f"{[round(x, 3) for x in measured_idle]}, predicted {[round(x, 3) for x in predicted['idle_fraction']]}"
                  f"; sent per step {[r['sent'][0] for r in run['ranks']]} B, planned {planned_bytes} B; "
                  f"step {sum(run['ranks'][0]['wall']) / len(run['ranks'][0]['wall']):.3f} s", flush=True)


if __name__ == "__main__":
    main()
