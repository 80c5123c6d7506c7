"""The 16B-class and ~1T configs: valid LightningCLI YAML, built on the meta device, counted by hand."""

import contextlib
import io

import pytest
import torch

from moe_lightning.commands.main import run
from moe_lightning.planner.flops import parameter_counts
from moe_lightning.model import MoEConfig, MoETransformer
from moe_lightning.planner.run_config import load_model_config
from tests.support.distributed import REPO_ROOT


def hand_count(c: MoEConfig) -> tuple[int, int]:
    """(total, active) from the architecture on paper: MLA attention, dense and MoE FFNs, untied head."""
    d, H = c.dim, c.n_heads
    qk = c.qk_nope_head_dim + c.qk_rope_head_dim
    q_proj = d * c.q_lora_rank + c.q_lora_rank + c.q_lora_rank * H * qk if c.q_lora_rank else d * H * qk
    kv_proj = d * (c.kv_lora_rank + c.qk_rope_head_dim) + c.kv_lora_rank \
        + c.kv_lora_rank * H * (c.qk_nope_head_dim + c.v_head_dim)
    attention = q_proj + kv_proj + H * c.v_head_dim * d
    per_layer = 2 * d + attention  # two RMSNorms
    expert = 3 * d * c.expert_hidden
    dense_ffn = 3 * d * c.ffn_hidden
    moe_ffn_shared = d * c.num_experts + c.n_shared_experts * expert  # router + shared experts
    routed = c.n_moe_layers * c.num_experts * expert
    total = (2 * c.vocab_size * d + d + c.n_layers * per_layer + c.n_dense_layers * dense_ffn
             + c.n_moe_layers * moe_ffn_shared + routed)
    return total, total - routed + c.n_moe_layers * c.top_k * expert


@pytest.mark.parametrize("name, published, tolerance", [
    ("16b", 15.7e9, 0.01),   # DeepSeek-V2-Lite: 15.7B total
    ("1t", 951.9e9, 0.01),   # the reference run
])
def test_counts_match_hand_count_and_target(name, published, tolerance):
    config = load_model_config(str(REPO_ROOT / "configs" / f"{name}.yaml"))
    assert config.attention == "mla"
    counts = parameter_counts(config)
    assert (counts["total"], counts["active"]) == hand_count(config)
    assert abs(counts["total"] / published - 1) < tolerance


def test_exact_counts():
    """Pinned so a config edit that changes the model size is a deliberate one."""
    lite = parameter_counts(load_model_config(str(REPO_ROOT / "configs" / "16b.yaml")))
    big = parameter_counts(load_model_config(str(REPO_ROOT / "configs" / "1t.yaml")))
    assert (lite["total"], lite["active"]) == (15_706_484_224, 2_661_150_208)
    assert (big["total"], big["active"]) == (948_348_410_880, 37_597_240_320)
    big_config = load_model_config(str(REPO_ROOT / "configs" / "1t.yaml"))
    assert (big_config.dim, big_config.n_layers, big_config.num_experts, big_config.top_k) == (7168, 61, 384, 8)


def test_1t_128k_is_1t_with_yarn_to_131072_tokens_and_context_parallelism():
    """DeepSeek-V3's extension: YaRN factor 40 over a 4,096-token original context, beta_fast 32, beta_slow 1,
    mscale and mscale_all_dim 1; the same model and balancing loss otherwise (same parameter counts); CP 4 over a
    node's 4 GPUs."""
    from moe_lightning.planner.run_config import read_run_config

    long, base = (load_model_config(str(REPO_ROOT / "configs" / f"{n}.yaml")) for n in ("1t-128k", "1t"))
    assert (long.rope_scaling, long.rope_factor, long.rope_original_max_seq_len) == ("yarn", 40.0, 4096)
    assert (long.rope_beta_fast, long.rope_beta_slow, long.rope_mscale, long.rope_mscale_all_dim) == (32, 1, 1, 1)
    assert long.max_seq_len == 131072 and long.aux_loss_coef == base.aux_loss_coef > 0
    assert parameter_counts(long) == parameter_counts(base)
    run_inputs = read_run_config([str(REPO_ROOT / "configs" / "1t-128k.yaml")])
    assert (run_inputs["seq_len"], run_inputs["context_parallel_size"], run_inputs["gpus_per_node"]) == (131072, 4, 4)


@pytest.mark.parametrize("name", ["16b", "1t", "1t-128k"])
def test_builds_on_meta_device(name):
    config = load_model_config(str(REPO_ROOT / "configs" / f"{name}.yaml"))
    with torch.device("meta"):
        model = MoETransformer(config)
    assert all(p.is_meta for p in model.parameters())
    assert all(b.is_meta for b in model.buffers())


@pytest.mark.parametrize("name", ["16b", "1t", "1t-128k"])
def test_is_valid_lightning_cli_config(name):
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_info:
        run(["fit", "--config", str(REPO_ROOT / "configs" / f"{name}.yaml"), "--print_config"])
    assert exit_info.value.code in (0, None)
    assert "attention: mla" in out.getvalue()
