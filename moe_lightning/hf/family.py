"""What a Hugging Face family is: one class with ``ARCHITECTURE`` and ``MODEL_TYPE`` (config.json's), ``DEFAULTS``
(transformers' config-class defaults for the keys read that fix no tensor shape), ``config_from_hf``,
``config_to_hf`` and ``sources`` (each of our tensors, by name, as a function of checkpoint keys). Adding a family
is a file with its class and a line in ``pretrained.FAMILIES``.

:class:`GQAFamily` is the skeleton the GQA families share (Mixtral, Qwen3-MoE, OLMoE, ERNIE 4.5, GLM-4.5): each
says only its routing fields, what it refuses and requires, and its MoE block's keys.
"""

from typing import ClassVar, Protocol

from moe_lightning.hf.mapping import (HFFormatError, Source, check_representable, common_to_hf, gqa_config,
                                      gqa_sources, layer_sources, outer_sources, refuse_common, with_defaults)
from moe_lightning.model import MoEConfig


class Family(Protocol):
    ARCHITECTURE: ClassVar[str]
    MODEL_TYPE: ClassVar[str]
    DEFAULTS: ClassVar[dict]

    @classmethod
    def config_from_hf(cls, hf: dict) -> MoEConfig:
        """config.json (absent keys as transformers defaults them) as our config; what cannot be computed refused."""

    @classmethod
    def config_to_hf(cls, config: MoEConfig) -> dict:
        """Our config as this family's config.json; what the family cannot hold refused, naming the field."""

    @classmethod
    def sources(cls, config: MoEConfig, hf: dict | None = None) -> dict[str, Source]:
        """Our tensor name -> its :class:`~moe_lightning.hf.mapping.Source` in the checkpoint's keys."""


class GQAFamily:
    """``config_from_hf``: defaults, ``refuse``, then ``gqa_config`` plus ``fields``. ``config_to_hf``: ``requires``
    (field -> the value the format holds), ``check``, then ``common_to_hf`` plus ``fields_to_hf``. ``sources``: the
    embedding, norm and head, and per block its norms, ``attention_sources`` and a dense FFN or ``moe_sources``."""

    ARCHITECTURE: ClassVar[str]
    MODEL_TYPE: ClassVar[str]
    DEFAULTS: ClassVar[dict] = {}
    HALF_SPLIT: ClassVar[bool] = True  # rotary pairs (j, j + K/2), reordered on import; False: interleaved as ours

    @classmethod
    def config_from_hf(cls, hf: dict) -> MoEConfig:
        hf = with_defaults(hf, cls.DEFAULTS)
        cls.refuse(hf)
        return MoEConfig(**gqa_config(hf), attention="gqa", **cls.fields(hf))

    @classmethod
    def refuse(cls, hf: dict) -> None:
        refuse_common(hf)

    @classmethod
    def fields(cls, hf: dict) -> dict:
        """Our FFN, expert and routing fields from config.json (with defaults)."""
        raise NotImplementedError

    @classmethod
    def config_to_hf(cls, config: MoEConfig) -> dict:
        check_representable(config, cls.ARCHITECTURE, attention="gqa", **cls.requires(config))
        cls.check(config)
        return {**common_to_hf(config, cls.ARCHITECTURE, cls.MODEL_TYPE), "num_key_value_heads": config.n_kv_heads,
                **cls.fields_to_hf(config)}

    @classmethod
    def requires(cls, config: MoEConfig) -> dict:
        return {}

    @classmethod
    def check(cls, config: MoEConfig) -> None:
        """Refusals beyond single field values (layer patterns, head sizes)."""

    @classmethod
    def fields_to_hf(cls, config: MoEConfig) -> dict:
        raise NotImplementedError

    @classmethod
    def sources(cls, config: MoEConfig, hf: dict | None = None) -> dict[str, Source]:
        out = outer_sources(config)
        for i in range(config.n_layers):
            out.update(layer_sources(config, i, cls.attention_sources(config, f"model.layers.{i}."),
                                     lambda p: cls.moe_sources(config, p)))
        return out

    @classmethod
    def attention_sources(cls, config: MoEConfig, p: str) -> dict[str, Source]:
        return gqa_sources(config, p, half_split=cls.HALF_SPLIT)

    @classmethod
    def moe_sources(cls, config: MoEConfig, p: str) -> dict[str, Source]:
        raise NotImplementedError


def check_leading_dense(config: MoEConfig, architecture: str) -> None:
    """Formats whose dense blocks are the first ``first_k_dense_replace`` (DeepSeek, GLM-4.5)."""
    dense = config.n_layers - config.n_moe_layers
    if any(config.is_moe_layer(i) != (i >= dense) for i in range(config.n_layers)):
        raise HFFormatError(f"MoEConfig.dense_layers={config.dense_layers} cannot be written as {architecture}, whose "
                            f"dense blocks are the first first_k_dense_replace: use Qwen3MoeForCausalLM's pattern.")


def check_shared_experts(config: MoEConfig, architecture: str) -> None:
    if config.n_shared_experts < 1:
        raise HFFormatError(f"MoEConfig.n_shared_experts=0 cannot be written as {architecture}, which always has "
                            f"shared experts: choose another architecture.")


def check_group_size(config: MoEConfig, architecture: str) -> None:
    """transformers' grouped router ranks a group by its best two scores: every group needs 2 experts."""
    if config.num_experts < 2 * config.n_expert_groups:
        raise HFFormatError(f"MoEConfig.n_expert_groups={config.n_expert_groups} with num_experts="
                            f"{config.num_experts} makes groups of fewer than 2 experts, which {architecture} cannot "
                            f"route (it ranks a group by its best two scores): use at most "
                            f"{config.num_experts // 2} groups.")
