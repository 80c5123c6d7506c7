"""Model hyperparameters, validated when built so a bad YAML fails before any tensor is allocated."""

import warnings
from dataclasses import dataclass
from typing import Literal, Optional


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field and the fix."""


@dataclass
class MoEConfig:
    """Shape and routing of a decoder-only MoE transformer.

    Args:
        vocab_size: Embedding rows; must be at least the tokenizer's vocabulary (byte level: 257).
        dim: Width of the residual stream.
        n_layers: Number of transformer blocks.
        n_heads: Query heads.
        n_kv_heads: Key/value heads for grouped-query attention (must divide ``n_heads``).
        head_dim: Per-head width; ``None`` means ``dim // n_heads``.
        max_seq_len: Longest sequence the rotary table covers.
        rope_theta: Rotary base frequency.
        rope_scaling: Rotary scaling rule: ``none`` or ``yarn`` (context extension; the ``rope_*`` fields below).
        rope_factor: YaRN context-extension factor (DeepSeek-V3 publishes 40).
        rope_original_max_seq_len: YaRN: the context the model was first trained at (HF
            ``original_max_position_embeddings``; DeepSeek-V3: 4096). Required with ``yarn``.
        rope_beta_fast: YaRN: dims turning more than this many times over the original context are kept.
        rope_beta_slow: YaRN: dims turning fewer times than this are interpolated by ``rope_factor``.
        rope_mscale: YaRN: numerator multiplier of the cos/sin attention factor (with ``rope_mscale_all_dim``).
        rope_mscale_all_dim: YaRN: denominator multiplier of the cos/sin factor and, for MLA, the softmax
            scale factor ``(0.1 · rope_mscale_all_dim · ln(rope_factor) + 1)²``; 0 disables both.
        rope_attention_factor: YaRN: explicit cos/sin factor; ``None`` derives it from the fields above.
        rope_truncate: YaRN: round the ramp's ends to whole dims (HF ``truncate``, default true).
        norm_eps: RMSNorm epsilon.
        ffn_hidden: Hidden width of the dense SwiGLU FFN of the dense blocks.
        n_dense_layers: How many leading blocks use a dense FFN instead of MoE.
        dense_layers: Indices of the blocks with a dense FFN, in any pattern (Qwen3's ``mlp_only_layers`` /
            ``decoder_sparse_step``); when given it replaces ``n_dense_layers``, which must then be left at 0.
        num_experts: Routed experts per MoE layer.
        top_k: Routed experts chosen per token.
        expert_hidden: Hidden width of each routed (and shared) expert.
        n_shared_experts: Always-on experts added to every token's output (0 disables).
        score_func: Router score: ``softmax`` over experts or independent ``sigmoid`` per expert.
        route_norm: Renormalize the top-k weights to sum to one.
        route_scale: Multiplier applied to the (renormalized) top-k weights.
        n_expert_groups: Split experts into this many groups for group-limited routing (1 disables).
        n_limited_groups: Each token may only pick experts from this many groups.
        group_score: How groups are ranked: ``top2_sum`` of their best two scores (DeepSeek-V3) or ``max``,
            their best score (DeepSeek-V2's ``group_limited_greedy``).
        bias_update_rate: Step size of the aux-loss-free balancing bias (0 disables the update).
        aux_loss_coef: Coefficient of the sequence-level load-balancing loss (0 disables).
        z_loss_coef: Coefficient of the router z-loss (0 disables).
        tie_embeddings: Share the embedding matrix with the output head.
        attention: Attention type: ``gqa`` (grouped-query) or ``mla`` (multi-head latent attention,
            DeepSeek-V3 style; uses the five fields below and ignores ``n_kv_heads``/``head_dim``).
        q_lora_rank: MLA query latent width; 0 projects queries at full rank (DeepSeek-V2-Lite).
        kv_lora_rank: MLA compressed key/value latent width (what an inference KV cache stores).
        qk_nope_head_dim: MLA per-head query/key width without rotary embedding.
        qk_rope_head_dim: MLA per-head rotary width, decoupled: one rotary key shared by all heads.
        v_head_dim: MLA per-head value width.
        qk_norm: GQA query/key RMSNorm before rotary: ``none``, ``head`` (over each head's width, one weight
            of ``head_dim`` shared by the heads: Qwen3-MoE) or ``full`` (over the whole q and k projections: OLMoE).
        clip_qkv: GQA: clamp queries and keys (after ``qk_norm``) and values to ``[-clip_qkv, clip_qkv]``
            (OLMoE); ``None`` disables.
        mla_norm_eps: Epsilon of MLA's latent RMSNorms (query and key/value latents); ``None`` uses ``norm_eps``
            (Hugging Face DeepSeek checkpoints use 1e-6 there).
        init_std: Standard deviation of the normal weight initialisation.
        document_masking: Attend only within each document of a packed sequence (documents end at
            ``eod_token_id``, which belongs to the document it ends); off: plain causal attention.
        eod_token_id: End-of-document token id (the byte tokenizer's is 256).
        mtp_layers: Multi-token prediction depth D (DeepSeek-V3; ``model/mtp.py``): D extra modules, each one
            block shaped like the last, predicting the token ``k + 1`` ahead in training; 0 disables.
        mtp_loss_weight: λ of the training loss ``main + λ / D · Σ_k CE_k`` (DeepSeek-V3: 0.3, later 0.1).
    """

    vocab_size: int = 320
    dim: int = 256
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: Optional[int] = None
    max_seq_len: int = 256
    rope_theta: float = 10000.0
    rope_scaling: Literal["none", "yarn"] = "none"
    rope_factor: float = 1.0
    rope_original_max_seq_len: Optional[int] = None
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    rope_mscale: float = 1.0
    rope_mscale_all_dim: float = 0.0
    rope_attention_factor: Optional[float] = None
    rope_truncate: bool = True
    norm_eps: float = 1e-5
    ffn_hidden: int = 768
    n_dense_layers: int = 1
    dense_layers: Optional[list[int]] = None
    num_experts: int = 8
    top_k: int = 2
    expert_hidden: int = 256
    n_shared_experts: int = 1
    score_func: Literal["softmax", "sigmoid"] = "softmax"
    route_norm: bool = True
    route_scale: float = 1.0
    n_expert_groups: int = 1
    n_limited_groups: int = 1
    group_score: Literal["top2_sum", "max"] = "top2_sum"
    bias_update_rate: float = 1e-3
    aux_loss_coef: float = 0.0
    z_loss_coef: float = 0.0
    tie_embeddings: bool = False
    attention: Literal["gqa", "mla"] = "gqa"
    q_lora_rank: int = 0
    kv_lora_rank: int = 64
    qk_nope_head_dim: int = 32
    qk_rope_head_dim: int = 16
    v_head_dim: int = 32
    qk_norm: Literal["none", "head", "full"] = "none"
    clip_qkv: Optional[float] = None
    mla_norm_eps: Optional[float] = None
    init_std: float = 0.02
    document_masking: bool = False
    eod_token_id: int = 256
    mtp_layers: int = 0
    mtp_loss_weight: float = 0.3

    def __post_init__(self) -> None:
        positive = ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "max_seq_len",
                    "ffn_hidden", "num_experts", "top_k", "expert_hidden", "n_expert_groups",
                    "n_limited_groups")
        self._require_positive(positive)
        if self.attention not in ("gqa", "mla"):
            raise ConfigError(f"MoEConfig.attention={self.attention!r}: use 'gqa' or 'mla'.")
        if self.attention == "mla":
            self._validate_mla()
        else:
            self._validate_gqa()
        if not 0 <= self.n_dense_layers <= self.n_layers:
            raise ConfigError(
                f"MoEConfig.n_dense_layers={self.n_dense_layers} must be between 0 and "
                f"n_layers={self.n_layers}.")
        if self.dense_layers is not None:
            self._validate_dense_layers()
        if self.top_k > self.num_experts:
            raise ConfigError(
                f"MoEConfig.top_k={self.top_k} exceeds num_experts={self.num_experts}: "
                f"lower top_k or add experts.")
        if self.n_shared_experts < 0:
            raise ConfigError(f"MoEConfig.n_shared_experts={self.n_shared_experts} must be >= 0.")
        if self.num_experts % self.n_expert_groups:
            raise ConfigError(
                f"MoEConfig.n_expert_groups={self.n_expert_groups} must divide "
                f"num_experts={self.num_experts}.")
        if self.n_limited_groups > self.n_expert_groups:
            raise ConfigError(
                f"MoEConfig.n_limited_groups={self.n_limited_groups} exceeds "
                f"n_expert_groups={self.n_expert_groups}.")
        experts_reachable = self.n_limited_groups * (self.num_experts // self.n_expert_groups)
        if self.top_k > experts_reachable:
            raise ConfigError(
                f"MoEConfig.top_k={self.top_k} exceeds the {experts_reachable} experts reachable in "
                f"n_limited_groups={self.n_limited_groups} groups: raise n_limited_groups.")
        for name in ("document_masking", "rope_truncate"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"MoEConfig.{name}={getattr(self, name)!r}: must be true or false.")
        if self.group_score not in ("top2_sum", "max"):
            raise ConfigError(f"MoEConfig.group_score={self.group_score!r}: use 'top2_sum' or 'max'.")
        if self.score_func not in ("softmax", "sigmoid"):
            raise ConfigError(
                f"MoEConfig.score_func={self.score_func!r}: use 'softmax' or 'sigmoid'.")
        for name in ("bias_update_rate", "aux_loss_coef", "z_loss_coef"):
            if getattr(self, name) < 0:
                raise ConfigError(f"MoEConfig.{name}={getattr(self, name)} must be >= 0.")
        if self.document_masking and (not isinstance(self.eod_token_id, int)
                                      or not 0 <= self.eod_token_id < self.vocab_size):
            raise ConfigError(f"MoEConfig.eod_token_id={self.eod_token_id!r} must be a token id in "
                              f"[0, vocab_size={self.vocab_size}): use the tokenizer's end-of-document id.")
        self._validate_rope()
        self._validate_qk()
        if self.route_scale <= 0:
            raise ConfigError(f"MoEConfig.route_scale={self.route_scale} must be > 0.")
        self._validate_mtp()

    def _validate_mtp(self) -> None:
        if not isinstance(self.mtp_layers, int) or isinstance(self.mtp_layers, bool) or self.mtp_layers < 0:
            raise ConfigError(f"MoEConfig.mtp_layers={self.mtp_layers!r}: must be an integer >= 0 (multi-token "
                              "prediction depth; 0 disables it, DeepSeek-V3 uses 1).")
        weight = self.mtp_loss_weight
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 <= weight < float("inf"):
            raise ConfigError(f"MoEConfig.mtp_loss_weight={weight!r}: must be a finite number >= 0 (λ of the "
                              "multi-token prediction loss; DeepSeek-V3 uses 0.3).")

    def _validate_qk(self) -> None:
        if self.qk_norm not in ("none", "head", "full"):
            raise ConfigError(f"MoEConfig.qk_norm={self.qk_norm!r}: use 'none', 'head' (per head, Qwen3-MoE) or "
                              "'full' (whole projection, OLMoE).")
        if self.clip_qkv is not None and not self.clip_qkv > 0:
            raise ConfigError(f"MoEConfig.clip_qkv={self.clip_qkv}: must be > 0, or None to disable.")
        if self.attention == "mla":
            for name, off in (("qk_norm", "none"), ("clip_qkv", None)):
                if getattr(self, name) != off:
                    raise ConfigError(f"MoEConfig.{name}={getattr(self, name)!r} applies to attention='gqa' only: "
                                      f"set {name}: {off if off is not None else 'null'} for MLA.")
        if self.mla_norm_eps is not None and not self.mla_norm_eps > 0:
            raise ConfigError(f"MoEConfig.mla_norm_eps={self.mla_norm_eps}: must be > 0, or None for norm_eps.")

    def _validate_gqa(self) -> None:
        if self.head_dim is None:
            if self.dim % self.n_heads:
                raise ConfigError(
                    f"MoEConfig.dim={self.dim} is not divisible by n_heads={self.n_heads}: "
                    f"choose dim as a multiple of n_heads, or set head_dim explicitly.")
            self.head_dim = self.dim // self.n_heads
        if not isinstance(self.head_dim, int) or self.head_dim < 1:
            raise ConfigError(f"MoEConfig.head_dim={self.head_dim!r}: must be a positive even integer, or null for "
                              f"dim // n_heads.")
        if self.head_dim % 2:
            raise ConfigError(f"MoEConfig.head_dim={self.head_dim} must be even for rotary embeddings.")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(
                f"MoEConfig.n_kv_heads={self.n_kv_heads} must divide n_heads={self.n_heads}: "
                f"pick n_kv_heads from the divisors of n_heads.")

    def _validate_dense_layers(self) -> None:
        if self.n_dense_layers:
            raise ConfigError(f"MoEConfig.dense_layers={self.dense_layers} and n_dense_layers={self.n_dense_layers} "
                              f"both say which blocks are dense: set n_dense_layers=0 (or drop dense_layers).")
        if (not isinstance(self.dense_layers, (list, tuple)) or len(set(self.dense_layers)) != len(self.dense_layers)
                or not all(isinstance(i, int) and 0 <= i < self.n_layers for i in self.dense_layers)):
            raise ConfigError(f"MoEConfig.dense_layers={self.dense_layers!r}: must be distinct block indices in "
                              f"[0, n_layers={self.n_layers}).")
        self.dense_layers = sorted(self.dense_layers)

    def is_moe_layer(self, layer_id: int) -> bool:
        if self.dense_layers is not None:
            return layer_id not in self.dense_layers
        return layer_id >= self.n_dense_layers

    def _validate_rope(self) -> None:
        if self.rope_scaling not in ("none", "yarn"):
            raise ConfigError(f"MoEConfig.rope_scaling={self.rope_scaling!r}: use 'none' or 'yarn'.")
        if self.rope_scaling == "none":
            if self.rope_factor != 1.0:
                raise ConfigError(f"MoEConfig.rope_factor={self.rope_factor} has no effect with rope_scaling='none': "
                                  "set rope_scaling: yarn, or leave rope_factor at 1.0.")
            return
        if not self.rope_factor >= 1.0:
            raise ConfigError(f"MoEConfig.rope_factor={self.rope_factor} must be >= 1 for rope_scaling='yarn' "
                              "(it extends the context by that factor).")
        if not isinstance(self.rope_original_max_seq_len, int) or self.rope_original_max_seq_len < 1:
            raise ConfigError(f"MoEConfig.rope_original_max_seq_len={self.rope_original_max_seq_len!r}: "
                              "rope_scaling='yarn' needs the pre-extension context length (HF "
                              "original_max_position_embeddings), a positive integer.")
        if not 0 < self.rope_beta_slow <= self.rope_beta_fast:  # equal (a step, no ramp): Kimi K2 ships 1 and 1
            raise ConfigError(f"MoEConfig.rope_beta_fast={self.rope_beta_fast}, rope_beta_slow={self.rope_beta_slow}: "
                              "need 0 < rope_beta_slow <= rope_beta_fast (defaults 1 and 32).")
        for name in ("rope_mscale", "rope_mscale_all_dim"):
            if getattr(self, name) < 0:
                raise ConfigError(f"MoEConfig.{name}={getattr(self, name)} must be >= 0.")
        if self.rope_attention_factor is not None and not self.rope_attention_factor > 0:
            raise ConfigError(f"MoEConfig.rope_attention_factor={self.rope_attention_factor} must be > 0, "
                              "or None to derive it from rope_factor.")

    def _require_positive(self, names, context: str = "") -> None:
        for name in names:
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"MoEConfig.{name}={value!r}: must be a positive integer{context}.")

    def _validate_mla(self) -> None:
        self._require_positive(("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"),
                               " for attention='mla'")
        if not isinstance(self.q_lora_rank, int) or self.q_lora_rank < 0:
            raise ConfigError(f"MoEConfig.q_lora_rank={self.q_lora_rank!r}: must be >= 0 "
                              f"(0 projects queries at full rank).")
        if self.qk_rope_head_dim % 2:
            raise ConfigError(f"MoEConfig.qk_rope_head_dim={self.qk_rope_head_dim} must be even for rotary "
                              f"embeddings: use e.g. {self.qk_rope_head_dim + 1}.")
        ignored = [f"{name}={getattr(self, name)!r}" for name, unset in (
            ("n_kv_heads", (MoEConfig.n_kv_heads, self.n_heads)), ("head_dim", (None,))) if getattr(self, name) not in unset]
        if ignored:  # MLA's widths are its own five fields; a GQA value here is a mistaken config, not a choice
            warnings.warn(f"MoEConfig.{' and '.join(ignored)}: ignored with attention='mla', whose head widths are "
                          "qk_nope_head_dim, qk_rope_head_dim and v_head_dim; remove it from the config.", stacklevel=2)

    @property
    def n_moe_layers(self) -> int:
        return sum(map(self.is_moe_layer, range(self.n_layers)))

    @property
    def n_routed_passes(self) -> int:
        """MoE layers one training forward runs: the main stack's and each multi-token prediction block's (built like
        the last layer): what the expert exchange, its count exchanges and host reads are priced per."""
        return self.n_moe_layers + self.mtp_layers * self.is_moe_layer(self.n_layers - 1)

    @property
    def attention_head_dims(self) -> tuple[int, int]:
        """Per-head ``(query/key, value)`` widths: what attention scores and mixes over."""
        if self.attention == "mla":
            return self.qk_nope_head_dim + self.qk_rope_head_dim, self.v_head_dim
        return self.head_dim, self.head_dim
