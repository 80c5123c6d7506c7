"""Analytic training FLOPs for MoE models (``measure_flops`` counts 0 for ``_grouped_mm``)."""

import torch

from .model import MoEConfig, MoETransformer


def parameter_counts(config: MoEConfig) -> dict[str, int]:
    """Total, active (one token's share) and embedding parameters, counted on the meta device."""
    with torch.device("meta"):
        model = MoETransformer(config)
    embedding = model.tok_embeddings.weight.numel()
    return {"total": model.num_parameters(), "active": model.num_parameters(active=True), "embedding": embedding}


def attention_flops_per_token(config: MoEConfig, seq_len: int, causal: bool = True) -> float:
    """Score and value matmuls, forward + backward: ``12 · layers · heads · head_dim · seq_len`` (halved if causal)."""
    flops = 12 * config.n_layers * config.n_heads * config.head_dim * seq_len
    return flops / 2 if causal else flops


def training_flops_per_token(config: MoEConfig, seq_len: int, causal: bool = True) -> float:
    """``6 × active matmul parameters`` (the embedding lookup is not a matmul) plus attention."""
    counts = parameter_counts(config)
    matmul_params = counts["active"] - (0 if config.tie_embeddings else counts["embedding"])
    return 6 * matmul_params + attention_flops_per_token(config, seq_len, causal)
