"""KV cache: cached logits and greedy tokens equal uncached ones (GQA, MLA, document masking), the window policy,
what each attention kind stores, sampling filters, stop tokens and streaming."""

import math
import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._python_dispatch import TorchDispatchMode

from moe_lightning.model import MoEConfig, MoETransformer, transformer
from moe_lightning.model.attention import DocumentMask, GroupedQueryAttention, attend, dense_mask, document_ids
from moe_lightning.model.kv_cache import KVCache, LayerCache
from moe_lightning.model.mla import MultiHeadLatentAttention
from moe_lightning.model.transformer import sample_next

EOD = 63
# init_std 0.3: O(1) attention scores and routing, so a wrong cached key or position changes the argmax
BASE = dict(vocab_size=64, dim=32, n_layers=3, n_heads=4, n_kv_heads=2, max_seq_len=64, ffn_hidden=64,
            n_dense_layers=1, num_experts=4, top_k=2, expert_hidden=16, eod_token_id=EOD, init_std=0.3)
MLA = dict(attention="mla", n_heads=3, q_lora_rank=12, kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4,
           v_head_dim=6)
KINDS = {
    "gqa": {},
    "gqa-qknorm-yarn": dict(qk_norm="head", rope_scaling="yarn", rope_factor=4.0, rope_original_max_seq_len=16),
    "mla": MLA,
    "mla-full-rank-q-yarn": dict(MLA, q_lora_rank=0, rope_scaling="yarn", rope_factor=40.0,
                                 rope_original_max_seq_len=16, rope_mscale_all_dim=1.0),
}


def model_for(kind: str, **overrides) -> MoETransformer:
    torch.manual_seed(0)
    return MoETransformer(MoEConfig(**{**BASE, **KINDS[kind], **overrides})).eval()


@pytest.mark.parametrize("masking", [False, True])
@pytest.mark.parametrize("kind", list(KINDS))
def test_cached_logits_equal_the_full_forward(kind, masking):
    model = model_for(kind, document_masking=masking)
    tokens = torch.randint(0, EOD, (2, 24), generator=torch.Generator().manual_seed(1))
    tokens[0, [3, 11]] = EOD  # documents end in the prompt and among the fed tokens
    tokens[1, 15] = EOD
    cache = KVCache(3, 64)
    with torch.no_grad():
        full = model(tokens)
        steps = [model(tokens[:, :6], cache=cache), model(tokens[:, 6:10], cache=cache)]  # several after cached
        steps += [model(tokens[:, i:i + 1], cache=cache) for i in range(10, 24)]
    assert cache.length == 24
    # fp32: absorbed MLA weights and cached rotations change only the summation order
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", list(KINDS))
def test_cached_greedy_equals_uncached_greedy(kind):
    model = model_for(kind)
    prompt = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(2))
    cached = model.generate(prompt, 50, temperature=0)
    uncached = model.generate(prompt, 50, temperature=0, use_cache=False)
    assert cached.shape == (2, 56) and torch.equal(cached, uncached)
    assert len(set(cached[0, 6:].tolist())) > 5  # a varied continuation, not one token repeated


