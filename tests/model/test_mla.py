"""Multi-head latent attention: shapes, parameter count, causality, agreement with plain attention, training."""

import math

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from moe_lightning import MoELanguageModel
from moe_lightning.planner.flops import attention_flops_per_token
from moe_lightning.model import ConfigError, MoEConfig, MoETransformer
from moe_lightning.model.rotary import Rotary, apply_rotary
from moe_lightning.model.mla import MultiHeadLatentAttention

MLA = dict(attention="mla", vocab_size=64, dim=48, n_layers=2, n_heads=3, max_seq_len=16, ffn_hidden=64,
           n_dense_layers=1, num_experts=4, top_k=2, expert_hidden=32, kv_lora_rank=12, qk_nope_head_dim=8,
           qk_rope_head_dim=4, v_head_dim=6)


@pytest.mark.parametrize("q_lora_rank", [0, 10])
def test_shapes_and_parameter_count(q_lora_rank):
    config = MoEConfig(**MLA, q_lora_rank=q_lora_rank)
    attn = MultiHeadLatentAttention(config)
    # dim 48, 3 heads, nope 8 + rope 4 = 12 query/key dims per head, value 6, kv latent 12
    q_params = 48 * 3 * 12 if q_lora_rank == 0 else 48 * 10 + 10 + 10 * 3 * 12  # (latent, its norm, up)
    kv_params = 48 * (12 + 4) + 12 + 12 * 3 * (8 + 6)  # latent + shared rotary key, norm, up to keys/values
    assert sum(p.numel() for p in attn.parameters()) == q_params + kv_params + 3 * 6 * 48
    assert attn(torch.randn(2, 7, 48)).shape == (2, 7, 48)


def test_causal():
    torch.manual_seed(0)
    attn = MultiHeadLatentAttention(MoEConfig(**MLA, q_lora_rank=10))
    x = torch.randn(1, 9, 48)
    changed = x.clone()
    changed[:, 5] += 1.0
    diff = (attn(changed) - attn(x)).abs().amax(-1)[0]
    assert torch.all(diff[:5] == 0)
    assert torch.all(diff[5:] > 0)


def test_matches_explicit_attention():
    """Per head: softmax(q·kᵀ / sqrt(nope + rope)) with a causal mask, over values of width v_head_dim."""
    torch.manual_seed(0)
    attn = MultiHeadLatentAttention(MoEConfig(**MLA, q_lora_rank=10))
    x = torch.randn(2, 6, 48)
    S, H = 6, 3
    q = attn.wq_b(attn.q_norm(attn.wq_a(x))).view(2, S, H, 12)
    latent, k_rope = attn.wkv_a(x).split([12, 4], dim=-1)
    kv = attn.wkv_b(attn.kv_norm(latent)).view(2, S, H, 14)
    cos, sin = Rotary(attn.rotary.config, 4).cos_sin(0, S)
    q = torch.cat([q[..., :8], apply_rotary(q[..., 8:], cos, sin)], -1)
    k_rope = apply_rotary(k_rope[:, :, None], cos, sin)
    heads = []
    for h in range(H):
        k_h = torch.cat([kv[:, :, h, :8], k_rope[:, :, 0]], -1)
        scores = q[:, :, h] @ k_h.transpose(1, 2) / math.sqrt(12)
        scores = scores.masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), float("-inf"))
        heads.append(scores.softmax(-1) @ kv[:, :, h, 8:])
    expected = attn.wo(torch.cat(heads, -1))
    torch.testing.assert_close(attn(x), expected, atol=1e-5, rtol=1e-5)


def test_meta_build_then_init_weights():
    config = MoEConfig(**MLA, q_lora_rank=10)
    with torch.device("meta"):
        model = MoETransformer(config)
    model.to_empty(device="cpu")
    model.init_weights()
    attn = model.layers[0].attention
    assert isinstance(attn, MultiHeadLatentAttention)
    assert torch.equal(attn.kv_norm.weight, torch.ones(12)) and torch.equal(attn.q_norm.weight, torch.ones(10))
    assert attn.wo.weight.std() < attn.wkv_b.weight.std()  # output projections use the depth-scaled std
    assert torch.isfinite(model(torch.randint(0, 64, (1, 8)))).all()


def test_trains_on_cpu():
    torch.manual_seed(0)
    model = MoELanguageModel(MoEConfig(**MLA, q_lora_rank=10),
                             optimizer=lambda groups: torch.optim.AdamW(groups, lr=1e-2),
                             lr_scheduler=lambda opt: torch.optim.lr_scheduler.ConstantLR(opt, factor=1.0))
    batch = torch.randint(0, 64, (4, 17))
    losses = []

    class Record(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, *args):
            losses.append(outputs["loss"].item())

    trainer = L.Trainer(accelerator="cpu", max_steps=15, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[Record()])
    trainer.fit(model, DataLoader([batch[i] for i in range(4)] * 15, batch_size=4))
    assert len(losses) == 15
    assert losses[-1] < 0.5 * losses[0]


def test_attention_flops_use_mla_head_dims():
    config = MoEConfig(**MLA)
    # 6 · layers 2 · heads 3 · (query/key 12 + value 6) · causal pairs per token (16 · 17 / 2 of 16 tokens)
    assert attention_flops_per_token(config, 16) == 6 * 2 * 3 * 18 * 17 / 2


@pytest.mark.parametrize("field, value, message", [
    ("qk_rope_head_dim", 5, "qk_rope_head_dim=5 must be even"),
    ("kv_lora_rank", 0, "kv_lora_rank=0: must be a positive integer for attention='mla'"),
    ("q_lora_rank", -1, "q_lora_rank=-1: must be >= 0"),
])
def test_config_errors_name_the_field(field, value, message):
    with pytest.raises(ConfigError, match=message):
        MoEConfig(**{**MLA, field: value})


def test_gqa_ignores_mla_fields():
    config = MoEConfig(**{**MLA, "attention": "gqa", "n_heads": 4, "qk_rope_head_dim": 5})
    assert config.attention_head_dims == (12, 12)
