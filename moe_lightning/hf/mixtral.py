"""Mixtral: GQA with half-split rotary, softmax top-k routing renormalised over the chosen experts, every block MoE."""

from ..model import MoEConfig
from .mapping import (Copy, check_representable, common_config, common_to_hf, expert_sources, field, gqa_sources,
                      layer_sources, no_bias_slot, outer_sources, refuse_common)


class Mixtral:
    ARCHITECTURE, MODEL_TYPE = "MixtralForCausalLM", "mixtral"

    @staticmethod
    def config_from_hf(hf: dict) -> MoEConfig:
        refuse_common(hf)
        return MoEConfig(**common_config(hf), ffn_hidden=hf["intermediate_size"], n_dense_layers=0,
                         num_experts=field(hf, "num_local_experts", "num_experts"), top_k=hf["num_experts_per_tok"],
                         expert_hidden=hf["intermediate_size"], n_shared_experts=0, score_func="softmax",
                         route_norm=True, route_scale=1.0, attention="gqa")

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
