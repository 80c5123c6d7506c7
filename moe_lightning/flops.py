"""Analytic training FLOPs for MoE models (``measure_flops`` counts 0 for ``_grouped_mm``)."""

import torch

from .model import MoEConfig, MoETransformer

# Dense bf16 tensor-core peak per GPU (datasheet, no sparsity). Matched against the CUDA device name,
# longest key first, so "GH200" is not read as "H200" nor "H100 PCIe" as "H100".
PEAK_BF16_FLOPS = {"GH200": 989e12, "H200": 989e12, "H100 PCIe": 756e12, "H100": 989e12, "B200": 2250e12}


def peak_bf16_flops(device_name: str) -> float | None:
    """Peak dense bf16 FLOP/s for a device name such as ``torch.cuda.get_device_name()``; None if unknown."""
    name = device_name.upper()
    for key in sorted(PEAK_BF16_FLOPS, key=len, reverse=True):
        if key.upper() in name:
            return PEAK_BF16_FLOPS[key]
    return None


def parameter_counts(config: MoEConfig) -> dict[str, int]:
    """Total, active (one token's share) and embedding parameters, counted on the meta device."""
    with torch.device("meta"):
        model = MoETransformer(config)
    embedding = model.tok_embeddings.weight.numel()
    return {"total": model.num_parameters(), "active": model.num_parameters(active=True), "embedding": embedding}


def attention_flops_per_token(config: MoEConfig, seq_len: int, causal: bool = True) -> float:
    """Score and value matmuls, forward + backward: ``6 · layers · heads · (qk_dim + v_dim) · seq_len``.

    Halved if causal. With GQA ``qk_dim = v_dim = head_dim`` (the familiar ``12 · L · H · head_dim · S``);
    MLA scores over ``qk_nope_head_dim + qk_rope_head_dim`` and mixes ``v_head_dim``.
    """
    qk_dim, v_dim = config.attention_head_dims
    layers = config.n_layers + config.mtp_layers  # each multi-token prediction module has one attention layer
    flops = 6 * layers * config.n_heads * (qk_dim + v_dim) * seq_len
    return flops / 2 if causal else flops


def training_flops_per_token(config: MoEConfig, seq_len: int, causal: bool = True,
                             counts: dict[str, int] | None = None) -> float:
    """``6 × active matmul parameters`` (the embedding lookup is not a matmul) plus attention. Multi-token
    prediction modules count once each (their parameters are in ``active``) and apply the shared head again.

    ``counts``: ``parameter_counts(config)`` when the caller has it already (it builds a meta model)."""
    counts = counts or parameter_counts(config)
    matmul_params = counts["active"] - (0 if config.tie_embeddings else counts["embedding"])
    shared_head = config.mtp_layers * config.vocab_size * config.dim
    return 6 * (matmul_params + shared_head) + attention_flops_per_token(config, seq_len, causal)
