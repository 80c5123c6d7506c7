"""Attention features on their own: YaRN rotary scaling against `transformers`, QK-norm, clip_qkv, MLA's norm eps."""

import math

import pytest
import torch

from moe_lightning.model import ConfigError, MoEConfig
from moe_lightning.model.attention import GroupedQueryAttention
from moe_lightning.model.mla import MultiHeadLatentAttention
from moe_lightning.model.rotary import Rotary, apply_rotary, mla_softmax_scale

SMALL = dict(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64, ffn_hidden=64,
             num_experts=4, top_k=2, expert_hidden=16)
MLA = dict(SMALL, attention="mla", n_heads=3, q_lora_rank=12, kv_lora_rank=12, qk_nope_head_dim=8,
           qk_rope_head_dim=8, v_head_dim=6)
# DeepSeek-V3's published rope_scaling (config.json of deepseek-ai/DeepSeek-V3)
V3_YARN = dict(rope_scaling="yarn", rope_factor=40.0, rope_original_max_seq_len=4096, rope_beta_fast=32.0,
               rope_beta_slow=1.0, rope_mscale=1.0, rope_mscale_all_dim=1.0, rope_theta=10000.0)
V3_HF = {"rope_type": "yarn", "factor": 40.0, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
         "original_max_position_embeddings": 4096, "rope_theta": 10000.0}
# Qwen3's documented YaRN setting (factor 4 over 32768): no mscale fields, so cos/sin get 0.1 ln 4 + 1
QWEN_YARN = dict(rope_scaling="yarn", rope_factor=4.0, rope_original_max_seq_len=32768, rope_theta=1e6)
QWEN_HF = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768, "rope_theta": 1e6}

POSITIONS = torch.tensor([[0, 1, 7, 4095, 4096, 30000, 163839]])


