"""DeepSeek-V3 (also Kimi-K2, Moonlight) and DeepSeek-V2 / V2-Lite: MLA, shared experts, leading dense blocks.

Their checkpoints already rotate interleaved pairs (transformers' ``rope_interleave=True``), as we do, so no
rows move. V3 routes with sigmoid scores, a balancing bias (``e_score_correction_bias``) and groups ranked by
their best two scores; V2 with softmax, no bias, groups ranked by their best score, weights never renormalised. Both are :class:`~moe_lightning.hf.family.Family` classes of their
own (MLA, MTP layers and the FP8 releases share no skeleton with the GQA families).
"""

import torch

from moe_lightning.hf.family import check_group_size, check_leading_dense, check_shared_experts
from moe_lightning.model import MoEConfig
from moe_lightning.hf.mapping import (Copy, HFFormatError, Rows, Shared, check_representable, common_config, common_to_hf,
                      expert_sources, field, half_split_perm, layer_sources, no_bias_slot, outer_sources, refuse,
                      refuse_common, swiglu_sources, with_defaults)

V3, V2 = "DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM"
LATENT_NORM_EPS = 1e-6  # transformers builds q_a_layernorm / kv_a_layernorm with this, whatever rms_norm_eps says


def _mla_config(hf: dict) -> dict:
    """The fields V2 and V3 share; ``hf`` already holds the family's defaults."""
    refuse_common(hf)
    refuse(hf, "moe_layer_freq", lambda v: v not in (None, 1), "only every block after first_k_dense_replace is MoE")
    fields = common_config(hf)
    fields.update(head_dim=None, mla_norm_eps=LATENT_NORM_EPS, n_kv_heads=fields["n_heads"], attention="mla",
                  q_lora_rank=field(hf, "q_lora_rank", nullable=True) or 0, kv_lora_rank=field(hf, "kv_lora_rank"),
                  qk_nope_head_dim=field(hf, "qk_nope_head_dim"), qk_rope_head_dim=field(hf, "qk_rope_head_dim"),
                  v_head_dim=field(hf, "v_head_dim"), ffn_hidden=field(hf, "intermediate_size"),
                  n_dense_layers=hf["first_k_dense_replace"] or 0,
                  num_experts=field(hf, "n_routed_experts", "num_local_experts"),
                  top_k=field(hf, "num_experts_per_tok"), expert_hidden=field(hf, "moe_intermediate_size"),
                  n_shared_experts=hf["n_shared_experts"] or 0, route_scale=float(field(hf, "routed_scaling_factor")))
    return fields


def _mla_to_hf(config: MoEConfig, architecture: str, model_type: str) -> dict:
    check_representable(config, architecture, attention="mla")
    latent_eps = config.norm_eps if config.mla_norm_eps is None else config.mla_norm_eps
    if latent_eps != LATENT_NORM_EPS:
        raise HFFormatError(f"MoEConfig.mla_norm_eps={config.mla_norm_eps} (latent norms use {latent_eps}) cannot be "
                            f"written as {architecture}, whose latent norms always use {LATENT_NORM_EPS}: set "
                            f"mla_norm_eps={LATENT_NORM_EPS}.")
    check_leading_dense(config, architecture)
    check_shared_experts(config, architecture)
    dense = config.n_layers - config.n_moe_layers
    return {**common_to_hf(config, architecture, model_type), "num_key_value_heads": config.n_heads,
            "q_lora_rank": config.q_lora_rank or None, "kv_lora_rank": config.kv_lora_rank,
            "qk_nope_head_dim": config.qk_nope_head_dim, "qk_rope_head_dim": config.qk_rope_head_dim,
            "v_head_dim": config.v_head_dim, "intermediate_size": config.ffn_hidden, "first_k_dense_replace": dense,
            "moe_layer_freq": 1, "n_routed_experts": config.num_experts, "num_experts_per_tok": config.top_k,
            "moe_intermediate_size": config.expert_hidden, "n_shared_experts": config.n_shared_experts,
            "routed_scaling_factor": config.route_scale, "n_group": config.n_expert_groups,
            "topk_group": config.n_limited_groups}


