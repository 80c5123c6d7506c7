"""Pipeline stages under context parallelism on 2 gloo ranks (one context-parallel group), float64, against one
process: each rank runs the stages one after another (``keep_stage`` parts, each with a ``ContextParallelShard``
as the model's ``sequence_shard``) over the micro-batches, each micro-batch's sums weighted by ``PipelineLoss``;
the gradients are averaged over the two ranks, as FSDP averages over a stage's data-parallel x context ranks. The
reference is the whole model without context parallelism on one process (``MoELanguageModel._loss``). Rank 0
prints one JSON line (the cases named on the command line, default all): each case's loss pair and the largest relative gradient error, router and the rest apart.
Launched by tests/parallel/test_pipeline_ep_cp.py."""

import json
import sys

import torch
import torch.distributed as dist

from moe_lightning.model import MoEConfig
from moe_lightning.parallel.context_parallel import ContextParallelShard
from moe_lightning.parallel.pipeline import PipelineLoss, keep_stage, resolve_pipeline
from tests.support.pipeline_model import SHAPE, build

MLA = dict(attention="mla", kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8)
CASES = {  # name: (stages, micro-batches, config)
    "causal": (2, 2, {}),
    "mtp2-docs": (2, 4, dict(mtp_layers=2, document_masking=True, eod_token_id=3)),
    "mla-mtp1-docs-3stages": (3, 4, dict(mtp_layers=1, document_masking=True, eod_token_id=3, **MLA)),
}



def run_case(stages: int, micro: int, extra: dict) -> dict:
    config = MoEConfig(**{**SHAPE, **extra})
    g = torch.Generator().manual_seed(1)
    batch_BS1 = torch.randint(0, config.vocab_size, (8, 17), generator=g)
    batch_BS1[0, [5, 11]] = 3  # documents (where masking is on)
    reference = build(config)
    loss = reference._loss(batch_BS1)
    loss.backward()
    main = reference._main_loss if config.mtp_layers else loss
    expected = {n: p.grad for n, p in reference.model.named_parameters()}

    layout = resolve_pipeline(config, stages, microbatches=micro)
    parts = [keep_stage(build(config).model, s, layout) for s in range(stages)]
    for part in parts:
        part.sequence_shard = ContextParallelShard(dist.group.WORLD)
        for moe in part.moe_layers():
            moe.aux_loss_grad_scale = 1 / micro
    loss_fn = PipelineLoss(config)
    loss_fn.set_batch(batch_BS1)
    total = 0.0
    for mb_BS1 in batch_BS1.chunk(micro):
        x = mb_BS1
        for part in parts:
            x = part(x, mb_BS1)
            if not part.pipeline_last:  # what flows between stages: this rank's share of each sequence
                assert x.shape == (mb_BS1.shape[0], 16 // 2, config.dim), x.shape
        mb_loss = loss_fn(x, mb_BS1)
        mb_loss.backward()
        total += mb_loss.item()
    grads: dict[str, torch.Tensor] = {}  # the embedding's two copies (first and last stage) summed, as the runner does
    for part in parts:
        for name, p in part.named_parameters():
            grads[name] = grads[name] + p.grad if name in grads else p.grad.clone()
    errors = {}
    for name, grad in grads.items():
        dist.all_reduce(grad)  # FSDP's mean over the context-parallel ranks
        grad /= dist.get_world_size()
        errors[name] = ((grad - expected[name]).abs().max() / expected[name].abs().max().clamp(min=1e-12)).item()
    router = [e for n, e in errors.items() if n.endswith("router.gate.weight")]
    rest = [e for n, e in errors.items() if not n.endswith("router.gate.weight")]
    return {"main": [loss_fn.losses()[0].item(), main.item()], "total": [total, loss.item()],
            "router_error": max(router), "error": max(rest), "names": len(errors) == len(expected)}


def main() -> None:
    names = sys.argv[1:] or list(CASES)  # the cases to run (default: all)
    dist.init_process_group("gloo")
    results = {name: run_case(*CASES[name]) for name in names}
    if dist.get_rank() == 0:
        print(json.dumps(results), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
