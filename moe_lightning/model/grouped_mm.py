"""``torch._grouped_mm`` as custom ops, so ``torch.compile`` can trace the experts in any dtype.

``_grouped_mm``'s own fake (meta) kernel accepts only bf16 (seen on torch 2.13), so compiling a block in fp32
fails; these ops carry their own shape-only fakes and run the real kernel unchanged. Compiled graphs call
them as opaque kernels. ``torch.library.custom_op`` and ``register_autograd`` exist since torch 2.4.

Rows of ``x_TI`` are grouped by expert; ``offsets_E`` (int32) holds the cumulative group ends.
"""

import torch

GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # _grouped_mm_validate_inputs (GroupedMMUtils.h)


def grouped_mm_runs(device_type: str, dtype: torch.dtype, row_bytes: tuple[int, ...],
                    capability: tuple[int, int] | None, compiling: bool) -> bool:
    """Whether the experts use ``torch._grouped_mm`` (else the per-expert loop of ``GroupedExperts``).

    It runs on CPU, and on CUDA in fp32/bf16/fp16 on any GPU: bf16 on Hopper (sm90) or newer takes the fused
    kernel, everything else ``_grouped_mm_fallback`` (torch 2.11 ``ATen/native/GroupedMMUtils.h``), which
    copies the offsets to the host (``offs.cpu()``) in every call: 3 syncs per MoE layer in forward and up
    to 6 in backward, where the loop syncs once (``tolist``). So on CUDA without the fused kernel the loop runs
    in eager mode, and the fallback only under ``torch.compile``, where the loop's ``tolist`` cannot be traced
    (``fullgraph=True`` fails) but an opaque kernel may sync inside. Every operand's rows (and strides) must
    be multiples of 16 bytes on every device (``check_valid_strides_and_return_transposed``).
    """
    if dtype not in GROUPED_MM_DTYPES or any(n % 16 for n in row_bytes):
        return False
    if device_type == "cpu":
        return True
    if device_type != "cuda":
        return False
    fused = dtype == torch.bfloat16 and capability is not None and capability[0] >= 9
    return fused or compiling


def use_grouped_mm(x_TD: torch.Tensor, hidden: int) -> bool:
    """``grouped_mm_runs`` for expert inputs ``x_TD`` and expert hidden size ``hidden``."""
    cuda = x_TD.device.type == "cuda"
    return grouped_mm_runs(x_TD.device.type, x_TD.dtype, tuple(n * x_TD.element_size() for n in (x_TD.shape[-1], hidden)),
                           torch.cuda.get_device_capability(x_TD.device) if cuda else None,
                           torch.compiler.is_compiling())


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
