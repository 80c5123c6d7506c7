"""The lean block: same numbers as the plain computation, fewer bytes kept for backward, no host syncs."""

import dataclasses
from unittest import mock

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from moe_lightning.model import MoEConfig
from moe_lightning.model.transformer import Block
from moe_lightning.planner.plan import block_working_set_bytes
from moe_lightning.planner.run_config import load_model_config
from tests.support.block_reference import half_saved_bytes, plain_computation
from tests.support.distributed import REPO_ROOT

GQA = MoEConfig(vocab_size=64, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64, ffn_hidden=96,
                n_dense_layers=1, num_experts=8, top_k=2, expert_hidden=32, n_shared_experts=1,
                aux_loss_coef=0.01, z_loss_coef=0.001)
MLA = MoEConfig(vocab_size=64, dim=64, n_layers=2, n_heads=4, max_seq_len=64, ffn_hidden=96, n_dense_layers=1,
                num_experts=8, top_k=3, expert_hidden=32, n_shared_experts=2, score_func="sigmoid",
                route_norm=True, route_scale=2.5, n_expert_groups=4, n_limited_groups=2, aux_loss_coef=0.01,
                attention="mla", q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                v_head_dim=16)


def make_block(config: MoEConfig, moe: bool, dtype=torch.float32) -> Block:
    """O(1) activations: weights ~ 1/sqrt(fan-in), norm gains and router bias not at their trivial values."""
    torch.manual_seed(0)
    block = Block(config, config.n_dense_layers if moe else 0).to(dtype)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, p.shape[-1] ** -0.5) if p.dim() > 1 else p.uniform_(0.5, 1.5)
        if moe:
            block.ffn.router.expert_bias.normal_(0, 0.1)
    return block


def forward_and_grads(block: Block, x: torch.Tensor, grad_out: torch.Tensor):
    x = x.detach().requires_grad_()
    y = block(x)
    names, params = zip(*block.named_parameters())
    grads = torch.autograd.grad(y, [x, *params], grad_out)
    return y.detach(), dict(zip(("input", *names), grads))


@pytest.mark.parametrize("config", [GQA, MLA], ids=["gqa", "mla"])
@pytest.mark.parametrize("moe", [True, False], ids=["moe", "dense"])
def test_lean_block_equals_the_plain_computation_fp32(config, moe):
    block = make_block(config, moe)
    x, grad_out = torch.randn(2, 16, 64), torch.randn(2, 16, 64)
    y, grads = forward_and_grads(block, x, grad_out)
    with plain_computation():
        y_ref, grads_ref = forward_and_grads(block, x, grad_out)
    if moe:
        assert block.ffn.aux_loss is not None  # the balancing losses take part in the gradients compared
    # Same operations up to summation order (weights applied before the down projection, RMSNorm's
    # backward written out): fp32 rounding of O(1) values, a few 1e-7 relative.
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    assert grads.keys() == grads_ref.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], grads_ref[name], rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize("mode", ["bf16 parameters", "bf16 autocast"])
def test_lean_block_matches_in_bf16_and_under_autocast(mode):
    """The FSDP case (bf16 parameters) and Lightning's bf16-mixed (fp32 parameters, autocast): same dtypes of
    outputs and gradients as the plain computation, values to bf16 rounding."""
    block = make_block(MLA, True, torch.bfloat16 if mode == "bf16 parameters" else torch.float32)
    dtype = torch.bfloat16 if mode == "bf16 parameters" else torch.float32
    x, grad_out = torch.randn(2, 16, 64, dtype=dtype), torch.randn(2, 16, 64, dtype=dtype)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "bf16 autocast"):
        y, grads = forward_and_grads(block, x, grad_out)
        with plain_computation():
            y_ref, grads_ref = forward_and_grads(block, x, grad_out)
    assert y.dtype == y_ref.dtype
    # bf16 has 8 mantissa bits; roundings at different points differ by a few ulps of O(1) values.
    torch.testing.assert_close(y, y_ref, rtol=0.05, atol=0.05)
    for name in grads:
        assert grads[name].dtype == grads_ref[name].dtype, name
        scale = grads_ref[name].float().abs().max()
        torch.testing.assert_close(grads[name].float(), grads_ref[name].float(), rtol=0.05, atol=0.03 * scale,
                                   msg=name)


