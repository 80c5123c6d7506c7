"""OLMoE: GQA with half-split rotary, QK-norm over the whole q and k projections, optional ``clip_qkv``,
softmax routing, every block MoE."""

from moe_lightning.hf.family import GQAFamily
from moe_lightning.hf.mapping import HFFormatError, field, gqa_sources
from moe_lightning.hf.qwen3_moe import qk_norm_sources, router_and_experts
from moe_lightning.model import MoEConfig


class Olmoe(GQAFamily):
    ARCHITECTURE, MODEL_TYPE = "OlmoeForCausalLM", "olmoe"
    # transformers' OlmoeConfig defaults for the keys read here that fix no tensor shape
    DEFAULTS = {"rms_norm_eps": 1e-5, "rope_theta": 1e4, "max_position_embeddings": 4096,
                "tie_word_embeddings": False, "num_experts_per_tok": 8, "norm_topk_prob": False, "clip_qkv": None,
                "num_key_value_heads": None}

    @classmethod
    def fields(cls, hf: dict) -> dict:
        hidden = field(hf, "intermediate_size")
        return dict(ffn_hidden=hidden, n_dense_layers=0, num_experts=field(hf, "num_experts", "num_local_experts"),
                    top_k=field(hf, "num_experts_per_tok"), expert_hidden=hidden, n_shared_experts=0,
                    score_func="softmax", route_norm=bool(hf["norm_topk_prob"]), route_scale=1.0, qk_norm="full",
                    clip_qkv=hf["clip_qkv"],
                    bias_update_rate=0.0)  # no slot for a balancing bias: keep it zero, so it can be saved

    @classmethod
    def requires(cls, config: MoEConfig) -> dict:
        return dict(qk_norm="full", n_moe_layers=config.n_layers, n_shared_experts=0, score_func="softmax",
                    route_scale=1.0, n_expert_groups=1)

    @classmethod
    def check(cls, config: MoEConfig) -> None:
        if config.head_dim * config.n_heads != config.dim:  # its q_norm is always hidden_size wide
            raise HFFormatError(f"MoEConfig.head_dim={config.head_dim} cannot be written as {cls.ARCHITECTURE}, "
                                f"whose heads are hidden_size / num_attention_heads = {config.dim}/{config.n_heads} "
                                f"wide: set head_dim=None with dim a multiple of n_heads, or choose "
                                f"another architecture.")

    @classmethod
    def fields_to_hf(cls, config: MoEConfig) -> dict:
        return {"intermediate_size": config.expert_hidden, "num_experts": config.num_experts,
                "num_experts_per_tok": config.top_k, "norm_topk_prob": config.route_norm, "clip_qkv": config.clip_qkv}

    @classmethod
    def attention_sources(cls, config: MoEConfig, p: str) -> dict:
        return {**gqa_sources(config, p, half_split=True),
                **qk_norm_sources(p, config.n_heads, config.n_kv_heads, config.head_dim)}

    @classmethod
    def moe_sources(cls, config: MoEConfig, p: str) -> dict:
        return router_and_experts(config, p, cls.ARCHITECTURE)
