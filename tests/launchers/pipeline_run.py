"""One step of a torch pipeline schedule over P gloo ranks against the one-process loss and gradients.

Every rank builds the same float64 model (one seed, O(1) weights), computes the one-process reference itself
(``MoELanguageModel._loss`` over the whole batch, backward), then keeps only its stages (``keep_stage``) and runs
``torch.distributed.pipelining``'s schedule over the micro-batches. The embedding copies are summed as training
does (``sum_shared_embedding_grads`` between ranks; copies on one rank, a V schedule's, are added locally). Rank 0
prints one JSON line: the main loss and total loss of both, and per parameter the largest relative gradient error.
Launched by tests/parallel/test_pipeline.py.
"""

import argparse
import copy
import json

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage

from moe_lightning.model import MoEConfig
from moe_lightning.parallel.pipeline import (PipelineLoss, keep_stage, reads_embedding_last, resolve_pipeline,
                                             schedule_class, sum_shared_embedding_grads)
from tests.support.pipeline_model import SHAPE, build




def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--schedule", default="1F1B")
    parser.add_argument("--microbatches", type=int, default=None)
    parser.add_argument("--stages-per-rank", type=int, default=None)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--config", default="{}", help="MoEConfig fields over SHAPE, as JSON")
    args = parser.parse_args()
    config = MoEConfig(**{**SHAPE, **json.loads(args.config)})
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    layout = resolve_pipeline(config, world, args.schedule, args.microbatches, args.stages_per_rank)
    batch_BS1 = torch.randint(0, config.vocab_size, (args.batch, config.max_seq_len + 1),
                              generator=torch.Generator().manual_seed(1))

    reference = build(config)
    loss = reference._loss(batch_BS1)
    loss.backward()
    expected = {n: p.grad for n, p in reference.model.named_parameters()}
    main_loss = reference._main_loss if config.mtp_layers else loss

    b, S, D, M = args.batch // layout.microbatches, config.max_seq_len, config.dim, layout.microbatches
    # example inputs and outputs (no shape inference); requires_grad marks those whose gradients travel back
    hidden = torch.empty(b, S, D, dtype=torch.float64, device="meta", requires_grad=True)
    sums = torch.empty(1 + config.mtp_layers, dtype=torch.float32, device="meta", requires_grad=True)  # the head's
    tokens = torch.empty(b, S + 1, dtype=torch.long, device="meta")
    parts, stages = [], []
    for stage in layout.stages_of(rank):
        part = keep_stage(copy.deepcopy(build(config).model), stage, layout)
        for moe in part.moe_layers():
            moe.aux_loss_grad_scale = 1 / M
        parts.append(part)
        stages.append(PipelineStage(part, stage, layout.num_stages, torch.device("cpu"),
                                    input_args=(tokens if stage == 0 else hidden,),
                                    output_args=sums if stage == layout.num_stages - 1 else hidden))
    loss_fn = PipelineLoss(config)
    loss_fn.set_batch(batch_BS1)
    cls = schedule_class(layout.schedule)
    schedule = cls(stages[0] if layout.stages_per_rank == 1 else stages, M, loss_fn=loss_fn, scale_grads=False)
    schedule.step(batch_BS1, batch_BS1=batch_BS1, target=batch_BS1, return_outputs=False)

    # the embedding's copies: summed between ranks as training does, or here on one rank (a V's first and last)
    first, last = layout.rank_of(0), layout.rank_of(layout.num_stages - 1)
    group = dist.new_group([first, last]) if first != last and reads_embedding_last(config) else None
    for part in parts:
        sum_shared_embedding_grads(part, group if rank in (first, last) else None)
    grads: dict[str, torch.Tensor] = {}
    for part in parts:
        for name, p in part.named_parameters():
            grads[name] = grads[name] + p.grad if name in grads else p.grad
    errors = {n: ((g - expected[n]).abs().max() / expected[n].abs().max().clamp(min=1e-300)).item()
              for n, g in grads.items()}
    losses = loss_fn.losses().tolist() if loss_fn.sums else None
    gathered = [None] * world
    dist.all_gather_object(gathered, {"errors": errors, "losses": losses})
    if rank == 0:
        pipeline_losses = next(g["losses"] for g in gathered if g["losses"] is not None)
        weights = [1.0] + [config.mtp_loss_weight / max(config.mtp_layers, 1)] * config.mtp_layers
        print(json.dumps({"stages": [layout.stages_of(r) for r in range(world)],
                          "blocks_per_stage": layout.blocks_per_stage,
                          "main": [pipeline_losses[0], main_loss.item()],
                          "total": [sum(w * x for w, x in zip(weights, pipeline_losses)), loss.item()],
                          "errors": {n: e for g in gathered for n, e in g["errors"].items()},
                          "names": sorted({n for g in gathered for n in g["errors"]}) == sorted(expected)}))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
