"""The plain data-parallel training loop the expert-parallel launchers share: no Lightning, no FSDP, experts sliced
by ``apply_expert_parallel`` (their gradient is the data-parallel mean through the exchange's scaling), every other
gradient averaged over the ranks by hand."""

from collections.abc import Iterable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from moe_lightning.model import MoETransformer


def train_steps(model: MoETransformer, optimizer: torch.optim.Optimizer, batches: Iterable[torch.Tensor]
                ) -> list[float]:
    """One optimizer step per ``[B, S + 1]`` token batch; returns each step's loss averaged over the ranks."""
    world = dist.get_world_size()
    expert_params = {id(p) for moe in model.moe_layers() for p in moe.experts.parameters()}
    losses = []
    for tokens in batches:
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        optimizer.zero_grad()
        loss.backward()
        for p in model.parameters():
            if id(p) not in expert_params and p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad /= world
        optimizer.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    return losses
