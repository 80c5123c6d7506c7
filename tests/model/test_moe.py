"""The model's numerics: grouped experts, routing invariants, causality, balancing, config validation."""

import math

import pytest
import torch

from moe_lightning.model import ConfigError, GroupedExperts, MoEConfig, MoELayer, MoETransformer, Router
from moe_lightning.model.grouped_mm import grouped_mm_runs

TINY = dict(vocab_size=64, dim=32, n_layers=3, n_heads=4, n_kv_heads=2, max_seq_len=32, ffn_hidden=64,
            n_dense_layers=1, num_experts=8, top_k=2, expert_hidden=16, n_shared_experts=1)


def tiny_config(**overrides) -> MoEConfig:
    return MoEConfig(**{**TINY, **overrides})


@pytest.mark.parametrize("counts", [[3, 0, 5, 1], [0, 0, 9, 0], [2, 2, 2, 2]])
def test_grouped_experts_match_per_expert_loop_forward_and_backward(counts):
    torch.manual_seed(0)
    experts = GroupedExperts(num_experts=4, dim=8, hidden=12)
    experts.init_weights(std=0.5, out_std=0.5)
    tokens_per_expert = torch.tensor(counts)
    x = torch.randn(sum(counts), 8, requires_grad=True)
    grad_out = torch.randn(sum(counts), 8)  # a real gradient: _grouped_mm's CPU backward rejects expanded ones

    grouped = experts(x, tokens_per_expert)
    grads_grouped = torch.autograd.grad(grouped, [x, *experts.parameters()], grad_out)
    loop = experts.forward_loop(x, tokens_per_expert)
    grads_loop = torch.autograd.grad(loop, [x, *experts.parameters()], grad_out)

    # fp32 with different summation order: agreement to a few ulps of the O(1) values.
    torch.testing.assert_close(grouped, loop, rtol=1e-5, atol=1e-5)
    for g, ref in zip(grads_grouped, grads_loop):
        torch.testing.assert_close(g, ref, rtol=1e-5, atol=1e-5)


def test_empty_expert_gets_exactly_zero_weight_gradient_even_if_the_kernel_leaves_garbage(monkeypatch):
    """On Blackwell/ROCm ``_grouped_mm`` leaves an empty group's weight gradient unwritten: emulate that with
    NaN garbage in the 3-D (weight-gradient) outputs; the grouped path must still give the loop's gradients."""
    real = torch._grouped_mm

    def garbage_for_empty_groups(a, b, offs=None, **kwargs):
        out = real(a, b, offs=offs, **kwargs)
        if out.dim() == 3:
            counts = torch.diff(offs, prepend=offs.new_zeros(1))
            out[counts == 0] = float("nan")
        return out

    torch.manual_seed(0)
    experts = GroupedExperts(num_experts=4, dim=8, hidden=12)
    experts.init_weights(std=0.5, out_std=0.5)
    counts = torch.tensor([3, 0, 5, 0])
    x, grad_out = torch.randn(8, 8), torch.randn(8, 8)
    scale = torch.rand(8, 1)
    reference = torch.autograd.grad(experts.forward_loop(x, counts, scale), list(experts.parameters()), grad_out)
    monkeypatch.setattr(torch, "_grouped_mm", garbage_for_empty_groups)
    grads = torch.autograd.grad(experts(x, counts, scale), list(experts.parameters()), grad_out)
    for g, ref in zip(grads, reference):  # w1, w3 (grouped_linear's backward) and w2 (_GatedDown's backward)
        assert (g[[1, 3]] == 0).all()
        torch.testing.assert_close(g, ref, rtol=1e-5, atol=1e-5)  # fp32, different summation order


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_router_picks_k_distinct_experts_with_normalized_weights(score_func):
    torch.manual_seed(0)
    router = Router(tiny_config(score_func=score_func, route_scale=2.5))
    router.init_weights(std=0.5)
    weights_TK, experts_TK, scores_TE, _ = router(torch.randn(50, 32))
    assert experts_TK.shape == (50, 2)
    assert (experts_TK[:, 0] != experts_TK[:, 1]).all()
    torch.testing.assert_close(weights_TK.sum(-1), torch.full((50,), 2.5))
    # Without the bias the chosen experts are exactly the top-k scores.
    torch.testing.assert_close(scores_TE.gather(-1, experts_TK), scores_TE.topk(2, -1).values)


def test_router_weights_without_renormalization_are_raw_scores():
    torch.manual_seed(0)
    router = Router(tiny_config(route_norm=False))
    router.init_weights(std=0.5)
    weights_TK, experts_TK, scores_TE, _ = router(torch.randn(20, 32))
    torch.testing.assert_close(weights_TK, scores_TE.gather(-1, experts_TK))
    assert (weights_TK.sum(-1) < 1).all()


