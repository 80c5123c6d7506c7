"""Mixtral: GQA with half-split rotary, softmax top-k routing renormalised over the chosen experts, every block MoE."""

from moe_lightning.model import MoEConfig
from moe_lightning.hf.mapping import (Copy, check_representable, common_to_hf, expert_sources, field, gqa_config, gqa_sources,
                      layer_sources, no_bias_slot, outer_sources, refuse_common, with_defaults)


class Mixtral:
    ARCHITECTURE, MODEL_TYPE = "MixtralForCausalLM", "mixtral"
    # transformers' MixtralConfig defaults for the keys read here that fix no tensor shape
    DEFAULTS = {"rms_norm_eps": 1e-5, "rope_theta": 1e6, "max_position_embeddings": 131072,
                "tie_word_embeddings": False, "num_experts_per_tok": 2}

    @classmethod
    def config_from_hf(cls, hf: dict) -> MoEConfig:
        hf = with_defaults(hf, cls.DEFAULTS)
        refuse_common(hf)
        hidden = field(hf, "intermediate_size")
        return MoEConfig(**gqa_config(hf), ffn_hidden=hidden, n_dense_layers=0,
                         num_experts=field(hf, "num_local_experts", "num_experts"),
                         top_k=field(hf, "num_experts_per_tok"), expert_hidden=hidden, n_shared_experts=0,
                         score_func="softmax", route_norm=True, route_scale=1.0, attention="gqa",
                         bias_update_rate=0.0)  # no slot for a balancing bias: keep it zero, so it can be saved

    @classmethod
    def config_to_hf(cls, config: MoEConfig) -> dict:
        check_representable(config, cls.ARCHITECTURE, attention="gqa", qk_norm="none", clip_qkv=None,
                            n_moe_layers=config.n_layers, n_shared_experts=0, score_func="softmax", route_norm=True,
                            route_scale=1.0, n_expert_groups=1)
        return {**common_to_hf(config, cls.ARCHITECTURE, cls.MODEL_TYPE), "num_key_value_heads": config.n_kv_heads,
                "head_dim": config.head_dim, "intermediate_size": config.expert_hidden,
                "num_local_experts": config.num_experts, "num_experts_per_tok": config.top_k, "sliding_window": None}

    @classmethod
    def sources(cls, config: MoEConfig, hf: dict | None = None) -> dict:
        def moe(p):
            return {"ffn.router.gate.weight": Copy(f"{p}block_sparse_moe.gate.weight"),
                    "ffn.router.expert_bias": no_bias_slot(cls.ARCHITECTURE),
                    **expert_sources(config, f"{p}block_sparse_moe.experts", ("w1", "w3", "w2"))}
        out = outer_sources(config)
        for i in range(config.n_layers):
            out.update(layer_sources(config, i, gqa_sources(config, f"model.layers.{i}.", half_split=True), moe))
        return out
