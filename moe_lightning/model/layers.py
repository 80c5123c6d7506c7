"""Small building blocks shared by attention and FFN code: RMSNorm, SwiGLU (rotary embeddings: ``rotary.py``)."""

import torch
import torch.nn.functional as F
from torch import nn

from moe_lightning.model.loss import chunked_cross_entropy
from moe_lightning.model.grouped_mm import grouped_linear, grouped_weight_grad


class _RMSNormFunction(torch.autograd.Function):
    """RMSNorm that keeps only its input (as given: bf16 under FSDP) and the fp32 reciprocal RMS for backward.

    Autograd through the plain formula keeps an fp32 copy of the input and the bf16 normalized tensor too
    (6 more bytes per element); backward recomputes both from these two, elementwise.
    """

    @staticmethod
    def forward(ctx, x, weight, eps: float):
        x_fp32 = x.float()
        rrms = torch.rsqrt(x_fp32.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rrms)
        return (x_fp32 * rrms).type_as(x) * weight

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, rrms = ctx.saved_tensors
        normed = x.float() * rrms
        grad_weight = (grad_out * normed.type_as(x)).flatten(0, -2).sum(0).to(weight.dtype)
        grad_normed = (grad_out * weight).float()
        grad_x = rrms * (grad_normed - normed * (grad_normed * normed).mean(-1, keepdim=True))
        return grad_x.type_as(x), grad_weight, None


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _RMSNormFunction.apply(x, self.weight, self.eps)

    def init_weights(self) -> None:
        nn.init.ones_(self.weight)


class OutputHead(nn.Linear):
    """The output projection, with a second entry point besides ``forward``: the chunked loss.

    ``cross_entropy`` reads the weight without building the ``[tokens, vocab]`` logits (``cross_entropy_sums``:
    several at once, for multi-token prediction). They are methods of the head module, not free functions handed
    ``head.weight``, so that a wrapper sees the head run: FSDP2
    registers it as a forward method (``register_fsdp_forward_method``), gathers the weight around it, and
    the head's unit completes its forward in every step, validation included (torch 2.11 otherwise keeps the
    unit "mid-forward" after a validation, and a checkpoint's reshard then breaks the next step).
    """

    def cross_entropy(self, h_TD: torch.Tensor, targets_T: torch.Tensor, chunk_size: int) -> torch.Tensor:
        return chunked_cross_entropy(h_TD, self.weight, targets_T, chunk_size)

    def cross_entropy_sums(self, hs_TD: list[torch.Tensor], targets: list[torch.Tensor],
                           chunk_size: int | None) -> list[torch.Tensor]:
        """Summed cross-entropy of each ``(h_TD, targets_T)`` pair (multi-token prediction's depths) in one call
        of the head, chunked or not."""
        return [F.cross_entropy(F.linear(h_TD, self.weight).float(), targets_T, reduction="sum") if chunk_size is None
                else chunked_cross_entropy(h_TD, self.weight, targets_T, chunk_size, reduction="sum")
                for h_TD, targets_T in zip(hs_TD, targets)]


def autocast_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype autocast would compute matmuls in, else ``x``'s (for ops autocast does not cover:
    ``_grouped_mm``, FlexAttention)."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def _gated(gate, up, scale):
    hidden = F.silu(gate) * up
    return hidden if scale is None else hidden * scale


def _down(hidden, w_OI, offsets_E):
    return F.linear(hidden, w_OI) if offsets_E is None else grouped_linear(hidden, w_OI, offsets_E)


class _GatedDown(torch.autograd.Function):
    """``down(silu(gate) * up * scale)`` keeping only ``gate``, ``up`` and ``scale`` for backward.

    Autograd would also keep ``silu(gate)``, the product and the scaled product (the down projection's
    input): per token three more hidden-width tensors, all cheap to recompute. ``down`` is ``F.linear``
    with ``w_OI`` ``[out, in]``, or with ``offsets_E`` the grouped expert projection with ``w_OI``
    ``[E, out, in]``. ``scale`` (optional, ``[T, 1]``) is the routing weight: applied before the (linear)
    down projection it gives the same result as weighting the output, which then need not be kept.
    """

    @staticmethod
    def forward(ctx, gate, up, scale, w_OI, offsets_E):
        ctx.save_for_backward(gate, up, scale, w_OI, offsets_E)
        return _down(_gated(gate, up, scale), w_OI, offsets_E)

    @staticmethod
    def backward(ctx, grad_out):
        gate, up, scale, w_OI, offsets_E = ctx.saved_tensors
        silu_gate = F.silu(gate)
        hidden = silu_gate * up if scale is None else silu_gate * up * scale
        if offsets_E is None:
            grad_hidden = grad_out @ w_OI
            grad_w = (grad_out.flatten(0, -2).T @ hidden.flatten(0, -2)) if ctx.needs_input_grad[3] else None
        else:
            grad_hidden = grouped_linear(grad_out, w_OI.transpose(-2, -1), offsets_E)
            grad_w = grouped_weight_grad(grad_out, hidden, offsets_E) if ctx.needs_input_grad[3] else None
        grad_scale = None
        if scale is not None:
            grad_scale = (grad_hidden * silu_gate * up).sum(-1, keepdim=True) if ctx.needs_input_grad[2] else None
            grad_hidden = grad_hidden * scale
        grad_up = grad_hidden * silu_gate
        grad_gate = torch.ops.aten.silu_backward(grad_hidden * up, gate)
        return grad_gate, grad_up, grad_scale, grad_w, None


def gated_down(gate: torch.Tensor, up: torch.Tensor, w_OI: torch.Tensor, scale: torch.Tensor | None = None,
               offsets_E: torch.Tensor | None = None) -> torch.Tensor:
    """``down(silu(gate) * up [* scale])`` with weight ``w_OI`` cast to the activations' dtype (see ``_GatedDown``)."""
    return _GatedDown.apply(gate, up, scale, w_OI.to(gate.dtype), offsets_E)


class SwiGLU(nn.Module):
    """Dense FFN ``w2(silu(w1 x) * w3 x)``; also used for the shared experts."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gated_down(self.w1(x), self.w3(x), self.w2.weight)

    def init_weights(self, std: float, out_std: float) -> None:
        nn.init.normal_(self.w1.weight, std=std)
        nn.init.normal_(self.w3.weight, std=std)
        nn.init.normal_(self.w2.weight, std=out_std)