def test_balancing_bias_changes_selection_but_not_weights():
    torch.manual_seed(0)
    router = Router(tiny_config(score_func="sigmoid", route_norm=False))
    router.init_weights(std=0.5)
    x = torch.randn(40, 32)
    _, experts_before, scores_TE, _ = router(x)
    router.expert_bias[3] = 10.0  # force expert 3 into every token's selection
    weights_after, experts_after, scores_after, _ = router(x)
    assert (experts_after == 3).any(-1).all()
    assert not torch.equal(experts_before, experts_after)
    torch.testing.assert_close(scores_after, scores_TE)  # scores themselves are untouched
    torch.testing.assert_close(weights_after, scores_TE.gather(-1, experts_after))  # weight = unbiased score


def test_group_limited_routing_stays_inside_the_allowed_groups():
    torch.manual_seed(0)
    router = Router(tiny_config(n_expert_groups=4, n_limited_groups=1, top_k=2))
    router.init_weights(std=1.0)
    _, experts_TK, _, _ = router(torch.randn(100, 32))
    groups_TK = experts_TK // 2  # 8 experts in 4 groups of 2
    assert (groups_TK[:, 0] == groups_TK[:, 1]).all()


def test_bias_update_moves_a_skewed_router_toward_balance():
    torch.manual_seed(0)
    config = tiny_config(num_experts=4, top_k=1, n_shared_experts=0, score_func="sigmoid")
    moe = MoELayer(config)
    moe.init_weights(std=0.02, out_std=0.02)
    with torch.no_grad():
        moe.router.gate.weight[0] += 0.05  # expert 0 wins most tokens
    x = torch.randn(1, 256, 32).abs()

    def imbalance():
        with torch.no_grad():
            moe(x)
        counts = moe.tokens_per_expert.float()
        return (counts.max() / counts.mean()).item(), counts

    start, counts = imbalance()
    assert start > 2.0
    for _ in range(200):
        moe.router.update_bias(counts, rate=0.01)
        end, counts = imbalance()
    assert end < 1.5 < start


def test_aux_losses_reach_the_router_with_the_configured_gradient_scale():
    torch.manual_seed(0)
    config = tiny_config(aux_loss_coef=0.1, z_loss_coef=0.01, n_shared_experts=0)
    moe = MoELayer(config)
    moe.init_weights(std=0.1, out_std=0.1)
    moe.aux_loss_grad_scale = 0.25
    x = torch.randn(2, 16, 32)
    grad_out = torch.randn(2, 16, 32)

    (moe(x) * grad_out).sum().backward()
    attached = moe.router.gate.weight.grad.clone()

    # Reference: the same losses added explicitly to the objective, scaled by hand.
    moe.zero_grad()
    moe.aux_loss_coef = moe.z_loss_coef = 0.0
    y = moe(x)
    weights_TK, experts_TK, scores_TE, logits_TE = moe.router(x.reshape(-1, 32))
    moe.aux_loss_coef, moe.z_loss_coef = 0.1, 0.01
    aux = moe._balancing_loss(scores_TE.view(2, 16, -1), experts_TK.view(2, 16, -1), logits_TE)
    ((y * grad_out).sum() + 0.25 * aux).backward()
    torch.testing.assert_close(attached, moe.router.gate.weight.grad, rtol=1e-5, atol=1e-7)
    assert aux.item() > 0


def test_sequence_aux_loss_is_minimal_for_uniform_routing():
    """With uniform scores and perfectly even selection, sum_e f_e * P_e = 1 (its minimum)."""
    config = tiny_config(num_experts=4, top_k=2, aux_loss_coef=1.0)
    moe = MoELayer(config)
    scores_BSE = torch.full((1, 8, 4), 0.25)
    experts_BSK = torch.tensor([[0, 1], [2, 3]] * 4)[None]
    loss = moe._balancing_loss(scores_BSE, experts_BSK, torch.zeros(8, 4))
    assert math.isclose(loss.item(), 1.0, rel_tol=1e-6)


@pytest.mark.parametrize("overrides", [{}, {"tie_embeddings": True, "n_dense_layers": 0, "score_func": "sigmoid"}])
def test_changing_a_future_token_leaves_earlier_logits_unchanged(overrides):
    torch.manual_seed(0)
    model = MoETransformer(tiny_config(**overrides)).eval()
    tokens = torch.randint(0, 64, (2, 24))
    changed = tokens.clone()
    changed[:, 15] = (changed[:, 15] + 1) % 64
    logits, logits_changed = model(tokens), model(changed)
    torch.testing.assert_close(logits[:, :15], logits_changed[:, :15], rtol=0, atol=1e-5)
    assert not torch.allclose(logits[:, 15:], logits_changed[:, 15:])


def test_meta_build_then_init_weights_gives_a_working_model():
    with torch.device("meta"):
        model = MoETransformer(tiny_config())
    assert all(p.is_meta for p in model.parameters())
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights()
    assert all(b.abs().sum() == 0 for b in model.buffers())  # balancing bias reset
    logits = model(torch.randint(0, 64, (1, 8)))
    assert torch.isfinite(logits).all()
    assert math.isclose(logits.float().std().item(), 1.0, rel_tol=0.5)


