"""Mixtral: GQA with half-split rotary, softmax top-k routing renormalised over the chosen experts, every block MoE."""

from moe_lightning.hf.family import GQAFamily
from moe_lightning.hf.mapping import Copy, expert_sources, field, no_bias_slot
from moe_lightning.model import MoEConfig


class Mixtral(GQAFamily):
    ARCHITECTURE, MODEL_TYPE = "MixtralForCausalLM", "mixtral"
    # transformers' MixtralConfig defaults for the keys read here that fix no tensor shape
    DEFAULTS = {"rms_norm_eps": 1e-5, "rope_theta": 1e6, "max_position_embeddings": 131072,
                "tie_word_embeddings": False, "num_experts_per_tok": 2}

    @classmethod
    def fields(cls, hf: dict) -> dict:
        hidden = field(hf, "intermediate_size")
        return dict(ffn_hidden=hidden, n_dense_layers=0, num_experts=field(hf, "num_local_experts", "num_experts"),
                    top_k=field(hf, "num_experts_per_tok"), expert_hidden=hidden, n_shared_experts=0,
                    score_func="softmax", route_norm=True, route_scale=1.0,
                    bias_update_rate=0.0)  # no slot for a balancing bias: keep it zero, so it can be saved

    @classmethod
    def requires(cls, config: MoEConfig) -> dict:
        return dict(qk_norm="none", clip_qkv=None, n_moe_layers=config.n_layers, n_shared_experts=0,
                    score_func="softmax", route_norm=True, route_scale=1.0, n_expert_groups=1)

    @classmethod
    def fields_to_hf(cls, config: MoEConfig) -> dict:
        return {"head_dim": config.head_dim, "intermediate_size": config.expert_hidden,
                "num_local_experts": config.num_experts, "num_experts_per_tok": config.top_k, "sliding_window": None}

    @classmethod
    def moe_sources(cls, config: MoEConfig, p: str) -> dict:
        return {"ffn.router.gate.weight": Copy(f"{p}block_sparse_moe.gate.weight"),
                "ffn.router.expert_bias": no_bias_slot(cls.ARCHITECTURE),
                **expert_sources(config, f"{p}block_sparse_moe.experts", ("w1", "w3", "w2"))}
