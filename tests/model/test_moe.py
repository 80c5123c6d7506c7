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


def float64_balancing_loss(x_BSD, gate_ED, bias_E, score_func, top_k, aux_coef, z_coef, per_sequence=True):
    """DeepSeek-V3's balance loss ``E/(K*S) * sum_e f_e * P_e`` and ST-MoE's z-loss, written token by token in
    float64 from the router's weights: P_e averages each token's scores normalised to sum 1, f_e counts the
    (bias-shifted) top-k picks. ``per_sequence``: one f·P per sequence, averaged (else one over the whole batch).
    Differentiable in ``gate_ED``; also returns the tokens each expert received."""
    B, S, _ = x_BSD.shape
    E = gate_ED.shape[0]
    logits_BSE = x_BSD.double() @ gate_ED.double().T
    scores_BSE = logits_BSE.softmax(-1) if score_func == "softmax" else logits_BSE.sigmoid()
    groups = [range(b * S, (b + 1) * S) for b in range(B)] if per_sequence else [range(B * S)]
    flat_TE, flat_logits_TE = scores_BSE.reshape(B * S, E), logits_BSE.reshape(B * S, E)
    counts = [0] * E
    balance = 0.0
    for tokens in groups:
        f, P = [0.0] * E, [0.0] * E
        for t in tokens:
            for e in (flat_TE[t].detach() + bias_E.double()).topk(top_k).indices.tolist():
                f[e] += E / (top_k * len(tokens))
                counts[e] += 1
            for e in range(E):
                P[e] = P[e] + flat_TE[t, e] / flat_TE[t].sum() / len(tokens)
        balance = balance + sum(f[e] * P[e] for e in range(E)) / len(groups)
    z = 0.0
    for t in range(B * S):
        m = flat_logits_TE[t].max().detach()
        z = z + (m + sum((flat_logits_TE[t, e] - m).exp() for e in range(E)).log()) ** 2 / (B * S)
    return aux_coef * balance + z_coef * z, counts


def skewed_layer(score_func: str, aux_coef: float, z_coef: float):
    """A MoE layer with O(1) router logits and a batch of two sequences leaning on different experts (0 and 5),
    plus a small balancing bias: per-sequence and batch-wise balance differ, and the bias shifts picks."""
    torch.manual_seed(0)
    moe = MoELayer(tiny_config(n_shared_experts=0, score_func=score_func, aux_loss_coef=aux_coef, z_loss_coef=z_coef))
    moe.init_weights(std=0.5, out_std=0.5)
    gate_ED = moe.router.gate.weight.detach()
    x_BSD = torch.randn(2, 32, 32)
    x_BSD[0] += 3 * gate_ED[0] / gate_ED[0].norm()
    x_BSD[1] += 3 * gate_ED[5] / gate_ED[5].norm()
    moe.router.expert_bias.copy_(torch.linspace(-0.05, 0.05, 8))
    return moe, x_BSD


@pytest.mark.parametrize("aux_coef, z_coef", [(1.0, 0.0), (0.0, 1.0), (0.3, 0.05)])
@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_balancing_and_z_loss_equal_a_float64_reference_on_skewed_routing(score_func, aux_coef, z_coef):
    moe, x_BSD = skewed_layer(score_func, aux_coef, z_coef)
    with torch.no_grad():
        moe(x_BSD)
    gate_ED, bias_E = moe.router.gate.weight.detach(), moe.router.expert_bias
    expected, counts = float64_balancing_loss(x_BSD, gate_ED, bias_E, score_func, 2, aux_coef, z_coef)
    assert moe.tokens_per_expert.tolist() == counts  # the same picks (no near-ties in fp32)
    assert max(counts) > 2 * sum(counts) / len(counts)  # skewed, not uniform
    # fp32 logits of O(3) and sums over 64 tokens x 8 experts: a few 1e-7 relative
    assert moe.aux_loss.item() == pytest.approx(expected.item(), rel=1e-6)
    if aux_coef:  # the test tells a per-sequence loss from a batch-wise one: they differ by far more than 1e-6
        batch_wise, _ = float64_balancing_loss(x_BSD, gate_ED, bias_E, score_func, 2, aux_coef, z_coef,
                                               per_sequence=False)
        assert abs(batch_wise.item() - expected.item()) > 1e-2 * expected.item()


def test_aux_losses_reach_the_router_with_the_configured_gradient_scale():
    moe, x = skewed_layer("softmax", 1.0, 0.1)
    moe.aux_loss_grad_scale = 0.25
    grad_out = 0.01 * torch.randn(2, 32, 32)  # small: the losses' share of the router gradient stays visible
    (moe(x) * grad_out).sum().backward()
    attached = moe.router.gate.weight.grad.clone()

    # Reference: the layer's output alone, plus 0.25 x the float64 losses' own gradient in the router weights.
    moe.zero_grad()
    moe.aux_loss_coef = moe.z_loss_coef = 0.0
    (moe(x) * grad_out).sum().backward()
    gate_ED = moe.router.gate.weight.detach().double().requires_grad_()
    aux, _ = float64_balancing_loss(x, gate_ED, moe.router.expert_bias, "softmax", 2, 1.0, 0.1)
    aux.backward()
    expected = moe.router.gate.weight.grad.double() + 0.25 * gate_ED.grad
    assert (0.25 * gate_ED.grad).abs().max() > 1e-2  # the losses' share is 10^4 x the tolerance
    torch.testing.assert_close(attached.double(), expected, rtol=1e-5, atol=1e-6)  # fp32 against float64


def test_sequence_aux_loss_is_minimal_for_uniform_routing():
    """With uniform scores and perfectly even selection, sum_e f_e * P_e = 1 (its minimum)."""
    config = tiny_config(num_experts=4, top_k=2, aux_loss_coef=1.0)
    moe = MoELayer(config)
    scores_BSE = torch.full((1, 8, 4), 0.25)
    experts_BSK = torch.tensor([[0, 1], [2, 3]] * 4)[None]
    loss = moe._balancing_loss(scores_BSE, experts_BSK, torch.zeros(1, 8, 4), None)
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
    tokens = torch.randint(0, 64, (1, 8))
    logits = model(tokens)
    reference = MoETransformer(tiny_config())  # built on the CPU directly, initialised from the same seed
    torch.manual_seed(0)
    reference.init_weights()
    torch.testing.assert_close(logits, reference(tokens), rtol=0, atol=0)
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