@pytest.mark.parametrize("config", [GQA, MLA], ids=["gqa", "mla"])
@pytest.mark.parametrize("moe", [True, False], ids=["moe", "dense"])
def test_working_set_formula_matches_saved_tensors(config, moe):
    """``plan``'s per-block bytes against what autograd keeps (saved-tensor hooks), part by part, in bf16.
    Attention runs through a stand-in keeping what fused GPU kernels keep (``tests/support/block_reference.py``)."""
    block = make_block(config, moe, torch.bfloat16)
    for part in ("attention", "ffn"):
        x = torch.randn(1, 64, 64, dtype=torch.bfloat16, requires_grad=True)
        measured = half_saved_bytes(block, x, part)
        assert block_working_set_bytes(config, 64, moe, part=part) == pytest.approx(measured, rel=0.05), part
    assert block_working_set_bytes(config, 64, moe) == sum(
        block_working_set_bytes(config, 64, moe, part=p) for p in ("attention", "ffn"))


def test_moe_half_keeps_under_six_tenths_of_the_plain_computation():
    block = make_block(MLA, True, torch.bfloat16)
    x = torch.randn(1, 64, 64, dtype=torch.bfloat16, requires_grad=True)
    assert half_saved_bytes(block, x, "ffn") <= 0.6 * half_saved_bytes(block, x, "ffn", plain=True)
    # At the ~1T shape (the formula is checked against the hooks above): 579,640 B/token before.
    one_t = load_model_config(str(REPO_ROOT / "configs" / "1t.yaml"))
    assert block_working_set_bytes(one_t, 1, True, part="ffn") <= 0.6 * 579_640


def test_token_counts_equal_bincount():
    block = make_block(GQA, True)
    moe = block.ffn
    experts_TK = torch.randint(0, GQA.num_experts, (50, GQA.top_k))
    experts_TK[:, 0] = 3  # one crowded expert, some likely empty
    counts = moe._count_tokens(experts_TK)
    assert torch.equal(counts, torch.bincount(experts_TK.flatten(), minlength=GQA.num_experts))
    assert counts.dtype == torch.int64


class _OpLog(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.add(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


# Ops that read device data back to the host on CUDA (or whose output shape depends on the data).
SYNCING_OPS = {"_local_scalar_dense", "bincount", "nonzero", "unique", "_unique2", "unique_consecutive",
               "masked_select", "histc", "item"}


def test_moe_forward_and_backward_issue_no_host_sync():
    """On the grouped-mm path: no ``.item()``/``.tolist()``/``.cpu()``/``bool()`` and no data-dependent op."""
    block = make_block(dataclasses.replace(MLA, z_loss_coef=0.001), True)
    x = torch.randn(2, 16, 64, requires_grad=True)
    calls = []

    def counting(name):
        original = getattr(torch.Tensor, name)

        def wrapper(self, *args, **kwargs):
            calls.append(name)
            return original(self, *args, **kwargs)
        return mock.patch.object(torch.Tensor, name, wrapper)

    log = _OpLog()
    with counting("item"), counting("tolist"), counting("cpu"), counting("numpy"), counting("__bool__"), \
            counting("__int__"), counting("__float__"), log:
        block.ffn(block.ffn_norm(x)).backward(torch.randn(2, 16, 64))
    assert calls == []
    assert {"grouped_linear", "grouped_weight_grad"} <= log.ops  # the grouped path ran, forward and backward
    assert not log.ops & SYNCING_OPS
    # The check can fail: the plain computation's bincount is caught.
    with plain_computation(), _OpLog() as plain_log:
        block.ffn(block.ffn_norm(x))
    assert "bincount" in plain_log.ops
