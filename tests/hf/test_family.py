"""Every Hugging Face family is the same small interface (``hf.family.Family``), and a new family is one class plus
one line in ``FAMILIES``: a toy family defined here round-trips a model through a folder bitwise."""

import inspect

import torch

from moe_lightning import hf
from moe_lightning.hf.family import Family, GQAFamily
from moe_lightning.hf.mapping import field
from moe_lightning.hf.qwen3_moe import router_and_experts
from moe_lightning.model import MoEConfig, MoETransformer


def test_every_family_has_the_interface():
    for architecture, family in hf.FAMILIES.items():
        assert family.ARCHITECTURE == architecture and isinstance(family.MODEL_TYPE, str)
        assert isinstance(family.DEFAULTS, dict)
        for method in ("config_from_hf", "config_to_hf", "sources"):
            assert callable(getattr(family, method)), (architecture, method)
            ours = inspect.signature(getattr(family, method)).parameters
            assert list(ours)[:1] == list(inspect.signature(getattr(Family, method)).parameters)[:1], method


class ToyMoe(GQAFamily):
    """Interleaved rotary, softmax top-k renormalised, every block MoE, Qwen3's MoE keys."""

    ARCHITECTURE, MODEL_TYPE = "ToyMoeForCausalLM", "toy_moe"
    HALF_SPLIT = False

    @classmethod
    def fields(cls, hf_config: dict) -> dict:
        return dict(ffn_hidden=field(hf_config, "intermediate_size"), n_dense_layers=0,
                    num_experts=field(hf_config, "num_experts"), top_k=field(hf_config, "num_experts_per_tok"),
                    expert_hidden=field(hf_config, "intermediate_size"), n_shared_experts=0, score_func="softmax",
                    route_norm=True, route_scale=1.0, bias_update_rate=0.0)

    @classmethod
    def requires(cls, config: MoEConfig) -> dict:
        return dict(qk_norm="none", n_moe_layers=config.n_layers, n_shared_experts=0, score_func="softmax")

    @classmethod
    def fields_to_hf(cls, config: MoEConfig) -> dict:
        return {"head_dim": config.head_dim, "intermediate_size": config.expert_hidden,
                "num_experts": config.num_experts, "num_experts_per_tok": config.top_k}

    @classmethod
    def moe_sources(cls, config: MoEConfig, p: str) -> dict:
        return router_and_experts(config, p, cls.ARCHITECTURE)


def test_a_new_family_is_one_class_and_one_registry_line(tmp_path, monkeypatch):
    monkeypatch.setitem(hf.FAMILIES, ToyMoe.ARCHITECTURE, ToyMoe)  # the registry line
    config = MoEConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32, ffn_hidden=48,
                       num_experts=4, top_k=2, expert_hidden=48, n_shared_experts=0, n_dense_layers=0,
                       bias_update_rate=0.0)
    torch.manual_seed(0)
    model = MoETransformer(config)
    hf.save_pretrained(model, tmp_path / "toy", architecture=ToyMoe.ARCHITECTURE)
    assert hf.load_config(tmp_path / "toy") == config
    loaded = hf.from_pretrained(tmp_path / "toy")
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
