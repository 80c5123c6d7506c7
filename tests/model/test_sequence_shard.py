"""The context-parallel seam on the model side: the one-rank default changes nothing (same ops, same bits), and
masks and rotary tables at a shard's global positions equal the rows of the whole sequence's."""

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_mask
from torch.utils._python_dispatch import TorchDispatchMode

from moe_lightning.model import MoEConfig, MoETransformer
from moe_lightning.model.attention import DocumentMask, SequenceShard, attend, dense_mask, document_ids
from moe_lightning.model.rotary import Rotary
from moe_lightning.parallel.context_parallel import head_tail_positions

EOD = 3


def _config(attention: str, masking: bool, **extra) -> MoEConfig:
    return MoEConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64, ffn_hidden=64,
                     n_dense_layers=1, num_experts=4, top_k=2, expert_hidden=16, attention=attention, q_lora_rank=0,
                     kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, init_std=0.3,
                     document_masking=masking, eod_token_id=EOD, **extra)


class _OpLog(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def _run(model: MoETransformer, tokens_BS: torch.Tensor, seamless: bool):
    """Forward + backward; ``seamless``: the blocks called as before the seam existed (no sequence_shard)."""
    model.zero_grad()
    log = _OpLog()
    with log:
        if seamless:
            h_BSD = model.tok_embeddings(tokens_BS)
            mask = DocumentMask(document_ids(tokens_BS, EOD), q_len=tokens_BS.shape[1]) \
                if model.config.document_masking else None
            cos_sin = model.rotary.cos_sin(0, tokens_BS.shape[1])
            for layer in model.layers:
                h_BSD = layer(h_BSD, mask=mask, cache=None, cos_sin=cos_sin)
            logits_BSV = model.output(model.norm(h_BSD))
        else:
            logits_BSV = model(tokens_BS)
        weights = torch.linspace(-1, 1, logits_BSV.numel()).view_as(logits_BSV)
        (logits_BSV * weights).sum().backward()
    return logits_BSV.detach(), [p.grad.clone() for p in model.parameters()], log.ops


def test_the_one_rank_seam_returns_its_inputs():
    shard, x, y = SequenceShard(), torch.randn(2, 8, 3), torch.randn(2, 8, 4)
    assert shard.size == 1 and shard.positions(8, x.device) is None
    assert shard.local(x) is x
    gathered = shard.gather(x, y)
    assert gathered[0] is x and gathered[1] is y


@pytest.mark.parametrize("attention", ["mla", "gqa"])
@pytest.mark.parametrize("masking", [False, True])
def test_one_rank_forward_and_backward_are_bit_identical_to_the_blocks_without_the_seam(attention, masking):
    torch.manual_seed(0)
    model = MoETransformer(_config(attention, masking))
    tokens_BS = torch.randint(4, 64, (2, 48))
    tokens_BS[0, [7, 30]] = EOD
    logits, grads, ops = _run(model, tokens_BS, seamless=False)
    ref_logits, ref_grads, ref_ops = _run(model, tokens_BS, seamless=True)
    assert torch.equal(logits, ref_logits)
    assert all(torch.equal(g, r) for g, r in zip(grads, ref_grads))
    assert ops == ref_ops  # no extra copy, index or collective


def test_shard_masks_are_the_whole_sequences_rows_and_the_flex_predicate_agrees():
    """The CUDA path's mask_mod (query row -> global position, Q_LEN != KV_LEN), evaluated on CPU."""
    tokens_BS = torch.randint(4, 20, (2, 32), generator=torch.Generator().manual_seed(1))
    tokens_BS[0, [5, 6, 20]] = EOD
    tokens_BS[1, 17] = EOD
    doc_BT = document_ids(tokens_BS, EOD)
    whole_B1ST = dense_mask(doc_BT, 32)
    for rank in range(4):
        pos_S = head_tail_positions(32, 4, rank)
        shard = DocumentMask(doc_BT, q_positions_S=pos_S)
        assert torch.equal(shard.dense_B1ST, whole_B1ST[:, :, pos_S])
        flex = DocumentMask(doc_BT, q_positions_S=pos_S, flex=True)
        assert flex.dense_B1ST is None
        assert torch.equal(create_mask(flex.block_mask.mask_mod, 2, 1, len(pos_S), 32, device="cpu"), shard.dense_B1ST)


def test_flex_attention_of_a_shards_queries_equals_sdpa_with_the_dense_mask():
    g = torch.Generator().manual_seed(2)
    B, H, G, T, K = 2, 4, 2, 32, 16
    doc_BT = document_ids(torch.randint(3, 8, (B, T), generator=g), EOD)
    pos_S = head_tail_positions(T, 2, 1)
    q = torch.randn(B, H, len(pos_S), K, generator=g, dtype=torch.float64)
    k, v = (torch.randn(B, G, T, K, generator=g, dtype=torch.float64) for _ in range(2))
    flex_out = attend(q, k, v, DocumentMask(doc_BT, q_positions_S=pos_S, flex=True), scale=0.3)
    dense_out = attend(q, k, v, DocumentMask(doc_BT, q_positions_S=pos_S), scale=0.3)
    kk, vv = k.repeat_interleave(H // G, 1), v.repeat_interleave(H // G, 1)
    expected = F.scaled_dot_product_attention(q, kk, vv, attn_mask=dense_mask(doc_BT, T)[:, :, pos_S], scale=0.3)
    torch.testing.assert_close(flex_out, expected, rtol=1e-10, atol=1e-12)  # float64: rounding only
    torch.testing.assert_close(dense_out, expected, rtol=1e-10, atol=1e-12)


def test_rotary_tables_at_positions_are_the_whole_sequences_rows():
    rotary = Rotary(_config("mla", False), 8)
    cos, sin = rotary.cos_sin(0, 64)
    pos_S = head_tail_positions(64, 4, 2)
    cos_at, sin_at = rotary.cos_sin_at(pos_S)
    assert torch.equal(cos_at, cos[pos_S]) and torch.equal(sin_at, sin[pos_S])


class _HalfShard(SequenceShard):
    size = 2

    def positions(self, seq_len, device):
        return head_tail_positions(seq_len, 2, 0, device)


def test_a_sharded_model_refuses_generation_and_multi_token_prediction():
    model = MoETransformer(_config("gqa", False, mtp_layers=1))
    model.sequence_shard = _HalfShard()
    tokens_BS = torch.randint(4, 64, (1, 16))
    with pytest.raises(ValueError, match="context_parallel_size=1"):
        model(tokens_BS, mtp=True)
    with pytest.raises(ValueError, match="generate on one rank"):
        model.generate(tokens_BS, 2)