def hf_half_cos_sin(rotary_embedding, rot_dim):
    """HF's cos/sin ``[S, rot_dim]`` (halves repeated) → one value per frequency ``[S, rot_dim // 2]``."""
    cos, sin = rotary_embedding(torch.zeros(1, 1, rot_dim), POSITIONS)
    return cos[0, :, :rot_dim // 2], sin[0, :, :rot_dim // 2]


def assert_tables_match(rotary: Rotary, hf_rotary, rot_dim):
    """cos/sin at POSITIONS; the tolerance is fp32 rounding of the angle ``position · inv_freq`` (HF takes it
    from a matmul, we from an outer product: one ulp of angles up to 1.6e5 rad), plus 1e-6."""
    cos, sin = rotary.cos_sin(0, int(POSITIONS.max()) + 1)
    hf_cos, hf_sin = hf_half_cos_sin(hf_rotary, rot_dim)
    angle_SR = POSITIONS[0, :, None].double() * rotary.inv_freq().double()
    tolerance_SR = 1e-6 + rotary.attention_factor * angle_SR * 2.0 ** -23
    for ours, theirs in ((cos[POSITIONS[0]], hf_cos), (sin[POSITIONS[0]], hf_sin)):
        assert ((ours - theirs).abs() <= tolerance_SR).all()


def test_yarn_equals_transformers_for_deepseek_v3_factor_40():
    pytest.importorskip("transformers")
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding
    hf_config = DeepseekV3Config(hidden_size=64, num_attention_heads=2, qk_rope_head_dim=64, qk_nope_head_dim=128,
                                 v_head_dim=128, kv_lora_rank=32, q_lora_rank=48, max_position_embeddings=163840,
                                 rope_parameters=V3_HF)
    config = MoEConfig(**{**MLA, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128}, **V3_YARN)
    rotary = Rotary(config, 64)
    hf_rotary = DeepseekV3RotaryEmbedding(hf_config)
    torch.testing.assert_close(rotary.inv_freq(), hf_rotary.inv_freq, atol=0, rtol=1e-6)  # same fp32 formula
    assert rotary.attention_factor == hf_rotary.attention_scaling == 1.0  # mscale == mscale_all_dim
    assert_tables_match(rotary, hf_rotary, 64)
    # the MLA softmax scale: 1/sqrt(192) · mscale², mscale = 0.1 · 1 · ln 40 + 1
    assert math.isclose(mla_softmax_scale(config), DeepseekV3Attention(hf_config, 0).scaling, rel_tol=1e-12)
    assert math.isclose(mla_softmax_scale(config) * math.sqrt(192), (0.1 * math.log(40) + 1) ** 2, rel_tol=1e-12)
    assert math.isclose(mla_softmax_scale(config) * math.sqrt(192), 1.8739, rel_tol=1e-4)
    # some dims are kept, some interpolated by the factor, some in between: the ramp is exercised
    plain = Rotary(MoEConfig(**{**MLA, "qk_rope_head_dim": 64}), 64).inv_freq()
    ratio = plain / rotary.inv_freq()
    assert ratio[0] == 1 and math.isclose(ratio[-1], 40, rel_tol=1e-5) and ((ratio > 1.01) & (ratio < 39)).any()


def test_yarn_equals_transformers_for_qwen3_with_the_cos_sin_factor():
    pytest.importorskip("transformers")
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRotaryEmbedding
    hf_config = Qwen3MoeConfig(hidden_size=64, num_attention_heads=2, head_dim=32, max_position_embeddings=131072,
                               rope_parameters=QWEN_HF)
    config = MoEConfig(**SMALL, head_dim=32, **QWEN_YARN)
    rotary, hf_rotary = Rotary(config, 32), Qwen3MoeRotaryEmbedding(hf_config)
    assert math.isclose(rotary.attention_factor, 0.1 * math.log(4) + 1, rel_tol=1e-12)
    assert math.isclose(rotary.attention_factor, hf_rotary.attention_scaling, rel_tol=1e-12)
    torch.testing.assert_close(rotary.inv_freq(), hf_rotary.inv_freq, atol=0, rtol=1e-6)
    assert_tables_match(rotary, hf_rotary, 32)
    assert mla_softmax_scale(MoEConfig(**MLA, **QWEN_YARN)) == 16 ** -0.5  # no mscale_all_dim: softmax untouched


@pytest.mark.parametrize("overrides, message", [
    (dict(rope_factor=4.0), "rope_factor=4.0 has no effect with rope_scaling='none'"),
    (dict(rope_scaling="yarn", rope_factor=4.0), "rope_original_max_seq_len=None"),
    (dict(rope_scaling="yarn", rope_factor=0.5, rope_original_max_seq_len=64), "rope_factor=0.5 must be >= 1"),
    (dict(rope_scaling="yarn", rope_factor=4.0, rope_original_max_seq_len=64, rope_beta_fast=0.5),
     "need 0 < rope_beta_slow <= rope_beta_fast"),
    (dict(rope_scaling="ntk"), "rope_scaling='ntk'"),
])
def test_rope_config_errors_name_the_field(overrides, message):
    with pytest.raises(ConfigError, match=message):
        MoEConfig(**SMALL, **overrides)


def explicit_attention(q_BSHK, k_BSHK, v_BSHV, scale):
    """Float64 causal softmax attention, heads already matched."""
    S = q_BSHK.shape[1]
    scores = torch.einsum("bqhk,bshk->bhqs", q_BSHK.double(), k_BSHK.double()) * scale
    scores = scores.masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), -math.inf)
    return torch.einsum("bhqs,bshv->bqhv", scores.softmax(-1), v_BSHV.double()).float()