def _rope_rows(heads: int, nope: int, rope: int) -> torch.Tensor:
    """Rows of ``heads`` blocks ``[nope | rope]`` with each rope part taken from half-split to interleaved."""
    perm = torch.arange(heads * (nope + rope)).view(heads, nope + rope)
    perm[:, nope:] = nope + half_split_perm(1, rope) + (nope + rope) * torch.arange(heads)[:, None]
    return perm.flatten()


def _sources(config: MoEConfig, bias, interleaved: bool = True) -> dict:
    H, N, R, C = config.n_heads, config.qk_nope_head_dim, config.qk_rope_head_dim, config.kv_lora_rank

    def rows(key, heads, nope):
        return Copy(key) if interleaved else Rows(key, _rope_rows(heads, nope, R))

    def attention(p):
        a = f"{p}self_attn."
        out = {"attention.wkv_a.weight": rows(f"{a}kv_a_proj_with_mqa.weight", 1, C),
               "attention.kv_norm.weight": Copy(f"{a}kv_a_layernorm.weight"),
               "attention.wkv_b.weight": Copy(f"{a}kv_b_proj.weight"), "attention.wo.weight": Copy(f"{a}o_proj.weight")}
        if config.q_lora_rank:
            out.update({"attention.wq_a.weight": Copy(f"{a}q_a_proj.weight"),
                        "attention.q_norm.weight": Copy(f"{a}q_a_layernorm.weight"),
                        "attention.wq_b.weight": rows(f"{a}q_b_proj.weight", H, N)})
        else:
            out["attention.wq.weight"] = rows(f"{a}q_proj.weight", H, N)
        return out

    def moe(p):
        return {"ffn.router.gate.weight": Copy(f"{p}mlp.gate.weight"), "ffn.router.expert_bias": bias(p),
                **expert_sources(config, f"{p}mlp.experts"),
                **swiglu_sources("ffn.shared_experts", f"{p}mlp.shared_experts")}

    out = outer_sources(config)
    for i in range(config.n_layers):
        out.update(layer_sources(config, i, attention(f"model.layers.{i}."), moe))
    out.update(_mtp_sources(config, attention, moe, out))
    return out


def _mtp_sources(config: MoEConfig, attention, moe, outer: dict) -> dict:
    """DeepSeek-V3's multi-token prediction layers ``model.layers.{n_layers + k}``: ``enorm``, ``hnorm``,
    ``eh_proj``, ``shared_head.norm``, a block shaped like the last main one, and copies of the embedding and
    head (``embed_tokens``, ``shared_head.head``), which the main tensors' sources read and check."""
    out, embeddings, heads = {}, [], []
    for k in range(config.mtp_layers):
        i = config.n_layers + k
        p = f"model.layers.{i}."
        out.update(layer_sources(config, i, attention(p), moe, ours=f"mtp.{k}.block",
                                 is_moe=config.is_moe_layer(config.n_layers - 1)))
        out.update({f"mtp.{k}.enorm.weight": Copy(f"{p}enorm.weight"), f"mtp.{k}.hnorm.weight": Copy(f"{p}hnorm.weight"),
                    f"mtp.{k}.eh_proj.weight": Copy(f"{p}eh_proj.weight"),
                    f"mtp.{k}.norm.weight": Copy(f"{p}shared_head.norm.weight")})
        embeddings.append(f"{p}embed_tokens.weight")
        heads.append(f"{p}shared_head.head.weight")
    if config.mtp_layers:
        out["tok_embeddings.weight"] = Shared(outer["tok_embeddings.weight"].key, embeddings)
        out["output.weight"] = Shared(outer["output.weight"].key, heads)
    return out


