"""Expert parallelism: each rank of an ``ep`` group keeps ``E / ep`` experts and exchanges tokens all-to-all.

The model is untouched: the strategy slices every ``GroupedExperts`` to its local experts and swaps the
MoE layer's ``dispatcher`` for :class:`AllToAllTokenDispatcher`.
"""

import torch
import torch.distributed as dist
from torch import nn

from ..model import GroupedExperts, MoELayer
from ..model.moe import sort_by_expert, sum_into_tokens


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

    Steps: sort token copies by global expert, exchange per-expert counts, all-to-all the tokens and their
    routing weights (variable splits), regroup them by local expert, run the local experts (weighted), undo
    the regrouping, all-to-all back and sum into the token rows. Each intermediate buffer is dropped as soon
    as the next one exists (autograd keeps none of them: the exchanges save only split sizes).

    Gradient scale: an expert's weight gradient sums the contributions of all ``ep`` ranks' tokens,
    and FSDP then averages it over the ``world / ep`` ranks holding the same experts, which is ``ep``
    times the data-parallel mean. The return exchange scales its backward by ``1/ep`` (shrinking the
    expert weight and input gradients) and the dispatch exchanges scale by ``ep`` (restoring the input
    and routing-weight gradients), so every gradient equals the ``ep = 1`` run. Powers of two make both
    scalings exact.
    """

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.ep = dist.get_world_size(group)

    @torch.compiler.disable  # host-side split sizes: a compiled block runs this part eagerly
    def __call__(self, x_TD, weights_TK, experts_TK, tokens_per_expert_E, experts: GroupedExperts):
        local = experts.num_experts
        x_sorted, weight_of_row, token_of_row = sort_by_expert(x_TD, weights_TK, experts_TK)
        send_counts_PE = tokens_per_expert_E.view(self.ep, local)
        recv_counts_PE = torch.empty_like(send_counts_PE)
        dist.all_to_all_single(recv_counts_PE, send_counts_PE, group=self.group)
        send_splits, recv_splits = torch.stack([send_counts_PE.sum(1), recv_counts_PE.sum(1)]).tolist()  # one sync

        exchange = (recv_splits, send_splits, self.group, float(self.ep))
        x_recv, weight_recv = _AllToAll.apply(x_sorted, *exchange), _AllToAll.apply(weight_of_row, *exchange)
        del x_sorted, weight_of_row
        # Received rows are grouped [source rank][local expert]; the experts want [local expert][source rank].
        expert_of_row = torch.repeat_interleave(
            torch.arange(local, device=x_TD.device).repeat(self.ep), recv_counts_PE.flatten(),
            output_size=sum(recv_splits))
        by_expert = expert_of_row.argsort(stable=True)
        x_by_expert, weight_by_expert = x_recv[by_expert], weight_recv[by_expert]
        del x_recv, weight_recv
        y_by_expert = experts(x_by_expert, recv_counts_PE.sum(0), weight_by_expert)
        del x_by_expert
        # Undo the regrouping without a second sort; index_put_ keeps only the indices (index_copy_ the rows too).
        y_recv = torch.empty_like(y_by_expert).index_put_((by_expert,), y_by_expert)
        del y_by_expert
        y_sorted = _AllToAll.apply(y_recv, send_splits, recv_splits, self.group, 1.0 / self.ep)
        del y_recv
        return sum_into_tokens(y_sorted, token_of_row, x_TD)


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