@pytest.mark.parametrize("yarn", [V3_YARN, QWEN_YARN])
def test_gqa_with_yarn_equals_explicit_attention_on_transformers_tables(yarn):
    pytest.importorskip("transformers")
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRotaryEmbedding
    torch.manual_seed(0)
    config = MoEConfig(**SMALL, **{**yarn, "rope_original_max_seq_len": 16})  # short original context: ramp matters
    hf_params = {**(V3_HF if yarn is V3_YARN else QWEN_HF), "original_max_position_embeddings": 16}
    hf_rotary = Qwen3MoeRotaryEmbedding(Qwen3MoeConfig(hidden_size=32, num_attention_heads=4, head_dim=8,
                                                       max_position_embeddings=64, rope_parameters=hf_params))
    attn = GroupedQueryAttention(config)
    attn.init_weights(0.5, 0.5)  # O(1) scores
    x = torch.randn(2, 12, 32)
    cos, sin = hf_rotary(x, torch.arange(12)[None])
    cos, sin = cos[0, :, :4], sin[0, :, :4]
    q = apply_rotary(attn.wq(x).view(2, 12, 4, 8), cos, sin)
    k = apply_rotary(attn.wk(x).view(2, 12, 2, 8), cos, sin).repeat_interleave(2, 2)
    v = attn.wv(x).view(2, 12, 2, 8).repeat_interleave(2, 2)
    expected = attn.wo(explicit_attention(q, k, v, 8 ** -0.5).flatten(2))
    torch.testing.assert_close(attn(x), expected, atol=1e-5, rtol=1e-5)


def test_mla_with_yarn_uses_mscale_squared_in_the_softmax():
    torch.manual_seed(0)
    config = MoEConfig(**MLA, **{**V3_YARN, "rope_original_max_seq_len": 16})
    attn = MultiHeadLatentAttention(config)
    attn.init_weights(0.5, 0.5)
    x = torch.randn(2, 10, 32)
    cos, sin = Rotary(config, 8).cos_sin(0, 10)
    q = attn.wq_b(attn.q_norm(attn.wq_a(x))).view(2, 10, 3, 16)
    latent, k_rope = attn.wkv_a(x).split([12, 8], dim=-1)
    kv = attn.wkv_b(attn.kv_norm(latent)).view(2, 10, 3, 14)
    q = torch.cat([q[..., :8], apply_rotary(q[..., 8:], cos, sin)], -1)
    k = torch.cat([kv[..., :8], apply_rotary(k_rope[:, :, None], cos, sin).expand(-1, -1, 3, -1)], -1)
    scale = 16 ** -0.5 * (0.1 * math.log(40) + 1) ** 2
    expected = attn.wo(explicit_attention(q, k, kv[..., 8:], scale).flatten(2))
    torch.testing.assert_close(attn(x), expected, atol=1e-5, rtol=1e-5)


def explicit_gqa(attn: GroupedQueryAttention, x, qk_norm: str, clip: float | None, eps: float):
    """Float64 recomputation of GQA with QK-norm (over each head, or the whole projection) and clipping."""
    def rms(t, w):
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + eps) * w.double()

    B, S, _ = x.shape
    q, k, v = (lin.weight.double() @ x.double().transpose(1, 2) for lin in (attn.wq, attn.wk, attn.wv))
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, S, heads * 8]
    if qk_norm == "full":
        q, k = rms(q, attn.q_norm.weight), rms(k, attn.k_norm.weight)
    q, k, v = q.view(B, S, 4, 8), k.view(B, S, 2, 8), v.view(B, S, 2, 8)
    if qk_norm == "head":
        q, k = rms(q, attn.q_norm.weight), rms(k, attn.k_norm.weight)
    if clip is not None:
        q, k, v = q.clamp(-clip, clip), k.clamp(-clip, clip), v.clamp(-clip, clip)
    cos, sin = Rotary(attn.rotary.config, 8).cos_sin(0, S)
    q, k = apply_rotary(q, cos.double(), sin.double()), apply_rotary(k, cos.double(), sin.double())
    out = explicit_attention(q, k.repeat_interleave(2, 2), v.repeat_interleave(2, 2), 8 ** -0.5)
    return attn.wo(out.flatten(2))