def reference_windows(model, prompt, n, cached: bool):
    """The documented context rule with full recomputation: uncached slides by one; cached restarts from the
    newest max_seq_len // 2 tokens when the window would exceed max_seq_len."""
    L = model.config.max_seq_len
    tokens, window = prompt, prompt[:, -L:]
    for _ in range(n):
        if window.shape[1] > L:
            window = window[:, -(L // 2):] if cached else window[:, -L:]
        with torch.no_grad():
            nxt = model(window)[:, -1].argmax(-1, keepdim=True)
        tokens, window = torch.cat([tokens, nxt], 1), torch.cat([window, nxt], 1)
    return tokens


@pytest.mark.parametrize("kind", ["gqa", "mla"])
def test_generation_past_max_seq_len_follows_the_window_rule(kind):
    model = model_for(kind, max_seq_len=16)
    prompt = torch.randint(0, 64, (2, 20), generator=torch.Generator().manual_seed(3))  # longer than the window
    for cached in (True, False):
        out = model.generate(prompt, 30, temperature=0, use_cache=cached)
        assert torch.equal(out, reference_windows(model, prompt, 30, cached))


def test_cache_holds_what_each_attention_kind_needs():
    for kind, per_token in (("gqa", [(2, 8), (2, 8)]), ("mla", [(12,), (4,)])):
        model, cache = model_for(kind), KVCache(3, 64)
        with torch.no_grad():
            model(torch.randint(0, 64, (2, 5)), cache=cache)
        # GQA: rotated keys and values of 2 kv heads x 8; MLA: latent 12 + shared rotary key 4 per token
        assert [tuple(b.shape) for b in cache.layers[0].buffers] == [(2, 64, *s) for s in per_token]
    with pytest.raises(ValueError, match="KV cache holds 64 positions; 5 are cached and 60"):
        model(torch.randint(0, 64, (2, 60)), cache=cache)


def test_top_p_keeps_the_smallest_set_reaching_p_and_top_k_first():
    logits = torch.log(torch.tensor([[0.05, 0.4, 0.1, 0.3, 0.15]]))
    g = torch.Generator().manual_seed(0)
    seen = {int(sample_next(logits, 1.0, top_p=0.6, generator=g)) for _ in range(300)}
    assert seen == {1, 3}  # 0.4 + 0.3 >= 0.6: the nucleus is tokens 1 and 3
    seen = {int(sample_next(logits, 1.0, top_p=0.8, generator=g)) for _ in range(300)}
    assert seen == {1, 3, 4}
    assert {int(sample_next(logits, 1.0, top_k=1, top_p=0.99, generator=g)) for _ in range(50)} == {1}
    assert {int(sample_next(logits, 1.0, top_p=1e-6, generator=g)) for _ in range(50)} == {1}


def test_stop_token_ends_rows_and_stream_yields_what_generate_returns():
    model = model_for("mla")
    prompt = torch.randint(0, 64, (2, 4), generator=torch.Generator().manual_seed(4))
    free = model.generate(prompt, 30, temperature=0)
    stop = int(free[0, 4 + 5])  # row 0 produces this token by its 6th step at the latest
    out = model.generate(prompt, 30, temperature=0, stop_token=stop)
    firsts = [int((free[row, 4:] == stop).nonzero()[0]) if (free[row, 4:] == stop).any() else None for row in (0, 1)]
    assert firsts[0] <= 5
    assert out.shape[1] == 4 + (30 if firsts[1] is None else max(firsts) + 1)  # ends when every row has stopped
    for row, first in enumerate(firsts):
        upto = out.shape[1] if first is None else 4 + first + 1
        assert torch.equal(out[row, :upto], free[row, :upto])  # identical up to and including its stop token
        assert (out[row, upto:] == stop).all()  # then padded with it
    streamed = list(model.generate_stream(prompt, 30, temperature=0, stop_token=stop))
    assert torch.equal(torch.stack(streamed, 1), out[:, 4:])
    g1, g2 = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    sampled = model.generate(prompt, 12, 0.8, 5, g1, top_p=0.9)
    assert torch.equal(sampled, model.generate(prompt, 12, 0.8, 5, g2, top_p=0.9, use_cache=False))


@pytest.mark.parametrize("kwargs, match", [(dict(top_p=0.0), "top_p=0.0"), (dict(top_k=0), "top_k=0"),
                                           (dict(max_new_tokens=-1), "max_new_tokens=-1")])
def test_bad_sampling_arguments_name_the_argument(kwargs, match):
    with pytest.raises(ValueError, match=match):
        model_for("gqa").generate(torch.zeros(1, 3, dtype=torch.long), **{"max_new_tokens": 3, **kwargs})


class LargestOutput(TorchDispatchMode):
    """Records the largest tensor any aten op creates while active (views included)."""

    def __init__(self):
        super().__init__()
        self.numel, self.op = 0, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.numel() > self.numel:
                self.numel, self.op = t.numel(), f"{func} {tuple(t.shape)}"
        return out


@pytest.mark.parametrize("kind", ["gqa", "mla"])
@pytest.mark.parametrize("new", [1, 3])
def test_decode_never_copies_the_cached_keys_per_query_head(kind, new):
    """SDPA's enable_gqa in the math kernel (CPU's choice for MLA's unequal key/value widths; a fallback of masked
    calls on GPUs) copies every cached key once per query head: H·T·(key width) numbers per layer and step."""
    torch.manual_seed(0)
    config = MoEConfig(**{**BASE, **KINDS[kind], "n_heads": 8, "document_masking": True})
    attn = MultiHeadLatentAttention(config) if kind == "mla" else GroupedQueryAttention(config)
    B, T = 2, 40
    per_head_key = config.kv_lora_rank + config.qk_rope_head_dim if kind == "mla" else config.head_dim
    x_BTD = torch.randn(B, T, config.dim)
    tokens = torch.randint(0, EOD, (B, T), generator=torch.Generator().manual_seed(5))
    tokens[0, [9, T - 2]] = EOD  # the decoded queries see only their own document
    doc_BT = document_ids(tokens, EOD)
    with torch.no_grad():
        full = attn(x_BTD, mask=DocumentMask(doc_BT))
        cache = LayerCache(T)
        attn(x_BTD[:, :T - new], mask=DocumentMask(doc_BT[:, :T - new]), cache=cache)
        largest = LargestOutput()
        with sdpa_kernel([SDPBackend.MATH]), largest:  # the kernel that expands; the fused ones may too
            step = attn(x_BTD[:, T - new:], mask=DocumentMask(doc_BT, q_len=new), cache=cache)
    assert largest.numel < B * config.n_heads * T * per_head_key, largest.op
    # fp32: absorbed MLA weights and folded heads change only the summation order
    torch.testing.assert_close(step, full[:, T - new:], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kv_heads, new, masked", [(1, 1, False), (1, 3, True), (2, 1, True), (2, 3, False)])
def test_attend_after_cached_keys_equals_sdpa_with_enable_gqa(kv_heads, new, masked):
    """The folded decode path against the previous one: SDPA given every head and enable_gqa."""
    torch.manual_seed(0)
    B, H, T = 2, 6, 17
    q = torch.randn(B, H, new, 10)
    k, v = torch.randn(B, kv_heads, T, 10), torch.randn(B, kv_heads, T, 7)  # MLA: value narrower than key
    doc_BT = torch.zeros(B, T, dtype=torch.long)
    if masked:
        doc_BT[0, 5:], doc_BT[1, 15:] = 1, 1
    mask = DocumentMask(doc_BT, q_len=new) if masked else None
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=dense_mask(doc_BT, new), scale=0.3, enable_gqa=True)
    torch.testing.assert_close(attend(q, k, v, mask, scale=0.3), expected, atol=1e-6, rtol=1e-6)


class RecordedKVCache(KVCache):
    made: list[KVCache] = []

    def __init__(self, n_layers: int, capacity: int):
        super().__init__(n_layers, capacity)
        RecordedKVCache.made.append(self)


@pytest.mark.parametrize("kind", ["gqa", "mla"])
def test_generate_allocates_the_positions_prompt_and_new_tokens_need(kind, monkeypatch):
    monkeypatch.setattr(transformer, "KVCache", RecordedKVCache)
    RecordedKVCache.made = []
    model = model_for(kind)
    model.generate(torch.randint(0, 64, (2, 6)), 10, temperature=0)
    # 6 prompt tokens and 9 fed samples (the 10th is never fed), not max_seq_len = 64
    [cache] = RecordedKVCache.made
    assert cache.capacity == 15 and cache.length == 15
    assert all(b.shape[:2] == (2, 15) for layer in cache.layers for b in layer.buffers)
    RecordedKVCache.made = []
    model = model_for(kind, max_seq_len=16)
    model.generate(torch.randint(0, 64, (2, 20)), 30, temperature=0)  # past the window: capped, then restarted
    assert [c.capacity for c in RecordedKVCache.made] == [16] * len(RecordedKVCache.made)
    assert len(RecordedKVCache.made) > 1


class LogitsShapes(TorchDispatchMode):
    def __init__(self, vocab_size: int):
        super().__init__()
        self.vocab_size, self.shapes = vocab_size, set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        matmul = func.overloadpacket.__name__ in ("mm", "addmm", "bmm", "linear")  # not views of the weight
        if matmul and isinstance(out, torch.Tensor) and out.shape[-1] == self.vocab_size:
            self.shapes.add(tuple(out.shape))  # the head runs as a 2-D matmul: any rank counts
        return out


@pytest.mark.parametrize("use_cache", [True, False])
def test_generation_applies_the_head_to_the_last_position_only(use_cache):
    model = model_for("gqa", vocab_size=80)  # a vocabulary size no other dim has
    logits = LogitsShapes(80)
    with logits:
        out = model.generate(torch.randint(0, 64, (2, 12)), 4, temperature=0, use_cache=use_cache)
    assert logits.shapes, "the head's output was never seen"
    assert all(math.prod(s) == 2 * 80 for s in logits.shapes), logits.shapes  # one row per sequence, prefill included
    assert torch.equal(out, reference_windows(model, out[:, :12], 4, cached=use_cache))
