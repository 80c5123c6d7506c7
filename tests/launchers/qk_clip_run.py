"""A few Muon steps at a high learning rate with QKClip (one process, or MoEFSDPStrategy ranks); rank 0 writes JSON:
every step's combined max logits and clip factors, the final full query/key weights, and every rank's difference
between its own rows after one more clip and a float64 reference of that clip. Launched by
tests/training/test_qk_clip.py."""

import json
import os
import re
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from torch.distributed.tensor import DTensor, distribute_tensor

from moe_lightning import MoEConfig, MoELanguageModel, TextDataModule
from moe_lightning.training.callbacks import ActivationOffload, QKClip
from moe_lightning.training.callbacks.qk_clip import attention_modules, clip_qk_
from moe_lightning.optim import Muon
from tests.support.fit_launcher import cpu_trainer, fit_arguments, fsdp_or_single, parse, world_size

# Odd row counts (wq: 3 heads x 9 = 27, wkv_b: 3 x (5 + 6) = 33): the two ranks' shards are uneven.
MLA = dict(vocab_size=320, dim=48, n_layers=3, n_heads=3, max_seq_len=32, ffn_hidden=96, n_dense_layers=1,
           num_experts=4, top_k=2, expert_hidden=32, n_shared_experts=1, attention="mla", q_lora_rank=0,
           kv_lora_rank=16, qk_nope_head_dim=5, qk_rope_head_dim=4, v_head_dim=6, init_std=0.2,
           document_masking=True, eod_token_id=10)
THRESHOLD = 4.0


class Steps(Callback):
    def __init__(self, qk_clip: QKClip):
        self.qk_clip, self.max_logits, self.gammas, self._step = qk_clip, [], [], 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step != self._step:
            self._step = trainer.global_step
            self.max_logits.append(self.qk_clip.last_max_logits.tolist())
            self.gammas.append(self.qk_clip.last_gamma.tolist())


def main() -> None:
    parser = fit_arguments()
    parser.add_argument("--ep", type=int, default=0, help="0: one process without a strategy")
    parser.add_argument("--offload", action="store_true")
    args = parse(parser)
    world = world_size()
    qk_clip = QKClip(threshold=THRESHOLD)
    steps = Steps(qk_clip)
    callbacks = [qk_clip, steps] + ([ActivationOffload(min_offload_bytes=0)] if args.offload else [])
    trainer = cpu_trainer(fsdp_or_single(not args.ep, expert_parallel_size=args.ep), callbacks, max_steps=4,
                          accumulate_grad_batches=2)
    model = MoELanguageModel(MoEConfig(**MLA), optimizer=partial(Muon, lr=0.05, adamw_lr=0.01))
    trainer.fit(model, TextDataModule(source=os.__file__, seq_len=32, batch_size=4 // world, val_fraction=0.05))
    weights = full_qk_weights(model)
    # One more clip with fixed maxima on the (sharded) weights: each rank must scale exactly its own rows as a float64
    # recomputation of the K2 rule on the gathered weights says. Every rank measures its own shard.
    max_logits_LH = torch.tensor([[8.0, 3.0, 5.0], [2.0, 6.0, 4.0], [4.5, 1.0, 9.0]])
    gamma_LH = clip_qk_(attention_modules(model), max_logits_LH, THRESHOLD, 0.5)
    expected = float64_clip(weights, max_logits_LH, THRESHOLD, 0.5)
    mine = {"rows": {}, "max_rel_diff": 0.0, "unscaled_diff": 0.0}
    for name, param in model.model.named_parameters():
        if name not in expected:
            continue
        before, after = torch.tensor(weights[name], dtype=torch.float64), expected[name]
        if isinstance(param, DTensor):  # this rank's rows of the full tensors, by the parameter's own placement
            before = distribute_tensor(before, param.device_mesh, param.placements).to_local()
            after = distribute_tensor(after, param.device_mesh, param.placements).to_local()
            param = param.to_local()
        ours = param.detach().double()
        scaled = (after != before).any(-1)
        mine["rows"][name] = len(ours)
        if scaled.any():
            mine["max_rel_diff"] = max(mine["max_rel_diff"], ((ours - after) / after).abs()[scaled].max().item())
        if (~scaled).any():
            mine["unscaled_diff"] = max(mine["unscaled_diff"], (ours - before).abs()[~scaled].max().item())
    ranks = [None] * world
    if dist.is_initialized():
        dist.all_gather_object(ranks, mine)
    else:
        ranks = [mine]
    if trainer.is_global_zero:
        Path(args.out).write_text(json.dumps({"max_logits": steps.max_logits, "gammas": steps.gammas,
                                              "weights": weights, "clip_gammas": gamma_LH.tolist(), "ranks": ranks}))


def float64_clip(weights: dict[str, list], max_logits_LH: torch.Tensor, threshold: float, alpha: float
                 ) -> dict[str, torch.Tensor]:
    """Kimi K2's rule for MLA, head by head in float64 on the gathered weights: gamma = threshold / S_h for heads
    with S_h > threshold; the head's non-rotary query rows x gamma^alpha, its rotary query rows x gamma, its
    non-rotary key rows (in wkv_b) x gamma^(1 - alpha); values and the shared rotary key (wkv_a) untouched."""
    N, R, V = MLA["qk_nope_head_dim"], MLA["qk_rope_head_dim"], MLA["v_head_dim"]
    out = {}
    for name, weight in weights.items():
        layer, kind = re.search(r"layers\.(\d+)\..*attention\.(\w+)\.weight$", name).groups()
        w = torch.tensor(weight, dtype=torch.float64)
        for h, S in enumerate(max_logits_LH[int(layer)].double().tolist()):
            gamma = threshold / S if S > threshold else 1.0
            if kind == "wq":
                w[h * (N + R):h * (N + R) + N] *= gamma ** alpha
                w[h * (N + R) + N:(h + 1) * (N + R)] *= gamma
            elif kind == "wkv_b":
                w[h * (N + V):h * (N + V) + N] *= gamma ** (1 - alpha)
        out[name] = w
    return out


def full_qk_weights(model: MoELanguageModel) -> dict[str, list]:
    """Every attention projection QK-clip touches, gathered whole (a collective: every rank calls it)."""
    weights = {}
    for name, param in model.model.named_parameters():
        if name.endswith(("attention.wq.weight", "attention.wkv_b.weight", "attention.wkv_a.weight")):
            full = param.full_tensor() if isinstance(param, DTensor) else param
            weights[name] = full.detach().tolist()
    return weights


if __name__ == "__main__":
    main()
