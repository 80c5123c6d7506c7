"""Qwen3-MoE: GQA with half-split rotary and per-head QK-norm, softmax routing, dense blocks in any pattern."""

from moe_lightning.hf.family import GQAFamily
from moe_lightning.hf.mapping import (Copy, Rows, expert_sources, field, gqa_sources, half_split_perm, no_bias_slot,
                                      refuse, refuse_common)
from moe_lightning.model import MoEConfig


def qk_norm_sources(p: str, q_heads: int, k_heads: int, head_dim: int) -> dict:
    """QK-norm weights act on rotary dims before rotation, so they move with the q/k rows."""
    return {"attention.q_norm.weight": Rows(f"{p}self_attn.q_norm.weight", half_split_perm(q_heads, head_dim)),
            "attention.k_norm.weight": Rows(f"{p}self_attn.k_norm.weight", half_split_perm(k_heads, head_dim))}


def router_and_experts(config: MoEConfig, p: str, architecture: str) -> dict:
    """``mlp.gate`` + ``mlp.experts.{e}.{gate,up,down}_proj``, no shared experts, no bias slot."""
    return {"ffn.router.gate.weight": Copy(f"{p}mlp.gate.weight"), "ffn.router.expert_bias": no_bias_slot(architecture),
            **expert_sources(config, f"{p}mlp.experts")}


class Qwen3Moe(GQAFamily):
    ARCHITECTURE, MODEL_TYPE = "Qwen3MoeForCausalLM", "qwen3_moe"
    # transformers' Qwen3MoeConfig defaults for the keys read here that fix no tensor shape
    DEFAULTS = {"rms_norm_eps": 1e-6, "rope_theta": 1e4, "max_position_embeddings": 32768,
                "tie_word_embeddings": False, "num_experts_per_tok": 8, "norm_topk_prob": False,
                "decoder_sparse_step": 1, "mlp_only_layers": None, "use_sliding_window": False}

    @classmethod
    def refuse(cls, hf: dict) -> None:
        refuse(hf, "use_sliding_window", bool, "sliding-window attention is not implemented")
        refuse_common({**hf, "sliding_window": None})  # transformers ignores it unless use_sliding_window

    @classmethod
    def fields(cls, hf: dict) -> dict:
        L, step = field(hf, "num_hidden_layers"), field(hf, "decoder_sparse_step")
        only = set(hf["mlp_only_layers"] or [])
        dense = [i for i in range(L) if i in only or (i + 1) % step]  # transformers' rule for which blocks are MoE
        return dict(ffn_hidden=field(hf, "intermediate_size"), n_dense_layers=0, dense_layers=dense or None,
                    num_experts=field(hf, "num_experts", "num_local_experts"), top_k=field(hf, "num_experts_per_tok"),
                    expert_hidden=field(hf, "moe_intermediate_size"), n_shared_experts=0, score_func="softmax",
                    route_norm=bool(hf["norm_topk_prob"]), route_scale=1.0, qk_norm="head",
                    bias_update_rate=0.0)  # no slot for a balancing bias: keep it zero, so it can be saved

    @classmethod
    def requires(cls, config: MoEConfig) -> dict:
        return dict(qk_norm="head", clip_qkv=None, n_shared_experts=0, score_func="softmax", route_scale=1.0,
                    n_expert_groups=1)

    @classmethod
    def fields_to_hf(cls, config: MoEConfig) -> dict:
        dense = [i for i in range(config.n_layers) if not config.is_moe_layer(i)]
        return {"head_dim": config.head_dim, "intermediate_size": config.ffn_hidden,
                "moe_intermediate_size": config.expert_hidden, "num_experts": config.num_experts,
                "num_experts_per_tok": config.top_k, "norm_topk_prob": config.route_norm, "decoder_sparse_step": 1,
                "mlp_only_layers": dense, "use_sliding_window": False, "sliding_window": None}

    @classmethod
    def attention_sources(cls, config: MoEConfig, p: str) -> dict:
        return {**gqa_sources(config, p, half_split=True), **qk_norm_sources(p, 1, 1, config.head_dim)}

    @classmethod
    def moe_sources(cls, config: MoEConfig, p: str) -> dict:
        return router_and_experts(config, p, cls.ARCHITECTURE)