def test_active_parameters_count_routed_experts_by_top_k_share():
    config = tiny_config()
    model = MoETransformer(config)
    routed = 2 * 8 * 3 * 32 * 16  # 2 MoE layers x 8 experts x 3 matrices of 32x16
    assert model.num_parameters() - model.num_parameters(active=True) == routed - routed * 2 // 8


def test_greedy_generation_is_deterministic_and_extends_the_prompt():
    torch.manual_seed(0)
    model = MoETransformer(tiny_config()).eval()
    prompt = torch.randint(0, 64, (2, 5))
    out1 = model.generate(prompt, 40, temperature=0)  # longer than max_seq_len: context is cropped
    out2 = model.generate(prompt, 40, temperature=0)
    assert out1.shape == (2, 45) and torch.equal(out1, out2) and torch.equal(out1[:, :5], prompt)
    sampled = model.generate(prompt, 10, temperature=1.0, top_k=3, generator=torch.Generator().manual_seed(0))
    assert sampled.shape == (2, 15) and sampled.max() < 64


@pytest.mark.parametrize("overrides, field", [
    ({"top_k": 9}, "top_k"),
    ({"dim": 30}, "dim"),
    ({"n_kv_heads": 3}, "n_kv_heads"),
    ({"n_dense_layers": 4}, "n_dense_layers"),
    ({"n_expert_groups": 3}, "n_expert_groups"),
    ({"n_expert_groups": 4, "n_limited_groups": 5}, "n_limited_groups"),
    ({"n_expert_groups": 4, "n_limited_groups": 1, "top_k": 3}, "top_k"),
    ({"score_func": "relu"}, "score_func"),
    ({"num_experts": 0}, "num_experts"),
    ({"aux_loss_coef": -1.0}, "aux_loss_coef"),
    ({"group_score": "sum"}, "group_score"),
    ({"document_masking": "yes"}, "document_masking"),
    ({"rope_truncate": "no"}, "rope_truncate"),
    ({"rope_scaling": "yarn", "rope_factor": 4.0, "rope_original_max_seq_len": 16, "rope_mscale": -1.0}, "rope_mscale"),
    ({"rope_scaling": "yarn", "rope_factor": 4.0, "rope_original_max_seq_len": 16, "rope_attention_factor": 0.0},
     "rope_attention_factor"),
])
def test_invalid_config_names_the_field(overrides, field):
    with pytest.raises(ConfigError, match=f"MoEConfig.{field}"):
        tiny_config(**overrides)


def test_expert_widths_grouped_mm_cannot_align_fall_back_to_the_loop():
    """_grouped_mm needs 16-byte rows; an odd expert_hidden must still train (through the per-expert loop)."""
    torch.manual_seed(0)
    model = MoETransformer(tiny_config(expert_hidden=10))
    tokens = torch.randint(0, 64, (2, 12))
    logits = model(tokens)
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten()).backward()
    assert model.layers[1].ffn.experts.w1_EFD.grad.abs().sum() > 0


@pytest.mark.parametrize("device, dtype, rows, capability, compiling, grouped", [
    ("cpu", torch.float32, (128, 256), None, False, True),
    ("cpu", torch.float32, (128, 40), None, False, False),        # 10-wide fp32 rows: not 16-byte multiples
    ("cuda", torch.bfloat16, (256, 512), (9, 0), False, True),    # Hopper: the fused kernel
    ("cuda", torch.bfloat16, (256, 512), (8, 0), False, False),   # Ampere, eager: the loop syncs once per layer,
    ("cuda", torch.float32, (128, 256), (9, 0), False, False),    # _grouped_mm's fallback once per call
    ("cuda", torch.float32, (128, 256), (9, 0), True, True),      # compiled: the fallback, no graph break
    ("cuda", torch.bfloat16, (256, 512), (8, 0), True, True),
    ("cuda", torch.float16, (256, 512), (7, 5), True, True),
    ("cuda", torch.float32, (128, 40), (9, 0), True, False),      # misaligned rows fail on every device
    ("cuda", torch.float64, (128, 256), (9, 0), True, False),     # no _grouped_mm for fp64
    ("mps", torch.float32, (128, 256), None, True, False),
])
def test_experts_take_grouped_mm_wherever_it_runs_and_the_loop_only_where_it_costs_less(
        device, dtype, rows, capability, compiling, grouped):
    assert grouped_mm_runs(device, dtype, rows, capability, compiling) is grouped


def test_router_scores_stay_fp32_under_bf16_autocast():
    router = Router(tiny_config())
    router.init_weights(std=0.5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        weights_TK, _, scores_TE, logits_TE = router(torch.randn(8, 32))
    assert logits_TE.dtype == scores_TE.dtype == weights_TK.dtype == torch.float32