@pytest.mark.parametrize("qk_norm, clip", [("head", None), ("full", None), ("none", 0.7), ("full", 0.7)])
def test_qk_norm_and_clip_qkv_equal_explicit_recomputation(qk_norm, clip):
    torch.manual_seed(0)
    config = MoEConfig(**SMALL, qk_norm=qk_norm, clip_qkv=clip, norm_eps=1e-5)
    attn = GroupedQueryAttention(config)
    attn.init_weights(0.5, 0.5)
    expected_norm_widths = {"head": (8, 8), "full": (32, 16)}.get(qk_norm)
    if expected_norm_widths:  # non-trivial norm weights, so a weight applied to the wrong axis would show
        assert (attn.q_norm.weight.numel(), attn.k_norm.weight.numel()) == expected_norm_widths
        with torch.no_grad():
            attn.q_norm.weight.uniform_(0.5, 1.5)
            attn.k_norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(2, 9, 32)
    out = attn(x)
    torch.testing.assert_close(out, explicit_gqa(attn, x, qk_norm, clip, 1e-5), atol=1e-5, rtol=1e-5)
    plain = GroupedQueryAttention(MoEConfig(**SMALL))
    plain.load_state_dict({n: t for n, t in attn.state_dict().items() if "norm" not in n})
    assert (plain(x) - out).abs().amax() > 1e-2  # the feature changes the output (0.7 clips ~30 % of q/k/v)
    if clip is not None:
        assert (attn.wv(x).abs() > clip).float().mean() > 0.1


def test_qk_norm_weights_reset_by_init_weights_and_config_errors():
    attn = GroupedQueryAttention(MoEConfig(**SMALL, qk_norm="head"))
    with torch.no_grad():
        attn.q_norm.weight.fill_(3.0)
    attn.init_weights(0.02, 0.01)
    assert torch.equal(attn.q_norm.weight, torch.ones(8))
    for overrides, message in [(dict(qk_norm="rms"), "qk_norm='rms'"), (dict(clip_qkv=0.0), "clip_qkv=0.0"),
                               (dict(MLA, qk_norm="head"), "qk_norm='head' applies to attention='gqa' only"),
                               (dict(MLA, clip_qkv=8.0), "clip_qkv=8.0 applies to attention='gqa' only"),
                               (dict(MLA, mla_norm_eps=0.0), "mla_norm_eps=0.0")]:
        with pytest.raises(ConfigError, match=message):
            MoEConfig(**{**SMALL, **overrides})


def test_mla_latent_norms_use_their_own_epsilon():
    torch.manual_seed(0)
    x = torch.randn(1, 6, 32) * 1e-3  # tiny latents: eps dominates their RMS, so 1e-2 vs 1e-6 shows in the output
    default = MultiHeadLatentAttention(MoEConfig(**MLA, norm_eps=1e-2))
    default.init_weights(0.5, 0.5)
    own = MultiHeadLatentAttention(MoEConfig(**MLA, norm_eps=1e-2, mla_norm_eps=1e-6))
    own.load_state_dict(default.state_dict())
    assert default.q_norm.eps == default.kv_norm.eps == 1e-2 and own.q_norm.eps == own.kv_norm.eps == 1e-6
    latent = own.wkv_a(x)[..., :12]
    expected = latent * torch.rsqrt(latent.pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(own.kv_norm(latent), expected, atol=1e-6, rtol=1e-5)
    assert (default(x) - own(x)).abs().amax() > 1e-2 * own(x).abs().amax()


def test_the_causal_block_mask_is_built_once_per_length_and_device():
    """QK-clip recording on CUDA attends through FlexAttention with this mask in every layer: before, each layer
    of each forward rebuilt it (a create_block_mask call, a kernel launch or more on CUDA)."""
    from torch.nn.attention.flex_attention import create_block_mask
    from moe_lightning.model.attention import _causal, causal_block_mask

    cpu = torch.device("cpu")
    first = causal_block_mask(256, cpu)
    assert causal_block_mask(256, cpu) is first
    other = causal_block_mask(384, cpu)
    assert other is not first and other.shape[-2:] == (384, 384)
    fresh = create_block_mask(_causal, None, None, 256, 256, device=cpu)
    assert torch.equal(first.to_dense(), fresh.to_dense())
