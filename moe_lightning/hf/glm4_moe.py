"""GLM-4.5 MoE (``Glm4MoeForCausalLM``): GQA with half-split rotary, DeepSeek-V3's router (sigmoid scores, the
balancing bias ``e_score_correction_bias``, groups ranked by their best two scores, renormalised and scaled
weights), shared experts and leading dense blocks. It holds the sigmoid-routed GQA models ``configs/small.yaml``
trains. Only models rotating every query/key dim (``partial_rotary_factor: 1.0``; GLM-4.5 itself rotates half).
"""

from moe_lightning.hf.family import GQAFamily, check_group_size, check_leading_dense, check_shared_experts
from moe_lightning.hf.mapping import Copy, HFFormatError, expert_sources, field, refuse, refuse_common, swiglu_sources
from moe_lightning.model import MoEConfig


class Glm4Moe(GQAFamily):
    ARCHITECTURE, MODEL_TYPE = "Glm4MoeForCausalLM", "glm4_moe"
    # transformers' Glm4MoeConfig defaults for the keys read here that fix no tensor shape
    DEFAULTS = {"rms_norm_eps": 1e-5, "rope_theta": 1e4, "max_position_embeddings": 131072,
                "tie_word_embeddings": False, "num_experts_per_tok": 8, "n_shared_experts": 1,
                "routed_scaling_factor": 1.0, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1,
                "norm_topk_prob": True, "use_qk_norm": False}
    PARTIAL_ROTARY = 0.5  # transformers' Glm4MoeConfig default (set in __post_init__, not a field)

    @classmethod
    def refuse(cls, hf: dict) -> None:
        refuse_common(hf)
        refuse(hf, "use_qk_norm", bool, "GLM-4.5's QK-norm is not implemented")
        partial = (hf.get("rope_parameters") or {}).get("partial_rotary_factor",
                                                        hf.get("partial_rotary_factor", cls.PARTIAL_ROTARY))
        if partial != 1.0:
            raise HFFormatError(f"config.json partial_rotary_factor={partial} is not supported: every query/key dim "
                                "is rotated here.")

    @classmethod
    def fields(cls, hf: dict) -> dict:
        return dict(ffn_hidden=field(hf, "intermediate_size"), n_dense_layers=hf["first_k_dense_replace"] or 0,
                    num_experts=field(hf, "n_routed_experts", "num_local_experts"),
                    top_k=field(hf, "num_experts_per_tok"), expert_hidden=field(hf, "moe_intermediate_size"),
                    n_shared_experts=hf["n_shared_experts"] or 0, score_func="sigmoid",
                    route_norm=bool(hf["norm_topk_prob"]), route_scale=float(hf["routed_scaling_factor"]),
                    n_expert_groups=hf["n_group"] or 1, n_limited_groups=hf["topk_group"] or 1,
                    group_score="top2_sum")

    @classmethod
    def requires(cls, config: MoEConfig) -> dict:
        return dict(qk_norm="none", clip_qkv=None, score_func="sigmoid", group_score="top2_sum", rope_scaling="none")

    @classmethod
    def check(cls, config: MoEConfig) -> None:
        check_leading_dense(config, cls.ARCHITECTURE)
        check_shared_experts(config, cls.ARCHITECTURE)
        check_group_size(config, cls.ARCHITECTURE)

    @classmethod
    def fields_to_hf(cls, config: MoEConfig) -> dict:
        return {"head_dim": config.head_dim, "partial_rotary_factor": 1.0, "intermediate_size": config.ffn_hidden,
                "first_k_dense_replace": config.n_layers - config.n_moe_layers, "n_routed_experts": config.num_experts,
                "num_experts_per_tok": config.top_k, "moe_intermediate_size": config.expert_hidden,
                "n_shared_experts": config.n_shared_experts, "routed_scaling_factor": config.route_scale,
                "n_group": config.n_expert_groups, "topk_group": config.n_limited_groups,
                "norm_topk_prob": config.route_norm, "use_qk_norm": False, "num_nextn_predict_layers": 0}

    @classmethod
    def moe_sources(cls, config: MoEConfig, p: str) -> dict:
        return {"ffn.router.gate.weight": Copy(f"{p}mlp.gate.weight"),
                "ffn.router.expert_bias": Copy(f"{p}mlp.gate.e_score_correction_bias"),
                **expert_sources(config, f"{p}mlp.experts"),
                **swiglu_sources("ffn.shared_experts", f"{p}mlp.shared_experts")}
