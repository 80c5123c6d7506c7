"""ERNIE 4.5 MoE: GQA with interleaved rotary (as ours), softmax routing whose top-k is picked with a balancing bias
(``moe_statics.e_score_correction_bias``, our ``expert_bias``), top-k weights renormalised, shared experts, and a
contiguous run of MoE blocks (``moe_layer_start_index`` .. ``moe_layer_end_index``). It is the family that holds
the softmax-routed models with the aux-loss-free bias and a leading dense block that ``configs/tiny.yaml`` trains.
"""

from moe_lightning.hf.family import GQAFamily
from moe_lightning.hf.mapping import Copy, HFFormatError, expert_sources, field, refuse, refuse_common, swiglu_sources
from moe_lightning.model import MoEConfig


class FirstRow(Copy):
    """``ours[...] = hf[0, ...]``: a ``[1, E]`` checkpoint tensor holding our ``[E]`` one."""

    def check(self, shape_of, shape, name) -> None:
        if tuple(shape_of(self.key)) != (1, *shape):
            raise HFFormatError(f"checkpoint tensor {self.key!r} has shape {tuple(shape_of(self.key))}, but {name} "
                                f"needs {(1, *shape)}: config.json does not describe these weights.")

    def read(self, get, index):
        return get(self.key)[(slice(0, 1), *index)][0]

    def write(self, tensor, name):
        return {self.key: tensor[None]}


class Ernie45Moe(GQAFamily):
    ARCHITECTURE, MODEL_TYPE = "Ernie4_5_MoeForCausalLM", "ernie4_5_moe"
    HALF_SPLIT = False  # ERNIE rotates interleaved pairs, as we do
    # transformers' Ernie4_5_MoeConfig defaults for the keys read here that fix no tensor shape
    DEFAULTS = {"rms_norm_eps": 1e-5, "rope_theta": 5e5, "max_position_embeddings": 131072,
                "tie_word_embeddings": True, "moe_k": 6, "moe_num_shared_experts": 2, "moe_layer_start_index": 1,
                "moe_layer_end_index": -1, "moe_layer_interval": 1, "use_bias": False}

    @classmethod
    def refuse(cls, hf: dict) -> None:
        refuse_common(hf)
        refuse(hf, "use_bias", bool, "projections have no biases here")

    @classmethod
    def fields(cls, hf: dict) -> dict:
        L = field(hf, "num_hidden_layers")
        start, end, every = hf["moe_layer_start_index"], hf["moe_layer_end_index"], hf["moe_layer_interval"]
        end = L - 1 if end == -1 else end
        dense = [i for i in range(L) if not ((i + 1) % every == 0 and start <= i <= end)]  # transformers' rule
        leading = dense == list(range(len(dense)))
        return dict(ffn_hidden=field(hf, "intermediate_size"), n_dense_layers=len(dense) if leading else 0,
                    dense_layers=None if leading else dense, num_experts=field(hf, "moe_num_experts", "num_experts"),
                    top_k=field(hf, "moe_k"), expert_hidden=field(hf, "moe_intermediate_size"),
                    n_shared_experts=hf["moe_num_shared_experts"] or 0, score_func="softmax", route_norm=True,
                    route_scale=1.0)

    @classmethod
    def requires(cls, config: MoEConfig) -> dict:
        return dict(qk_norm="none", clip_qkv=None, score_func="softmax", route_norm=True, route_scale=1.0,
                    n_expert_groups=1, rope_scaling="none")

    @classmethod
    def check(cls, config: MoEConfig) -> None:
        moe = [i for i in range(config.n_layers) if config.is_moe_layer(i)]
        if not moe or moe != list(range(moe[0], moe[-1] + 1)):
            raise HFFormatError(f"MoEConfig.dense_layers={config.dense_layers} cannot be written as "
                                f"{cls.ARCHITECTURE}, whose MoE blocks are one contiguous run: choose another "
                                "architecture.")

    @classmethod
    def fields_to_hf(cls, config: MoEConfig) -> dict:
        moe = [i for i in range(config.n_layers) if config.is_moe_layer(i)]
        return {"head_dim": config.head_dim, "intermediate_size": config.ffn_hidden, "use_bias": False,
                "moe_intermediate_size": config.expert_hidden, "moe_num_experts": config.num_experts,
                "moe_k": config.top_k, "moe_num_shared_experts": config.n_shared_experts,
                "moe_layer_start_index": moe[0], "moe_layer_end_index": moe[-1], "moe_layer_interval": 1}

    @classmethod
    def moe_sources(cls, config: MoEConfig, p: str) -> dict:
        out = {"ffn.router.gate.weight": Copy(f"{p}mlp.gate.weight"),
               "ffn.router.expert_bias": FirstRow(f"{p}mlp.moe_statics.e_score_correction_bias"),
               **expert_sources(config, f"{p}mlp.experts")}
        if config.n_shared_experts:
            out.update(swiglu_sources("ffn.shared_experts", f"{p}mlp.shared_experts"))
        return out
