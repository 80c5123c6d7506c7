"""Context parallelism on real gloo ranks against one process: for MLA and GQA, document masking off and on, and MLA
with documents and both balancing losses, every rank builds the same model and batch, computes the whole-sequence
forward and backward alone (the reference), then its head-tail shard under ``ContextParallelShard``; gradients are
averaged over the ranks as FSDP does. Counts the bytes each collective call puts on the wire. Rank 0 writes JSON.
Launched by tests/parallel/test_context_parallel.py.
"""

import argparse
import copy
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from moe_lightning.model import MoEConfig, MoETransformer
from moe_lightning.model.loss import context_parallel_mean
from moe_lightning.parallel.context_parallel import ContextParallelShard

B, S, EOD = 2, 64, 3
SHAPE = dict(vocab_size=64, dim=32, n_layers=3, n_heads=4, n_kv_heads=2, max_seq_len=S, ffn_hidden=64,
             n_dense_layers=1, num_experts=4, top_k=2, expert_hidden=16, q_lora_rank=0, kv_lora_rank=12,
             qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, init_std=0.3, eod_token_id=EOD)
# large enough that the balancing losses' share of the router gradient dwarfs the tolerance
BALANCE = dict(aux_loss_coef=0.5, z_loss_coef=0.05)
CASES = {"mla-causal": ("mla", False, {}), "mla-docs": ("mla", True, {}), "gqa-causal": ("gqa", False, {}),
         "gqa-docs": ("gqa", True, {}), "mla-docs-balance": ("mla", True, BALANCE)}


class WireCounter:
    """Wraps the two collectives the exchange uses; records what each rank sends per call (ring algorithms:
    an all-gather forwards N-1 shards of its input's size, a reduce-scatter N-1 of N slices of its input). Also
    records the size of each all-reduce (the balancing losses' sums)."""

    def __init__(self):
        self.calls: list[tuple[str, int]] = []
        self.reduces: list[int] = []
        self._gather, self._scatter, self._reduce = dist.all_gather_into_tensor, dist.reduce_scatter_tensor, dist.all_reduce

        def gather(out, inp, *args, **kwargs):
            self.calls.append(("all_gather", inp.numel() * inp.element_size() * (dist.get_world_size() - 1)))
            return self._gather(out, inp, *args, **kwargs)

        def scatter(out, inp, *args, **kwargs):
            n = dist.get_world_size()
            self.calls.append(("reduce_scatter", inp.numel() * inp.element_size() * (n - 1) // n))
            return self._scatter(out, inp, *args, **kwargs)
        def reduce(tensor, *args, **kwargs):
            self.reduces.append(tensor.numel() * tensor.element_size())
            return self._reduce(tensor, *args, **kwargs)
        dist.all_gather_into_tensor, dist.reduce_scatter_tensor, dist.all_reduce = gather, scatter, reduce


def batch(seed: int) -> torch.Tensor:
    """``[B, S + 1]`` tokens with a few documents per row; some targets ignored."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(4, SHAPE["vocab_size"], (B, S + 1), generator=g)
    tokens[0, [9, 30, 31, 50]] = EOD
    tokens[1, [20, 44]] = EOD
    return tokens


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    N = dist.get_world_size()
    counter = WireCounter()
    shard = ContextParallelShard(dist.group.WORLD)
    results = {}
    for case, (attention, masking, losses) in CASES.items():
        torch.manual_seed(0)
        config = MoEConfig(**SHAPE, attention=attention, document_masking=masking, **losses)
        reference = MoETransformer(config)
        tokens = batch(1)
        inputs_BS, targets_BS = tokens[:, :-1], tokens[:, 1:].clone()
        targets_BS[0, :5] = -100
        for attn in (block.attention for block in reference.layers):
            attn.record_max_logits = True
        sharded, unbalanced = copy.deepcopy(reference), copy.deepcopy(reference)
        # the reference: one process, the whole sequence, the mean over the batch's targets
        loss = F.cross_entropy(reference(inputs_BS).flatten(0, 1), targets_BS.flatten())
        loss.backward()
        balance_share = 0.0  # how far the balancing losses move the router gradient
        if losses:
            for moe in unbalanced.moe_layers():
                moe.aux_loss_coef = moe.z_loss_coef = 0.0
            F.cross_entropy(unbalanced(inputs_BS).flatten(0, 1), targets_BS.flatten()).backward()
            for moe, plain in zip(reference.moe_layers(), unbalanced.moe_layers()):
                with_losses, without = moe.router.gate.weight.grad, plain.router.gate.weight.grad
                balance_share = max(balance_share, ((with_losses - without).norm() / with_losses.norm()).item())
        # this rank's shard: N x its sum over the group's target count, gradients averaged as FSDP does
        sharded.sequence_shard = shard
        counter.calls.clear()
        counter.reduces.clear()
        logits_BsV = sharded(inputs_BS)
        total = F.cross_entropy(logits_BsV.flatten(0, 1), shard.local(targets_BS).flatten(), reduction="sum")
        local_loss = context_parallel_mean(total, targets_BS, N)
        forward_calls, forward_reduces = list(counter.calls), list(counter.reduces)
        local_loss.backward()
        backward_calls = counter.calls[len(forward_calls):]
        backward_reduces = counter.reduces[len(forward_reduces):]
        cp_loss = local_loss.detach().clone()
        dist.all_reduce(cp_loss)
        grad_error = 0.0
        for (name, p_ref), p in zip(reference.named_parameters(), sharded.parameters()):
            grad = p.grad.clone()
            dist.all_reduce(grad)
            grad /= N
            scale = p_ref.grad.abs().max().clamp(min=1e-30)
            grad_error = max(grad_error, ((grad - p_ref.grad).abs().max() / scale).item())
        max_ref = torch.stack([a.max_logits for a in (b.attention for b in reference.layers)])
        max_cp = torch.stack([b.attention.max_logits for b in sharded.layers])
        dist.all_reduce(max_cp, op=dist.ReduceOp.MAX)  # as QK-clip combines every rank's maxima
        width = (config.kv_lora_rank + config.qk_rope_head_dim if attention == "mla"
                 else 2 * config.n_kv_heads * config.head_dim)
        aux_ref = [m.aux_loss.item() for m in reference.moe_layers() if m.aux_loss is not None]
        aux_cp = [m.aux_loss.item() for m in sharded.moe_layers() if m.aux_loss is not None]
        results[case] = dict(
            loss=loss.item(), cp_loss=cp_loss.item() / N, grad_rel_error=grad_error,
            max_logit_error=(max_cp - max_ref).abs().max().item(),
            aux_losses=aux_ref, cp_aux_losses=aux_cp, balance_share=balance_share,
            forward_reduces=forward_reduces, backward_reduces=backward_reduces,
            forward_calls=forward_calls, backward_calls=backward_calls,
            expected_bytes=B * S * width * 4 * (N - 1) // N, layers=config.n_layers)
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
