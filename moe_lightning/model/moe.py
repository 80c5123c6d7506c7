"""Mixture-of-Experts FFN: router, grouped experts, replaceable token dispatch, load balancing.

Shapes: T tokens, D model dim, E experts, F expert hidden, K experts per token.
"""

from collections.abc import Callable
from functools import partial
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from moe_lightning.model.attention import SequenceShard
from moe_lightning.model.config import MoEConfig
from moe_lightning.model.grouped_mm import grouped_linear, use_grouped_mm
from moe_lightning.model.layers import SwiGLU, autocast_dtype, gated_down


class _Fp32Linear(torch.autograd.Function):
    """``x.float() @ w.float().T`` keeping ``x`` and ``w`` as given (bf16 under FSDP) for backward.

    Autograd would keep the fp32 copies: 4 bytes per token per input feature, and once the weight's.
    The router's input is the norm output, which the shared experts keep anyway.
    """

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return F.linear(x.float(), w.float())

    @staticmethod
    def backward(ctx, grad_out):
        x, w = ctx.saved_tensors
        return (grad_out @ w.float()).to(x.dtype), (grad_out.T @ x.float()).to(w.dtype)


class Router(nn.Module):
    """Scores experts in fp32 and picks the top-k per token.

    ``expert_bias`` is the aux-loss-free balancing bias: it shifts which experts are *selected* but
    never the weights they receive. It is a buffer (no gradient); ``update_bias`` moves it.
    """

    def __init__(self, config: MoEConfig):
        super().__init__()
        self.num_experts, self.top_k = config.num_experts, config.top_k
        self.score_func, self.route_norm, self.route_scale = config.score_func, config.route_norm, config.route_scale
        self.n_groups, self.n_limited_groups = config.n_expert_groups, config.n_limited_groups
        self.group_score = config.group_score
        self.gate = nn.Linear(config.dim, config.num_experts, bias=False)
        self.register_buffer("expert_bias", torch.zeros(config.num_experts, dtype=torch.float32))

    def forward(self, x_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Returns ``(weights_TK, experts_TK, scores_TE, logits_TE)``; scores and logits in fp32."""
        with torch.autocast(x_TD.device.type, enabled=False):  # fp32 even under bf16-mixed
            logits_TE = _Fp32Linear.apply(x_TD, self.gate.weight)
        scores_TE = logits_TE.softmax(-1) if self.score_func == "softmax" else logits_TE.sigmoid()
        selection_TE = scores_TE.detach() + self.expert_bias
        if self.n_groups > 1:
            selection_TE = self._mask_unselected_groups(selection_TE)
        experts_TK = selection_TE.topk(self.top_k, dim=-1).indices
        weights_TK = scores_TE.gather(-1, experts_TK)
        if self.route_norm:
            weights_TK = weights_TK / (weights_TK.sum(-1, keepdim=True) + 1e-20)
        return weights_TK * self.route_scale, experts_TK, scores_TE, logits_TE

    def _mask_unselected_groups(self, selection_TE: torch.Tensor) -> torch.Tensor:
        """Group-limited routing: keep the ``n_limited_groups`` groups with the best top-2 score sum (or best score)."""
        grouped_TGe = selection_TE.unflatten(-1, (self.n_groups, -1))
        top_in_group = 1 if self.group_score == "max" else min(2, grouped_TGe.shape[-1])
        group_score_TG = grouped_TGe.topk(top_in_group, dim=-1).values.sum(-1)
        keep_TG = torch.zeros_like(group_score_TG, dtype=torch.bool)
        keep_TG.scatter_(-1, group_score_TG.topk(self.n_limited_groups, dim=-1).indices, True)
        return grouped_TGe.masked_fill(~keep_TG[..., None], float("-inf")).flatten(-2)

    @torch.no_grad()
    def update_bias(self, tokens_per_expert_E: torch.Tensor, rate: float) -> None:
        """Raise the bias of under-loaded experts and lower over-loaded ones by ``rate`` (sign rule)."""
        load_E = tokens_per_expert_E.float()
        self.expert_bias += rate * torch.sign(load_E.mean() - load_E)

    def init_weights(self, std: float) -> None:
        nn.init.normal_(self.gate.weight, std=std)
        self.expert_bias.zero_()


class GroupedExperts(nn.Module):
    """All routed experts of a layer as 3-D stacks ``[E, out, in]`` so each expert is one matrix.

    Input tokens must already be sorted by expert; ``tokens_per_expert_E`` gives the group sizes.
    The weights here may be a subset of experts (expert parallelism hands each rank its slice).
    """

    def __init__(self, num_experts: int, dim: int, hidden: int):
        super().__init__()
        self.w1_EFD = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.w3_EFD = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.w2_EDF = nn.Parameter(torch.empty(num_experts, dim, hidden))

    @property
    def num_experts(self) -> int:
        return self.w1_EFD.shape[0]

    def forward(self, x_TD: torch.Tensor, tokens_per_expert_E: torch.Tensor,
                scale_T1: torch.Tensor | None = None) -> torch.Tensor:
        """Each row through its expert, times its routing weight ``scale_T1`` if given."""
        x_TD = x_TD.to(autocast_dtype(x_TD))
        scale_T1 = scale_T1.to(x_TD.dtype) if scale_T1 is not None else None
        if not use_grouped_mm(x_TD, self.w1_EFD.shape[1]):
            return self.forward_loop(x_TD, tokens_per_expert_E, scale_T1)
        w1, w3 = (w.to(x_TD.dtype) for w in (self.w1_EFD, self.w3_EFD))
        offsets_E = torch.cumsum(tokens_per_expert_E, dim=0, dtype=torch.int32)
        gate_TF, up_TF = grouped_linear(x_TD, w1, offsets_E), grouped_linear(x_TD, w3, offsets_E)
        return gated_down(gate_TF, up_TF, self.w2_EDF, scale_T1, offsets_E)

    def forward_loop(self, x_TD: torch.Tensor, tokens_per_expert_E: torch.Tensor,
                     scale_T1: torch.Tensor | None = None) -> torch.Tensor:
        """Plain per-expert loop: the reference the grouped path is tested against, and the fallback."""
        if scale_T1 is None:
            scale_T1 = x_TD.new_ones(x_TD.shape[0], 1)
        outputs = []
        counts = tokens_per_expert_E.tolist()
        for e, (x_tD, scale_t1) in enumerate(zip(torch.split(x_TD, counts), torch.split(scale_T1, counts))):
            hidden_tF = F.silu(x_tD @ self.w1_EFD[e].T) * (x_tD @ self.w3_EFD[e].T) * scale_t1
            outputs.append(hidden_tF @ self.w2_EDF[e].T)
        return torch.cat(outputs) if outputs else x_TD.new_zeros(0, self.w2_EDF.shape[1])

    def init_weights(self, std: float, out_std: float) -> None:
        nn.init.normal_(self.w1_EFD, std=std)
        nn.init.normal_(self.w3_EFD, std=std)
        nn.init.normal_(self.w2_EDF, std=out_std)


class TokenDispatcher(Protocol):
    """How routed tokens reach their experts and come back. A strategy may replace it (e.g. all-to-all).

    ``overlap`` is work that needs no exchange (the shared experts): a dispatcher that exchanges runs it while
    the tokens are in flight. Its output is added to the routed output."""

    def __call__(self, x_TD: torch.Tensor, weights_TK: torch.Tensor, experts_TK: torch.Tensor,
                 tokens_per_expert_E: torch.Tensor, experts: GroupedExperts,
                 overlap: Callable[[], torch.Tensor] | None = None) -> torch.Tensor: ...


def sort_by_expert(x_TD: torch.Tensor, weights_TK: torch.Tensor, experts_TK: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One row per (token, choice), grouped by expert: ``(x_sorted, weight_of_row [R, 1], token_of_row)``."""
    order = experts_TK.flatten().argsort(stable=True)
    token_of_row = order // experts_TK.shape[1]
    return x_TD[token_of_row], weights_TK.flatten()[order, None], token_of_row


def sum_into_tokens(y_sorted: torch.Tensor, token_of_row: torch.Tensor, x_TD: torch.Tensor) -> torch.Tensor:
    """Undo ``sort_by_expert``: add each (already weighted) expert output into its token's row.

    ``index_put_`` keeps only the indices for backward (``index_add_`` would keep the rows too)."""
    return x_TD.new_zeros(x_TD.shape).index_put_((token_of_row,), y_sorted.to(x_TD.dtype), accumulate=True)


class LocalTokenDispatcher:
    """Single-device dispatch: sort token copies by expert, run the experts (weighted), sum back into tokens."""

    def __call__(self, x_TD, weights_TK, experts_TK, tokens_per_expert_E, experts, overlap=None):
        x_sorted, weight_of_row, token_of_row = sort_by_expert(x_TD, weights_TK, experts_TK)
        y_TD = sum_into_tokens(experts(x_sorted, tokens_per_expert_E, weight_of_row), token_of_row, x_TD)
        return y_TD if overlap is None else y_TD + overlap()


class _AttachAuxLoss(torch.autograd.Function):
    """Identity on ``y`` whose backward also sends ``grad_scale`` into ``aux_loss``.

    This puts the balancing losses into the gradient without the model returning them, so every
    block stays a plain ``Tensor -> Tensor`` function (what FSDP, checkpointing and offload wrap).
    """

    @staticmethod
    def forward(ctx, y, aux_loss, grad_scale: float):
        ctx.grad_scale = grad_scale
        ctx.aux_shape = aux_loss.shape
        return y

    @staticmethod
    def backward(ctx, grad_y):
        aux_grad = torch.full(ctx.aux_shape, ctx.grad_scale, device=grad_y.device, dtype=torch.float32)
        return grad_y, aux_grad, None


class MoELayer(nn.Module):
    """Routed experts (+ optional shared experts) with balancing losses and per-expert token counts.

    After each forward, ``tokens_per_expert`` holds this batch's counts and ``aux_loss`` the detached
    balancing loss (for logging). ``aux_loss_grad_scale`` lets the trainer divide the balancing
    gradient like the main loss under gradient accumulation.
    """

    def __init__(self, config: MoEConfig):
        super().__init__()
        self.router = Router(config)
        self.experts = GroupedExperts(config.num_experts, config.dim, config.expert_hidden)
        self.shared_experts = (SwiGLU(config.dim, config.expert_hidden * config.n_shared_experts)
                               if config.n_shared_experts else None)
        self.dispatcher: TokenDispatcher = LocalTokenDispatcher()
        self.top_k, self.num_experts = config.top_k, config.num_experts
        self.aux_loss_coef, self.z_loss_coef = config.aux_loss_coef, config.z_loss_coef
        self.aux_loss_grad_scale = 1.0
        self.tokens_per_expert: torch.Tensor | None = None
        self.aux_loss: torch.Tensor | None = None

    def forward(self, x_BSD: torch.Tensor, sequence_shard: SequenceShard | None = None) -> torch.Tensor:
        """``sequence_shard``: ``x`` holds this rank's positions of each sequence (context parallelism); the
        balancing losses are then completed over the ranks that hold the others."""
        B, S, D = x_BSD.shape
        x_TD = x_BSD.reshape(-1, D)
        weights_TK, experts_TK, scores_TE, logits_TE = self.router(x_TD)
        self.tokens_per_expert = self._count_tokens(experts_TK)
        shared = partial(self.shared_experts, x_TD) if self.shared_experts is not None else None
        y_TD = self.dispatcher(x_TD, weights_TK, experts_TK, self.tokens_per_expert, self.experts, overlap=shared)
        y_BSD = y_TD.view(B, S, D)
        aux_loss = self._balancing_loss(scores_TE.view(B, S, -1), experts_TK.view(B, S, -1),
                                        logits_TE.view(B, S, -1), sequence_shard)
        if aux_loss is None:
            self.aux_loss = None
            return y_BSD
        self.aux_loss = aux_loss.detach()
        if torch.is_grad_enabled() and aux_loss.requires_grad:
            y_BSD = _AttachAuxLoss.apply(y_BSD, aux_loss, self.aux_loss_grad_scale)
        return y_BSD

    def _count_tokens(self, experts_TK: torch.Tensor) -> torch.Tensor:
        """Tokens per expert without a host sync (``torch.bincount`` on CUDA reads the min and max back)."""
        flat = experts_TK.flatten()
        return flat.new_zeros(self.num_experts).scatter_add_(0, flat, torch.ones_like(flat))

    def _balancing_loss(self, scores_BSE, experts_BSK, logits_BSE,
                        sequence_shard: SequenceShard | None) -> torch.Tensor | None:
        """Sequence-level balance loss ``coef * E/(K*S) * sum_e f_e * P_e`` (per sequence, averaged over the batch)
        + router z-loss ``coef * mean(logsumexp(logits)^2)``, both from per-sequence sums (positions, expert counts
        f, routing probabilities P, squared log-sum-exps) that a ``sequence_shard`` completes over its ranks."""
        if not (self.aux_loss_coef > 0 or self.z_loss_coef > 0):
            return None
        B, S, E = scores_BSE.shape
        sums = [scores_BSE.new_full((B, 1), S)]
        if self.aux_loss_coef > 0:
            probs_BSE = scores_BSE / scores_BSE.sum(-1, keepdim=True)
            counts_BE = torch.zeros_like(probs_BSE[:, 0]).scatter_add_(
                1, experts_BSK.flatten(1), torch.ones_like(experts_BSK.flatten(1), dtype=probs_BSE.dtype))
            sums += [counts_BE, probs_BSE.sum(1)]
        if self.z_loss_coef > 0:
            sums.append(torch.logsumexp(logits_BSE, dim=-1).square().sum(1, keepdim=True))
        sums_BX = torch.cat(sums, dim=-1)
        if sequence_shard is not None:
            sums_BX = sequence_shard.sum_over_sequence(sums_BX)
        length_B1, terms = sums_BX[:, :1], []
        if self.aux_loss_coef > 0:
            counts_BE, probs_sum_BE = sums_BX[:, 1:1 + E], sums_BX[:, 1 + E:1 + 2 * E]
            load_fraction_BE = counts_BE * E / (self.top_k * length_B1)
            terms.append(self.aux_loss_coef * (load_fraction_BE * probs_sum_BE / length_B1).sum(-1).mean())
        if self.z_loss_coef > 0:
            terms.append(self.z_loss_coef * sums_BX[:, -1].sum() / length_B1.sum())
        return sum(terms)

    def init_weights(self, std: float, out_std: float) -> None:
        self.router.init_weights(std)
        self.experts.init_weights(std, out_std)
        if self.shared_experts is not None:
            self.shared_experts.init_weights(std, out_std)
