"""Multi-token prediction (DeepSeek-V3): D sequential modules, module k predicting the token k + 1 ahead.

Module k combines, at position i, the hidden state of depth k-1 (depth 0: the main model's final-normed
hidden state) with the embedding of token ``t[i+k]``::

    h'_i = eh_proj(cat[enorm(emb(t[i+k])), hnorm(h_i^{k-1})])       (2·dim -> dim; the released order)
    h_i^k = norm(block(h'))                                            (checkpoints: ``shared_head.norm``)

and the shared output head turns ``h^k`` into logits for ``t[i+k+1]``. Depth k covers positions
``0 .. S-k-1`` of the ``S`` inputs, so every target lies inside the batch; with document masking a target
whose window ``t[i] .. t[i+k]`` crosses an end-of-document token is ignored (``targets``).
The module is used in training only: generation, validation and test run the main model alone.
"""

import torch
from torch import nn

from moe_lightning.model.attention import document_ids
from moe_lightning.model.config import MoEConfig
from moe_lightning.model.layers import RMSNorm


class MTPModule(nn.Module):
    """One depth: the two norms, the ``2·dim -> dim`` projection, one transformer ``block`` and the norm before the
    shared head. The block (dense or MoE, shaped like the model's last) is built by the caller, which owns the
    block class."""

    def __init__(self, config: MoEConfig, block: nn.Module):
        super().__init__()
        self.enorm = RMSNorm(config.dim, config.norm_eps)
        self.hnorm = RMSNorm(config.dim, config.norm_eps)
        self.eh_proj = nn.Linear(2 * config.dim, config.dim, bias=False)
        self.block = block
        self.norm = RMSNorm(config.dim, config.norm_eps)

    def forward(self, hidden_BSD: torch.Tensor, emb_BSD: torch.Tensor, **attention_kwargs) -> torch.Tensor:
        """``hidden`` of depth k-1 at positions ``i`` and the embeddings of ``t[i+k]``, both ``[B, S-k, D]``."""
        x_BSD = self.eh_proj(torch.cat([self.enorm(emb_BSD), self.hnorm(hidden_BSD)], dim=-1))
        return self.norm(self.block(x_BSD, **attention_kwargs))

    @torch.no_grad()
    def init_weights(self, std: float, out_std: float) -> None:
        for norm in (self.enorm, self.hnorm, self.norm, self.block.attention_norm, self.block.ffn_norm):
            norm.init_weights()
        nn.init.normal_(self.eh_proj.weight, std=std)
        self.block.attention.init_weights(std, out_std)
        self.block.ffn.init_weights(std, out_std)


def targets(tokens_BS1: torch.Tensor, depth: int, eod_token_id: int | None,
            ignore_index: int = -100) -> torch.Tensor:
    """Targets ``[B, S-k]`` of depth ``k`` for a batch of ``S + 1`` tokens: ``t[i+k+1]`` at position ``i``.

    With ``eod_token_id`` (document masking), a target is ``ignore_index`` when an end-of-document token lies
    in ``t[i] .. t[i+k-1]``: the hidden state at ``i`` and the token ``t[i+k]`` then belong to different
    documents. (As in the main loss, the token after an end-of-document token at ``t[i+k]`` is predicted.)
    """
    S = tokens_BS1.shape[1] - 1
    targets_BS = tokens_BS1[:, depth + 1:]
    if eod_token_id is None:
        return targets_BS
    doc_BS = document_ids(tokens_BS1[:, :-1], eod_token_id)
    crosses_BS = doc_BS[:, depth:] != doc_BS[:, :S - depth]
    return targets_BS.masked_fill(crosses_BS, ignore_index)