class DeepseekV3:
    ARCHITECTURE, MODEL_TYPE = V3, "deepseek_v3"
    # transformers' DeepseekV3Config defaults for the keys read here that fix no tensor shape
    DEFAULTS = {"rms_norm_eps": 1e-6, "rope_theta": 1e4, "max_position_embeddings": 4096,
                "tie_word_embeddings": False, "num_experts_per_tok": 8, "norm_topk_prob": True,
                "routed_scaling_factor": 2.5, "n_group": 8, "topk_group": 4, "first_k_dense_replace": 3,
                "n_shared_experts": 1, "rope_interleave": True}

    @classmethod
    def config_from_hf(cls, hf: dict) -> MoEConfig:
        hf = with_defaults(hf, cls.DEFAULTS)
        refuse(hf, "scoring_func", lambda v: v not in (None, "sigmoid"), "DeepSeek-V3 routes with sigmoid scores")
        refuse(hf, "topk_method", lambda v: v not in (None, "noaux_tc"),
               "DeepSeek-V3 routes with topk_method='noaux_tc'")
        # transformers' default for an absent num_nextn_predict_layers is 1, but its main model never reads those
        # layers: only the checkpoint's own count says that they are there (and hf.read_hf_config sets a count
        # without the layers' tensors to 0: transformers writes the default 1 but saves no MTP layer)
        return MoEConfig(**_mla_config(hf), score_func="sigmoid", route_norm=bool(hf["norm_topk_prob"]),
                         n_expert_groups=hf["n_group"] or 1, n_limited_groups=hf["topk_group"] or 1,
                         group_score="top2_sum", mtp_layers=hf.get("num_nextn_predict_layers") or 0)

    @staticmethod
    def config_to_hf(config: MoEConfig) -> dict:
        check_representable(config, V3, score_func="sigmoid", group_score="top2_sum")
        check_group_size(config, V3)
        return {**_mla_to_hf(config, V3, "deepseek_v3"), "norm_topk_prob": config.route_norm,
                "scoring_func": "sigmoid", "topk_method": "noaux_tc", "rope_interleave": True,
                "num_nextn_predict_layers": config.mtp_layers}

    @classmethod
    def sources(cls, config: MoEConfig, hf: dict | None = None) -> dict:
        interleaved = with_defaults(hf or {}, cls.DEFAULTS)["rope_interleave"]
        return _sources(config, lambda p: Copy(f"{p}mlp.gate.e_score_correction_bias"), interleaved)


class DeepseekV2:
    ARCHITECTURE, MODEL_TYPE = V2, "deepseek_v2"
    # transformers' DeepseekV2Config defaults for the keys read here that fix no tensor shape (None: required)
    DEFAULTS = {"rms_norm_eps": 1e-6, "rope_theta": 1e4, "max_position_embeddings": 2048,
                "tie_word_embeddings": False, "num_experts_per_tok": None, "norm_topk_prob": False,
                "routed_scaling_factor": 1.0, "n_group": None, "topk_group": None, "topk_method": "greedy",
                "first_k_dense_replace": 0, "n_shared_experts": 2}

    @classmethod
    def config_from_hf(cls, hf: dict) -> MoEConfig:
        hf = with_defaults(hf, cls.DEFAULTS)
        refuse(hf, "scoring_func", lambda v: v not in (None, "softmax"), "DeepSeek-V2 routes with softmax scores")
        refuse(hf, "topk_method", lambda v: v not in (None, "greedy", "group_limited_greedy"),
               "DeepSeek-V2 routes with 'greedy' or 'group_limited_greedy'")
        refuse(hf, "norm_topk_prob", bool, "transformers' DeepSeek-V2 ignores it (never renormalises) while the "
               "original code renormalises, so the intended computation is ambiguous")
        grouped = hf["topk_method"] == "group_limited_greedy"
        return MoEConfig(**_mla_config(hf), score_func="softmax", route_norm=False,
                         n_expert_groups=field(hf, "n_group") if grouped else 1,
                         n_limited_groups=field(hf, "topk_group") if grouped else 1, group_score="max",
                         bias_update_rate=0.0)  # no slot for a balancing bias: keep it zero, so it can be saved

    @staticmethod
    def config_to_hf(config: MoEConfig) -> dict:
        check_representable(config, V2, score_func="softmax", route_norm=False)
        grouped = config.n_expert_groups > 1
        if grouped:
            check_representable(config, V2, group_score="max")
        return {**_mla_to_hf(config, V2, "deepseek_v2"), "norm_topk_prob": False, "scoring_func": "softmax",
                "topk_method": "group_limited_greedy" if grouped else "greedy"}

    @staticmethod
    def sources(config: MoEConfig, hf: dict | None = None) -> dict:
        return _sources(config, lambda p: no_bias_slot(V2))
