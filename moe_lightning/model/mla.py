"""Multi-head latent attention (DeepSeek-V2/V3): keys and values pass through a small shared latent.

Shapes: H heads, N = ``qk_nope_head_dim``, R = ``qk_rope_head_dim``, V = ``v_head_dim``,
Q = ``q_lora_rank``, C = ``kv_lora_rank``. Rotary position lives only in the R decoupled dims, with
one rotary key per token shared by every head, so the compressed latent itself carries no position.
"""

import torch
from torch import nn

from moe_lightning.model.attention import DocumentMask, MaxLogitRecorder, SequenceShard, attend
from moe_lightning.model.config import MoEConfig
from moe_lightning.model.layers import RMSNorm
from moe_lightning.model.rotary import Rotary, apply_rotary, mla_softmax_scale


class MultiHeadLatentAttention(MaxLogitRecorder, nn.Module):
    """Causal MLA with low-rank query (optional, ``q_lora_rank > 0``) and key/value projections."""

    def __init__(self, config: MoEConfig):
        super().__init__()
        self.n_heads = config.n_heads
        self.nope_dim, self.rope_dim, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.q_lora_rank, self.kv_lora_rank = config.q_lora_rank, config.kv_lora_rank
        qk_dim = self.nope_dim + self.rope_dim
        latent_eps = config.norm_eps if config.mla_norm_eps is None else config.mla_norm_eps
        if self.q_lora_rank:
            self.wq_a = nn.Linear(config.dim, config.q_lora_rank, bias=False)
            self.q_norm = RMSNorm(config.q_lora_rank, latent_eps)
            self.wq_b = nn.Linear(config.q_lora_rank, self.n_heads * qk_dim, bias=False)
        else:
            self.wq = nn.Linear(config.dim, self.n_heads * qk_dim, bias=False)
        self.wkv_a = nn.Linear(config.dim, self.kv_lora_rank + self.rope_dim, bias=False)
        self.kv_norm = RMSNorm(self.kv_lora_rank, latent_eps)
        self.wkv_b = nn.Linear(self.kv_lora_rank, self.n_heads * (self.nope_dim + self.v_dim), bias=False)
        self.wo = nn.Linear(self.n_heads * self.v_dim, config.dim, bias=False)
        self.rotary = Rotary(config, self.rope_dim)
        self.scale = mla_softmax_scale(config)

    def forward(self, x_BSD: torch.Tensor, mask: DocumentMask | None = None, cache=None,
                cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None,
                sequence_shard: SequenceShard | None = None) -> torch.Tensor:
        """``cache`` (a ``kv_cache.LayerCache``) keeps the normalised latent and the rotated shared key.
        ``cos_sin``: this forward's rotary tables (``MoETransformer`` computes them once for all layers).
        ``sequence_shard``: ``x`` holds this rank's positions of the sequence; what is gathered from the other
        ranks is the latent and the rotated shared key (C + R values a token, not H x (N + R + V)), and every
        rank up-projects all keys and values for its own queries (``mask``, ``cos_sin``: those queries')."""
        B, S, _ = x_BSD.shape
        H = self.n_heads
        q_BSX = self.wq_b(self.q_norm(self.wq_a(x_BSD))) if self.q_lora_rank else self.wq(x_BSD)
        q_nope_BSHN, q_rope_BSHR = q_BSX.view(B, S, H, -1).split([self.nope_dim, self.rope_dim], dim=-1)
        kv_BSC, k_rope_BSR = self.wkv_a(x_BSD).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        cos, sin = cos_sin or self.rotary.cos_sin(0 if cache is None else cache.length, S, device=x_BSD.device)
        q_rope_BSHR = apply_rotary(q_rope_BSHR, cos, sin)
        k_rope_BSR = apply_rotary(k_rope_BSR.unsqueeze(2), cos, sin).squeeze(2)
        latent_BSC = self.kv_norm(kv_BSC)
        if cache is not None:
            latent_BTC, k_rope_BTR = cache.append(latent_BSC, k_rope_BSR)
            if latent_BTC.shape[1] > S:  # decoding after cached positions
                return self._attend_latent(q_nope_BSHN, q_rope_BSHR, latent_BTC, k_rope_BTR, mask)
        latent_BTC, k_rope_BTR = latent_BSC, k_rope_BSR
        if sequence_shard is not None:
            latent_BTC, k_rope_BTR = sequence_shard.gather(latent_BTC, k_rope_BTR)
        T = latent_BTC.shape[1]
        kv_BTHX = self.wkv_b(latent_BTC).view(B, T, H, -1)
        k_nope_BTHN, v_BTHV = kv_BTHX.split([self.nope_dim, self.v_dim], dim=-1)
        q_BSHK = torch.cat([q_nope_BSHN, q_rope_BSHR], dim=-1)
        k_BTHK = torch.cat([k_nope_BTHN, k_rope_BTR.unsqueeze(2).expand(-1, -1, H, -1)], dim=-1)
        q_BHSK, k_BHTK, v_BHTV = q_BSHK.transpose(1, 2), k_BTHK.transpose(1, 2), v_BTHV.transpose(1, 2)
        if self._recording(cache):
            out_BHSV, max_logits_H = attend(q_BHSK, k_BHTK, v_BHTV, mask, self.scale, return_max_logits=True)
            self._record(max_logits_H)
        else:
            out_BHSV = attend(q_BHSK, k_BHTK, v_BHTV, mask, self.scale)
        return self.wo(out_BHSV.transpose(1, 2).reshape(B, S, H * self.v_dim))

    def qk_clip_scales(self, gamma_H: torch.Tensor, alpha: float) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """QK-clip's weight operation as ``(parameter, factor per row)`` pairs, as Kimi K2 does it for MLA: every
        logit of head ``h`` is multiplied by ``gamma_H[h]``. The head's non-rotary query rows get
        ``gamma ** alpha`` and its non-rotary key rows (in ``wkv_b``) ``gamma ** (1 - alpha)`` (``sqrt(gamma)``
        each at ``alpha = 0.5``), its rotary query rows ``gamma``; the rotary key is shared by all heads and never
        scaled, nor are the values."""
        ones = gamma_H.new_ones(())
        q_HX = torch.cat([(gamma_H ** alpha)[:, None].expand(-1, self.nope_dim),
                          gamma_H[:, None].expand(-1, self.rope_dim)], dim=1)
        kv_HX = torch.cat([(gamma_H ** (1 - alpha))[:, None].expand(-1, self.nope_dim),
                           ones.expand(len(gamma_H), self.v_dim)], dim=1)
        wq = self.wq_b if self.q_lora_rank else self.wq
        return [(wq.weight, q_HX.flatten()), (self.wkv_b.weight, kv_HX.flatten())]

    def _attend_latent(self, q_nope_BSHN, q_rope_BSHR, latent_BTC, k_rope_BTR, mask) -> torch.Tensor:
        """Attention over cached latents without expanding them to per-head keys and values.

        ``wkv_b`` is absorbed: ``q_nope · (W_k c) = (W_kᵀ q_nope) · c`` and ``Σ p (W_v c) = W_v (Σ p c)``, so
        every head attends over the same ``[latent, rotary key]`` of width C + R (one shared key head, which
        ``attend`` never copies per head).
        """
        B, S, H, _ = q_nope_BSHN.shape
        w_HXC = self.wkv_b.weight.to(q_nope_BSHN.dtype).view(H, self.nope_dim + self.v_dim, self.kv_lora_rank)
        w_k_HNC, w_v_HVC = w_HXC.split([self.nope_dim, self.v_dim], dim=1)
        q_latent_BSHC = torch.einsum("bshn,hnc->bshc", q_nope_BSHN, w_k_HNC)
        q_BHSK = torch.cat([q_latent_BSHC, q_rope_BSHR.type_as(q_latent_BSHC)], dim=-1).transpose(1, 2)
        k_B1TK = torch.cat([latent_BTC, k_rope_BTR.type_as(latent_BTC)], dim=-1).unsqueeze(1)
        out_BHSC = attend(q_BHSK, k_B1TK, latent_BTC.unsqueeze(1), mask, self.scale)
        out_BSHV = torch.einsum("bhsc,hvc->bshv", out_BHSC, w_v_HVC)
        return self.wo(out_BSHV.reshape(B, S, H * self.v_dim))

    def init_weights(self, std: float, out_std: float) -> None:
        for module in self.children():
            if isinstance(module, RMSNorm):
                module.init_weights()
            elif module is not self.wo:
                nn.init.normal_(module.weight, std=std)
        nn.init.normal_(self.wo.weight, std=out_std)
