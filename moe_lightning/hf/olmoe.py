"""OLMoE: GQA with half-split rotary, QK-norm over the whole q and k projections, optional ``clip_qkv``,
softmax routing, every block MoE."""

from ..model import MoEConfig
from .mapping import (check_representable, common_config, common_to_hf, field, gqa_sources, layer_sources,
                      outer_sources, refuse_common)
from .qwen3_moe import qk_norm_sources, router_and_experts


class Olmoe:
    ARCHITECTURE, MODEL_TYPE = "OlmoeForCausalLM", "olmoe"

    @staticmethod
    def config_from_hf(hf: dict) -> MoEConfig:
        refuse_common(hf)
        return MoEConfig(**common_config(hf), ffn_hidden=hf["intermediate_size"], n_dense_layers=0,
                         num_experts=field(hf, "num_experts", "num_local_experts"), top_k=hf["num_experts_per_tok"],
                         expert_hidden=hf["intermediate_size"], n_shared_experts=0, score_func="softmax",
                         route_norm=bool(hf.get("norm_topk_prob", False)), route_scale=1.0, attention="gqa",
                         qk_norm="full", clip_qkv=hf.get("clip_qkv"))

    @classmethod
    def config_to_hf(cls, config: MoEConfig) -> dict:
        check_representable(config, cls.ARCHITECTURE, attention="gqa", qk_norm="full", n_moe_layers=config.n_layers,
                            n_shared_experts=0, score_func="softmax", route_scale=1.0, n_expert_groups=1)
        return {**common_to_hf(config, cls.ARCHITECTURE, cls.MODEL_TYPE), "num_key_value_heads": config.n_kv_heads,
                "intermediate_size": config.expert_hidden, "num_experts": config.num_experts,
                "num_experts_per_tok": config.top_k, "norm_topk_prob": config.route_norm, "clip_qkv": config.clip_qkv}

    @classmethod
    def sources(cls, config: MoEConfig, hf: dict | None = None) -> dict:
        out = outer_sources(config)
        for i in range(config.n_layers):
            p = f"model.layers.{i}."
            attention = {**gqa_sources(config, p, half_split=True),
                         **qk_norm_sources(p, config.n_heads, config.n_kv_heads, config.head_dim)}
            out.update(layer_sources(config, i, attention, lambda p: router_and_experts(config, p, cls.ARCHITECTURE)))
        return out
