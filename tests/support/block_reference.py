"""References for the block's numerics and memory, shared by tests and ``benchmarks/block_memory.py``.

- ``plain_computation()``: the block computation as it was before the lean autograd functions (commit
  437294b), swapped into the model classes so the same modules (same parameters) run both ways.
- ``saved_bytes``: what autograd keeps for backward, counted with saved-tensor hooks.
- ``fused_attention()``: SDPA keeping what fused GPU kernels keep (the CPU math kernel keeps ``S x S``
  probabilities instead), so CPU counts match a GPU run.
"""

import contextlib
from unittest import mock

import torch
import torch.nn.functional as F

from moe_lightning.model import moe
from moe_lightning.model.transformer import Block
from moe_lightning.model.layers import RMSNorm, SwiGLU, autocast_dtype


def rmsnorm_forward(self, x):
    x_fp32 = x.float()
    normed = x_fp32 * torch.rsqrt(x_fp32.pow(2).mean(-1, keepdim=True) + self.eps)
    return normed.type_as(x) * self.weight


def swiglu_forward(self, x):
    return self.w2(F.silu(self.w1(x)) * self.w3(x))


def fp32_linear(x, w):
    return F.linear(x.float(), w.float())


def grouped_experts_forward(self, x_TD, tokens_per_expert_E):
    x_TD = x_TD.to(autocast_dtype(x_TD))
    w1, w3, w2 = (w.to(x_TD.dtype).transpose(-2, -1) for w in (self.w1_EFD, self.w3_EFD, self.w2_EDF))
    offsets_E = torch.cumsum(tokens_per_expert_E, dim=0, dtype=torch.int32)
    gate_TF = torch._grouped_mm(x_TD, w1, offs=offsets_E)
    up_TF = torch._grouped_mm(x_TD, w3, offs=offsets_E)
    return torch._grouped_mm(F.silu(gate_TF) * up_TF, w2, offs=offsets_E)


def local_dispatch(self, x_TD, weights_TK, experts_TK, tokens_per_expert_E, experts, overlap=None):
    order = experts_TK.flatten().argsort(stable=True)
    token_of_row = order // experts_TK.shape[1]
    y_sorted = grouped_experts_forward(experts, x_TD[token_of_row], tokens_per_expert_E)
    y_weighted = y_sorted * weights_TK.flatten()[order, None].to(y_sorted.dtype)
    y_TD = x_TD.new_zeros(x_TD.shape).index_add_(0, token_of_row, y_weighted.to(x_TD.dtype))
    return y_TD if overlap is None else y_TD + overlap()  # the shared experts, handed over by the MoE layer


def bincount(self, experts_TK):
    return torch.bincount(experts_TK.flatten(), minlength=self.num_experts)


@contextlib.contextmanager
def plain_computation():
    """Run norms, SwiGLU, router, experts and local dispatch through plain autograd, as before."""
    with contextlib.ExitStack() as stack:
        for target, name, value in ((RMSNorm, "forward", rmsnorm_forward), (SwiGLU, "forward", swiglu_forward),
                                    (moe._Fp32Linear, "apply", staticmethod(fp32_linear)),
                                    (moe.LocalTokenDispatcher, "__call__", local_dispatch),
                                    (moe.MoELayer, "_count_tokens", bincount)):
            stack.enter_context(mock.patch.object(target, name, value))
        yield


def saved_bytes(fn, *args, exclude=()) -> int:
    """Bytes of the distinct storages autograd saves for backward while ``fn(*args)`` runs.

    Storages of ``exclude`` tensors (parameters, the input) are not counted: they exist anyway.
    A storage saved twice (a tensor and its view) counts once, as it occupies memory once.
    """
    excluded = {t.untyped_storage().data_ptr() for t in exclude}
    saved: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in excluded:
            saved[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args)
    del out
    return sum(saved.values())


SDPA = F.scaled_dot_product_attention  # the real kernel, before fused_attention() patches it


class _FusedAttentionSaves(torch.autograd.Function):
    """Causal SDPA keeping for backward what fused GPU kernels keep: q, k, v, the output (laid out like q,
    ``[B, S, H, V]`` in memory) and an fp32 ``[B, H, S]`` log-sum-exp (a placeholder of that size here:
    backward recomputes through the math path)."""

    @staticmethod
    def forward(ctx, q, k, v, scale, enable_gqa):
        ctx.scale, ctx.enable_gqa = scale, enable_gqa
        out = SDPA(q, k, v, is_causal=True, scale=scale, enable_gqa=enable_gqa)
        out = out.transpose(1, 2).contiguous().transpose(1, 2)
        ctx.save_for_backward(q, k, v, out, q.new_empty(q.shape[:-1], dtype=torch.float32))
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, _, _ = ctx.saved_tensors
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_() for t in (q, k, v)]
            out = SDPA(*leaves, is_causal=True, scale=ctx.scale, enable_gqa=ctx.enable_gqa)
            return (*torch.autograd.grad(out, leaves, grad_out), None, None)


def _fused_sdpa(q, k, v, is_causal=False, scale=None, enable_gqa=False, **kwargs):
    if not is_causal or kwargs:
        raise NotImplementedError("the fused-kernel emulation covers plain causal attention only")
    return _FusedAttentionSaves.apply(q, k, v, scale, enable_gqa)


def fused_attention():
    return mock.patch.object(F, "scaled_dot_product_attention", _fused_sdpa)


def half_saved_bytes(block: Block, x_BSD: torch.Tensor, half: str, plain: bool = False) -> int:
    """What ``half`` (``attention``: ``x + attention(norm(x))``, ``ffn``: ``h + ffn(norm(h))``) keeps.

    The attention half's input is the block input (a boundary activation, counted apart); the FFN half's
    input is made inside the block, so it counts when kept.
    """
    modules = (block.attention_norm, block.attention) if half == "attention" else (block.ffn_norm, block.ffn)
    exclude = [*block.parameters(), *block.buffers()] + ([x_BSD] if half == "attention" else [])
    with fused_attention(), plain_computation() if plain else contextlib.nullcontext():
        return saved_bytes(lambda x: x + modules[1](modules[0](x)), x_BSD, exclude=exclude)
