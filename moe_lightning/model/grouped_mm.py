"""``torch._grouped_mm`` as custom ops, so ``torch.compile`` can trace the experts in any dtype.

``_grouped_mm``'s own fake (meta) kernel accepts only bf16 (seen on torch 2.13), so compiling a block in fp32
fails; these ops carry their own shape-only fakes and run the real kernel unchanged. Compiled graphs call
them as opaque kernels. ``torch.library.custom_op`` and ``register_autograd`` exist since torch 2.4.

Rows of ``x_TI`` are grouped by expert; ``offsets_E`` (int32) holds the cumulative group ends.
"""

import torch


@torch.library.custom_op("moe_lightning::grouped_linear", mutates_args=())
def grouped_linear(x_TI: torch.Tensor, w_EOI: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
    """Per group ``e``: ``y = x @ w_EOI[e].T`` (``nn.Linear`` layout ``[out, in]``); returns ``[T, O]``."""
    return torch._grouped_mm(x_TI, w_EOI.transpose(-2, -1), offs=offsets_E)


@grouped_linear.register_fake
def _(x_TI, w_EOI, offsets_E):
    return x_TI.new_empty(x_TI.shape[0], w_EOI.shape[1])


@torch.library.custom_op("moe_lightning::grouped_weight_grad", mutates_args=())
def grouped_weight_grad(grad_TO: torch.Tensor, x_TI: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
    """The weight gradient of :func:`grouped_linear`: per group ``grad.T @ x``, stacked ``[E, O, I]``.

    A group with no rows gets an exact zero: ``_grouped_mm`` leaves it unwritten on some GPUs (Blackwell,
    ROCm; pytorch issues 172439, 174314). The mask is on device, without a host sync."""
    grad_w_EOI = torch._grouped_mm(grad_TO.transpose(0, 1), x_TI, offs=offsets_E)
    counts_E = torch.diff(offsets_E, prepend=offsets_E.new_zeros(1))
    return torch.where(counts_E[:, None, None] > 0, grad_w_EOI, 0)


@grouped_weight_grad.register_fake
def _(grad_TO, x_TI, offsets_E):
    return grad_TO.new_empty(offsets_E.shape[0], grad_TO.shape[1], x_TI.shape[1])


def _setup_context(ctx, inputs, output):
    x_TI, w_EOI, offsets_E = inputs
    ctx.save_for_backward(x_TI, w_EOI, offsets_E)


def _backward(ctx, grad_TO):
    x_TI, w_EOI, offsets_E = ctx.saved_tensors
    grad_x = grouped_linear(grad_TO, w_EOI.transpose(-2, -1), offsets_E) if ctx.needs_input_grad[0] else None
    grad_w = grouped_weight_grad(grad_TO, x_TI, offsets_E) if ctx.needs_input_grad[1] else None
    return grad_x, grad_w, None


grouped_linear.register_autograd(_backward, setup_context=_setup_context)
