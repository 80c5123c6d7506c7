"""What autograd keeps between a block's (recomputed) forward and its backward, and what the multi-token prediction
modules keep: bytes per GPU as ``plan`` prices them (``tests/planner/test_block_memory.py`` and
``tests/planner/test_context_parallel.py`` check them against saved-tensor hooks)."""

from moe_lightning.model import MoEConfig


def pinned_bytes(nbytes: int) -> int:
    """Host memory one pinned allocation (an offloaded activation, a staged shard) of ``nbytes`` takes: the next power of two (``CachingHostAllocator``)."""
    return 0 if nbytes <= 0 else 1 << (int(nbytes) - 1).bit_length()


def mtp_activation_bytes(config: MoEConfig, tokens: int, checkpointed: bool = False) -> int:
    """What the multi-token prediction modules keep from forward to backward, bf16.

    Per token and depth: the reciprocal RMS of ``enorm`` and ``hnorm`` ``8``, the concatenation ``4d``, the block
    input ``2d``, the block's working set (``block_working_set_bytes``; none when ``checkpointed``: recomputed in
    backward, a transient like the main blocks'), the final norm ``2d + 4`` and its output, kept by the loss,
    ``2d``; once: the embedding output ``2d`` the modules read (the main hidden state is kept by the main loss
    anyway). ``tests/model/test_mtp.py`` checks it with saved-tensor hooks.
    """
    if not config.mtp_layers:
        return 0
    d = config.dim
    block = 0 if checkpointed else block_working_set_bytes(config, 1, moe=config.is_moe_layer(config.n_layers - 1))
    return (config.mtp_layers * (10 * d + 12 + block) + 2 * d) * tokens


def block_working_set_bytes(config: MoEConfig, tokens: int, moe: bool, part: str = "block",
                            key_tokens: int | None = None) -> int:
    """Bytes one block's recomputed forward saves for its backward, for ``tokens = b·s`` tokens.

    ``key_tokens``: the key positions attention sees (context parallelism: the whole sequence, ``b·S``, while
    ``tokens`` are this rank's ``b·S / cp``); ``None``: ``tokens``. The key-side terms (``key_side_bytes``)
    scale with it, the rest with ``tokens``.

    ``part``: ``attention`` (norm + attention), ``ffn`` (norm + MoE or dense FFN) or the whole ``block``.
    Follows what autograd saves in this package's block with bf16 parameters (``tests/planner/test_block_memory.py``
    checks it with saved-tensor hooks) and a fused attention kernel keeping q, k, v, the output and an fp32
    log-sum-exp (the CPU math kernel would keep ``S × S`` probabilities). Per token, in bytes:
    - every RMSNorm keeps its bf16 input and fp32 reciprocal RMS ``2w + 4`` (the attention norm's input is
      the block input, counted as a boundary activation: ``4``); a linear keeps its bf16 input;
    - GQA: normed input ``2d``, rotary tables ``4·hd``, rotated q ``2H·hd``, k and v ``4G·hd``, output
      ``2H·hd``, LSE ``4H``;
    - MLA: normed input ``2d``, rotary tables ``4R``, the key/value down-projection ``2(C + R)`` and its norm
      ``2C + 4``, the query latent and its norm ``4Q + 4`` (none when Q = 0), q and assembled k ``4H(N+R)``,
      key/value up-projection ``2H(N+V)``, output ``2H·V``, LSE ``4H``;
    - MoE: norm ``2d + 4`` and its output ``2d``, fp32 router scores ``4E``, choices ``8K``, renormalised
      weights ``4K + 4`` (with ``route_norm``), sort indices ``16K``, K token copies into the experts ``2K·d``,
      their gate and up ``4K·F`` (the product is recomputed), routing weights ``2K``, shared experts' gate and
      up ``4·F_shared``, balance-loss normaliser ``4`` (with ``aux_loss_coef``), router logits and their
      log-sum-exp ``4E + 4`` (with ``z_loss_coef``);
    - dense FFN: norm ``2d + 4``, its output ``2d``, gate and up ``4·ffn_hidden``.
    Rotary tables are per position (shared by the micro-batch) and counted per token, an upper bound for
    b > 1; per-layer constants (int32 expert offsets, per-sequence balance statistics) are left out.
    """
    c, d, H = config, config.dim, config.n_heads
    gathered = key_tokens is not None and key_tokens != tokens
    if c.attention == "mla":
        N, R, V, C, Q = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.kv_lora_rank, c.q_lora_rank
        attention = (4 + 2 * d + 4 * R + 2 * (C + R) + 4 + (4 * Q + 4 if Q else 0) + 2 * H * (N + R)
                     + 2 * H * V + 4 * H)
    else:
        hd = c.head_dim
        attention = 4 + 2 * d + 4 * hd + 2 * H * hd + 2 * H * hd + 4 * H
    ffn = 4 * d + 4
    if moe:
        K, F, E = c.top_k, c.expert_hidden, c.num_experts
        ffn += (4 * E + 8 * K + (4 * K + 4 if c.route_norm else 0) + 16 * K + 2 * K * d + 4 * K * F + 2 * K
                + 4 * F * c.n_shared_experts + (4 if c.aux_loss_coef > 0 else 0) + (4 * E + 4 if c.z_loss_coef > 0 else 0))
    else:
        ffn += 4 * c.ffn_hidden
    key_side = key_side_bytes(config, gathered) * (tokens if key_tokens is None else key_tokens)
    per_token = {"attention": attention, "ffn": ffn, "block": attention + ffn}[part]
    return per_token * tokens + (0 if part == "ffn" else key_side)


def key_side_bytes(config: MoEConfig, gathered: bool = False) -> int:
    """Bytes attention keeps per key position (the part of ``block_working_set_bytes`` that covers every key).

    GQA: the grouped K and V ``4G·hd`` (gathered or not: one buffer). MLA: the assembled per-head keys
    ``2H(N+R)`` and the up-projected keys and values ``2H(N+V)`` (kept by the kernel and by ``wkv_b``'s
    backward), and the latent ``wkv_b`` reads: ``2C`` on one rank; under context parallelism the gathered latent
    and rotary key come in one buffer, ``2(C + R)``. Each rank up-projects every key for its own queries, so at
    the 1T shape this is 115,840 B per position of the whole sequence (115,712 on one rank);
    ``tests/planner/test_context_parallel.py`` counts it with saved-tensor hooks."""
    c, H = config, config.n_heads
    if c.attention != "mla":
        return 4 * c.n_kv_heads * c.head_dim
    N, R, V, C = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.kv_lora_rank
    return 2 * H * (N + R) + 2 * H * (N + V) + 2 * (C + R if gathered else C)
