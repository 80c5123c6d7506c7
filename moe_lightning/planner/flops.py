"""Analytic training FLOPs for MoE models (``measure_flops`` counts 0 for ``_grouped_mm``)."""

import torch

from moe_lightning.model import MoEConfig, MoETransformer

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


def attended_pairs(seq_len: int, doc_len: int | None = None, causal: bool = True) -> int:
    """(query, key) pairs attention scores in one sequence: the ``True`` entries of its mask. Causal within
    documents of ``doc_len`` tokens (the last one shorter; ``None``: one document), ``Σ l(l+1)/2``; ``S²``
    without the causal mask (and no documents)."""
    if not causal:
        return seq_len * seq_len
    full, rest = divmod(seq_len, doc_len or seq_len)
    length = doc_len or seq_len
    return full * length * (length + 1) // 2 + rest * (rest + 1) // 2


def attended_pairs_BS(tokens_BS: torch.Tensor, eod_token_id: int | None) -> torch.Tensor:
    """Keys each query scores (int64 ``[B, S]``): its position in its document plus one, so the sum is
    ``Σ l(l+1)/2`` over the documents (``attended_pairs``). Computed where the tokens are, no host read:
    a token starts a document at position 0 or after an end-of-document token (``model/attention.py``)."""
    B, S = tokens_BS.shape
    pos_BS = torch.arange(S, device=tokens_BS.device).expand(B, S)
    if eod_token_id is None:
        return pos_BS + 1
    starts_BS = torch.zeros_like(pos_BS)
    starts_BS[:, 1:] = torch.where(tokens_BS[:, :-1] == eod_token_id, pos_BS[:, 1:], 0)
    return pos_BS - starts_BS.cummax(dim=1).values + 1


def attention_flops_per_pair(config: MoEConfig) -> int:
    """Score and value matmuls of one (query, key) pair in every attention layer, forward + backward:
    ``6 · layers · heads · (qk_dim + v_dim)``. With GQA ``qk_dim = v_dim = head_dim``; MLA scores over
    ``qk_nope_head_dim + qk_rope_head_dim`` and mixes ``v_head_dim``. Each multi-token prediction module has one
    attention layer, counted over the main sequence's pairs (its ``S - k`` positions score slightly fewer)."""
    qk_dim, v_dim = config.attention_head_dims
    return 6 * (config.n_layers + config.mtp_layers) * config.n_heads * (qk_dim + v_dim)


def attention_flops_per_token(config: MoEConfig, seq_len: int, causal: bool = True,
                              doc_len: int | None = None) -> float:
    """Attention FLOPs per token of a ``seq_len`` sequence of ``doc_len``-token documents (``attended_pairs``).

    Document masking (FlexAttention's block mask) computes only within documents: at 65,536 tokens of
    ~4k-token documents that is a sixteenth of the causal count over the whole sequence."""
    return attention_flops_per_pair(config) * attended_pairs(seq_len, doc_len, causal) / seq_len


def dense_flops_per_token(config: MoEConfig, counts: dict[str, int] | None = None) -> int:
    """``6 × active matmul parameters`` (the embedding lookup is not a matmul). Multi-token prediction modules
    count once each (their parameters are in ``active``) and apply the shared head again.

    ``counts``: ``parameter_counts(config)`` when the caller has it already (it builds a meta model)."""
    counts = counts or parameter_counts(config)
    matmul_params = counts["active"] - (0 if config.tie_embeddings else counts["embedding"])
    shared_head = config.mtp_layers * config.vocab_size * config.dim
    return 6 * (matmul_params + shared_head)


def cp_key_upprojection_flops_per_token(config: MoEConfig, cp: int) -> int:
    """FLOPs per local token that context parallelism adds (forward + backward): with MLA every rank up-projects
    every gathered latent through ``wkv_b`` for its own queries, the ``N - 1`` other ranks' keys too, so each local
    token pays ``N - 1`` extra up-projections of ``6 · kv_lora_rank · H · (qk_nope + v)`` in every attention layer.
    GQA exchanges K and V already projected: none."""
    if cp == 1 or config.attention != "mla":
        return 0
    wkv_b = config.kv_lora_rank * config.n_heads * (config.qk_nope_head_dim + config.v_head_dim)
    return 6 * (cp - 1) * (config.n_layers + config.mtp_layers) * wkv_b


def training_flops_per_token(config: MoEConfig, seq_len: int, causal: bool = True,
                             counts: dict[str, int] | None = None, doc_len: int | None = None) -> float:
    """Matmuls (``dense_flops_per_token``) plus attention over the pairs actually scored
    (``attention_flops_per_token``; ``doc_len``: the typical document length under document masking)."""
    return dense_flops_per_token(config, counts) + attention_flops_per_token(config, seq_len, causal, doc_len)
