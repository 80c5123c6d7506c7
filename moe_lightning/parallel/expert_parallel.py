"""Expert parallelism: each rank of an ``ep`` group keeps ``E / ep`` experts and exchanges tokens all-to-all.

The model is untouched: the strategy slices every ``GroupedExperts`` to its local experts and swaps the
MoE layer's ``dispatcher`` for :class:`AllToAllTokenDispatcher`.
"""

import torch
import torch.distributed as dist
from torch import nn

from ..model import GroupedExperts, MoELayer
from ..model.moe import combine_weighted, sort_by_expert


class _AllToAll(torch.autograd.Function):
    """Variable-split all-to-all whose backward is the reverse exchange, times ``grad_scale``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, output_splits: list[int], input_splits: list[int], group: dist.ProcessGroup,
                grad_scale: float) -> torch.Tensor:
        ctx.output_splits, ctx.input_splits, ctx.group, ctx.grad_scale = output_splits, input_splits, group, grad_scale
        out = x.new_empty((sum(output_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        grad_in = grad_out.new_empty((sum(ctx.input_splits), *grad_out.shape[1:]))
        dist.all_to_all_single(grad_in, grad_out.contiguous(), ctx.input_splits, ctx.output_splits, group=ctx.group)
        return grad_in * ctx.grad_scale, None, None, None, None


class AllToAllTokenDispatcher:
    """Token dispatch across an expert-parallel group (the ``TokenDispatcher`` protocol of ``model/moe.py``).

    Steps: sort token copies by global expert, exchange per-expert counts, all-to-all the tokens
    (variable splits), regroup them by local expert, run the local experts, undo the regrouping,
    all-to-all back, weight and sum into the token rows.

    Gradient scale: an expert's weight gradient sums the contributions of all ``ep`` ranks' tokens,
    and FSDP then averages it over the ``world / ep`` ranks holding the same experts, which is ``ep``
    times the data-parallel mean. The return exchange scales its backward by ``1/ep`` (shrinking the
    expert weight and input gradients) and the dispatch exchange scales by ``ep`` (restoring the input
    gradient), so every gradient equals the ``ep = 1`` run. Powers of two make both scalings exact.
    """

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.ep = dist.get_world_size(group)

    def __call__(self, x_TD, weights_TK, experts_TK, tokens_per_expert_E, experts: GroupedExperts):
        local = experts.num_experts
        x_sorted, order, token_of_row = sort_by_expert(x_TD, experts_TK)
        send_counts_PE = tokens_per_expert_E.view(self.ep, local)
        recv_counts_PE = torch.empty_like(send_counts_PE)
        dist.all_to_all_single(recv_counts_PE, send_counts_PE, group=self.group)
        send_splits, recv_splits = torch.stack([send_counts_PE.sum(1), recv_counts_PE.sum(1)]).tolist()  # one sync

        x_recv = _AllToAll.apply(x_sorted, recv_splits, send_splits, self.group, float(self.ep))
        # Received rows are grouped [source rank][local expert]; the experts want [local expert][source rank].
        expert_of_row = torch.repeat_interleave(
            torch.arange(local, device=x_TD.device).repeat(self.ep), recv_counts_PE.flatten(),
            output_size=sum(recv_splits))
        by_expert = expert_of_row.argsort(stable=True)
        y_by_expert = experts(x_recv[by_expert], recv_counts_PE.sum(0))
        y_recv = torch.empty_like(y_by_expert).index_copy_(0, by_expert, y_by_expert)  # undo without a second sort
        y_sorted = _AllToAll.apply(y_recv, send_splits, recv_splits, self.group, 1.0 / self.ep)
        return combine_weighted(y_sorted, weights_TK, order, token_of_row, x_TD)


@torch.no_grad()
def apply_expert_parallel(moe_layers: list[MoELayer], group: dist.ProcessGroup) -> None:
    """Keep this rank's contiguous block of ``E / ep`` experts and install the all-to-all dispatcher."""
    ep, ep_rank = dist.get_world_size(group), dist.get_rank(group)
    for moe in moe_layers:
        experts = moe.experts
        local = experts.num_experts // ep
        for name, param in list(experts.named_parameters(recurse=False)):
            block = param[ep_rank * local:(ep_rank + 1) * local].clone()
            setattr(experts, name, nn.Parameter(block, requires_grad=param.requires_grad))
        moe.dispatcher = AllToAllTokenDispatcher(group)
