"""Context parallelism: head-tail balance (counted), the loss scaling, and the exchange on real gloo ranks against
one process (MLA and GQA, document masking off and on, CP 2 and 4)."""

import json

import pytest
import torch
import torch.nn.functional as F

from moe_lightning.model.attention import document_ids
from moe_lightning.model.loss import context_parallel_mean
from moe_lightning.parallel.context_parallel import attended_pairs, check_sequence_length, head_tail_positions
from tests.support.distributed import LAUNCHERS, run_ranks


@pytest.mark.parametrize("size", [1, 2, 4, 8])
def test_head_tail_shards_cover_every_position_once(size):
    shards = [head_tail_positions(64, size, r) for r in range(size)]
    assert torch.equal(torch.cat(shards).sort().values, torch.arange(64))
    assert all(torch.equal(s, s.sort().values) and len(s) == 64 // size for s in shards)
    assert shards[0][:64 // (2 * size)].tolist() == list(range(64 // (2 * size)))  # rank 0 holds the first chunk
    assert shards[0][-1] == 63  # ... and the last


def _pairs_pure_python(doc: list[int], positions: list[int]) -> int:
    """Keys each query sees, counted one by one: same document, not in the future."""
    return sum(sum(1 for k in range(q + 1) if doc[k] == doc[q]) for q in positions)


@pytest.mark.parametrize("size", [2, 4, 8])
def test_head_tail_balances_causal_pairs_within_ten_percent(size):
    S = 1024
    pairs = [_pairs_pure_python([0] * S, head_tail_positions(S, size, r).tolist()) for r in range(size)]
    mean = sum(pairs) / size
    assert sum(pairs) == S * (S + 1) // 2
    assert max(pairs) / mean <= 1.10 and min(pairs) / mean >= 0.90
    # a contiguous split (rank r takes the r-th S/N) would not be: its last rank does 2N-1 times the first's work
    contiguous = [_pairs_pure_python([0] * S, list(range(r * S // size, (r + 1) * S // size))) for r in range(size)]
    assert max(contiguous) / mean > 1.4  # (2N-1)/N: 1.5 at N=2


def test_attended_pairs_equals_the_pure_python_count_with_documents():
    g = torch.Generator().manual_seed(0)
    tokens_S = torch.randint(0, 12, (96,), generator=g)
    doc_S = document_ids(tokens_S[None], 0)[0]
    for size in (1, 2, 4):
        for rank in range(size):
            positions = head_tail_positions(96, size, rank)
            assert attended_pairs(doc_S, positions) == _pairs_pure_python(doc_S.tolist(), positions.tolist())


def test_sequence_length_not_a_multiple_of_two_n_is_refused_naming_the_field():
    check_sequence_length(64, 4)
    with pytest.raises(ValueError, match=r"data.seq_len.*multiple of 8.*e\.g\. 72"):
        check_sequence_length(68, 4)


def test_scaled_shard_losses_averaged_over_ranks_give_the_whole_batch_gradient():
    """What FSDP computes (the mean over the ranks' gradients of ``context_parallel_mean``) is the gradient of the
    whole batch's mean cross-entropy, ignored targets included; float64, so only rounding differs."""
    g = torch.Generator().manual_seed(0)
    B, S, D, V, N = 2, 16, 8, 11, 4
    h_BSD = torch.randn(B, S, D, generator=g, dtype=torch.float64)
    w_VD = torch.randn(V, D, generator=g, dtype=torch.float64, requires_grad=True)
    targets_BS = torch.randint(0, V, (B, S), generator=g)
    targets_BS[0, 3:9] = -100  # uneven across shards
    F.cross_entropy((h_BSD @ w_VD.T).flatten(0, 1), targets_BS.flatten()).backward()
    expected = w_VD.grad.clone()
    w_VD.grad = None
    for rank in range(N):
        pos = head_tail_positions(S, N, rank)
        total = F.cross_entropy((h_BSD[:, pos] @ w_VD.T).flatten(0, 1), targets_BS[:, pos].flatten(), reduction="sum")
        context_parallel_mean(total, targets_BS, N).backward()
    torch.testing.assert_close(w_VD.grad / N, expected, rtol=1e-12, atol=1e-14)


def _check_against_one_process(results: dict) -> None:
    """fp32: the shards sum the same terms in another order (attention rows over all T keys, each gradient the sum
    of N ranks' shares, the reduce-scatter's sums): differences of a few ulp of the largest terms. Measured
    <= 7e-7 of each parameter's largest gradient entry at CP 2 and 4; 1e-5 leaves margin, while a wrong chunk
    order, a missing gradient sum or a wrong loss scale gives errors of order 1."""
    assert set(results) == {"mla-causal", "mla-docs", "gqa-causal", "gqa-docs", "mla-docs-balance"}
    for name, r in results.items():
        assert r["cp_loss"] == pytest.approx(r["loss"], rel=1e-6), name
        assert r["grad_rel_error"] < 1e-5, name
        # the balancing losses: every rank computes the whole sequences' (sums completed over the group)
        assert r["cp_aux_losses"] == pytest.approx(r["aux_losses"], rel=1e-6), name
        assert r["max_logit_error"] < 1e-4, name  # QK-clip's maxima (logits of O(1-10)), reduced over the group
        # one exchange per layer and pass, of S x width x 4 B x (N-1)/N per batch row: the latent (C + R) for
        # MLA, the grouped K and V (2 G K) for GQA
        assert [kind for kind, _ in r["forward_calls"]] == ["all_gather"] * r["layers"], name
        assert [kind for kind, _ in r["backward_calls"]] == ["reduce_scatter"] * r["layers"], name
        assert {sent for _, sent in r["forward_calls"] + r["backward_calls"]} == {r["expected_bytes"]}, name
    assert results["mla-causal"]["expected_bytes"] * 2 == results["gqa-causal"]["expected_bytes"]
    balanced = results["mla-docs-balance"]
    assert len(balanced["aux_losses"]) == 2 and all(a > 0 for a in balanced["aux_losses"])
    # one all-reduce of [B = 2, 1 + 2E + 1] fp32 sums (E = 4) per MoE layer and forward, none in backward (the
    # ranks' gradients of the sums are equal: scaled by N); none without the losses
    assert balanced["forward_reduces"] == [2 * (1 + 2 * 4 + 1) * 4] * 2 and balanced["backward_reduces"] == []
    others = [r for name, r in results.items() if name != "mla-docs-balance"]
    assert all(r["forward_reduces"] == r["backward_reduces"] == [] for r in others)
    assert balanced["balance_share"] > 0.1  # a rank's own sums (or a gradient off by N) would miss by far more than 1e-5


def test_cp2_forward_and_backward_equal_one_process(tmp_path):
    run_ranks(LAUNCHERS / "context_parallel_run.py", 2, "--out", str(tmp_path / "cp2.json"))
    results = json.loads((tmp_path / "cp2.json").read_text())
    _check_against_one_process(results)
    assert results["mla-causal"]["expected_bytes"] == 2 * 64 * (12 + 4) * 4 // 2


@pytest.mark.extended
def test_cp4_forward_and_backward_equal_one_process(tmp_path):
    run_ranks(LAUNCHERS / "context_parallel_run.py", 4, "--out", str(tmp_path / "cp4.json"))
    results = json.loads((tmp_path / "cp4.json").read_text())
    _check_against_one_process(results)
    assert results["mla-causal"]["expected_bytes"] == 2 * 64 * (12 + 4) * 4 * 3 // 4


def test_benchmark_prints_latent_and_expanded_bytes_at_the_1t_shape(capsys):
    from tests.support.benchmark_script import load_benchmark

    load_benchmark("context_parallel").wire([1, 4])
    out = capsys.readouterr().out
    assert "latent + rotary key 576, expanded K and V 40960 (71.1x)" in out
    assert f"{65536 * 576 * 2 * 3 / 4 / 2**20:.1f} MiB" in out  # S x width x 2 B x (N-1)/N, N = 4


@pytest.mark.parametrize("masked", [False, True])
def test_the_benchmarks_kernel_emulation_computes_sdpa(masked):
    """The memory count replaces SDPA by a chunked function that keeps what GPU kernels keep: it must compute the
    same attention, folded query heads (the shard path) included."""
    from tests.support.benchmark_script import load_benchmark

    bench = load_benchmark("context_parallel")
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 24, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 2, 40, 8, generator=g, dtype=torch.float64) for _ in range(2))
    mask = torch.rand(2, 1, 24, 40, generator=g) > 0.3 if masked else None
    mask = None if mask is None else mask | (torch.arange(40) == 0)  # no row without a key
    kw = dict(attn_mask=mask) if masked else dict(is_causal=True)
    expected = F.scaled_dot_product_attention(q, k, v, scale=0.5, enable_gqa=True, **kw) if masked else \
        F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), scale=0.5,
                                       attn_mask=dense_causal(24, 40))
    torch.testing.assert_close(bench._kernel_sdpa(q, k, v, scale=0.5, enable_gqa=True, **kw), expected)


def dense_causal(S: int, T: int) -> torch.Tensor:
    return (torch.arange(T - S, T)[:, None] >= torch.arange(T))[None, None]


class _Sent:
    """Records what the exchange's two collectives are handed: (op, dtype, bytes) per call."""

    def __init__(self, monkeypatch):
        import torch.distributed as dist

        self.calls = []
        gather, scatter = dist.all_gather_into_tensor, dist.reduce_scatter_tensor

        def all_gather(out, inp, *args, **kwargs):
            self.calls.append(("all_gather", inp.dtype, inp.numel() * inp.element_size()))
            return gather(out, inp, *args, **kwargs)

        def reduce_scatter(out, inp, *args, **kwargs):
            self.calls.append(("reduce_scatter", inp.dtype, inp.numel() * inp.element_size()))
            return scatter(out, inp, *args, **kwargs)
        monkeypatch.setattr(dist, "all_gather_into_tensor", all_gather)
        monkeypatch.setattr(dist, "reduce_scatter_tensor", reduce_scatter)


def test_the_key_side_travels_in_the_autocast_dtype_and_its_gradient_is_summed_in_fp32(one_rank_group, monkeypatch):
    """Issue 45, item 5. MLA with fp32 parameters under bf16 autocast: the normalised latent comes out fp32 and the
    rotary key bf16, and ``torch.cat`` sent both as fp32 (8 x 12 x 4 B = 384 B a token instead of 96 x 2 B). Now the
    gather sends B x S x (C + R) values in bf16, the reduce-scatter sums the gradients in fp32, and each piece's
    gradient comes back in its own dtype."""
    import torch.distributed as dist

    from moe_lightning.model import MoEConfig
    from moe_lightning.model.mla import MultiHeadLatentAttention
    from moe_lightning.parallel.context_parallel import ContextParallelShard

    B, S, C, R = 2, 16, 12, 4
    config = MoEConfig(vocab_size=64, dim=32, n_heads=4, max_seq_len=S, attention="mla", q_lora_rank=0,
                       kv_lora_rank=C, qk_nope_head_dim=8, qk_rope_head_dim=R, v_head_dim=8)
    torch.manual_seed(0)
    attention = MultiHeadLatentAttention(config)
    sent = _Sent(monkeypatch)
    x_BSD = torch.randn(B, S, 32, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out_BSD = attention(x_BSD, sequence_shard=ContextParallelShard(dist.group.WORLD))
    out_BSD.float().mul(torch.linspace(-1, 1, out_BSD.numel()).view_as(out_BSD)).sum().backward()
    assert sent.calls == [("all_gather", torch.bfloat16, B * S * (C + R) * 2),
                          ("reduce_scatter", torch.float32, B * S * (C + R) * 4)]
    assert x_BSD.grad is not None and torch.isfinite(x_BSD.grad).all()


def test_a_float64_key_side_gradient_is_summed_in_float64(one_rank_group, monkeypatch):
    """The fp32 sum widens bf16 gradients, and must not round float64 ones (the float64 recomputations that show CP
    equals one process to 1e-16): on one rank the exchange's backward returns the upstream gradient exactly."""
    import torch.distributed as dist

    from moe_lightning.parallel.context_parallel import ContextParallelShard

    sent = _Sent(monkeypatch)
    latent_BSC = torch.randn(2, 8, 6, dtype=torch.float64, requires_grad=True)
    rope_BSR = torch.randn(2, 8, 2, dtype=torch.float64, requires_grad=True)
    gathered = ContextParallelShard(dist.group.WORLD).gather(latent_BSC, rope_BSR)
    upstream = [torch.randn_like(g) / 3 for g in gathered]  # not representable in fp32
    torch.autograd.backward(gathered, upstream)
    assert sent.calls[-1][:2] == ("reduce_scatter", torch.float64)
    assert torch.equal(latent_BSC.grad, upstream[0]) and torch.equal(rope_BSR.grad, upstream[1])


def test_mixed_dtypes_outside_autocast_are_refused():
    from moe_lightning.parallel.context_parallel import exchange_dtype

    assert exchange_dtype(torch.zeros(1, 2, 3), torch.zeros(1, 2, 1)) == torch.float32
    with pytest.raises(ValueError, match="one dtype"):
        exchange_dtype(torch.zeros(1, 2, 3), torch.zeros(1, 2, 1, dtype=torch.bfloat16))


@pytest.mark.parametrize("size", [2, 4, 8])
def test_a_truncated_shards_positions_are_counted_without_reading_the_device(size):
    """Issue 45, item 5: multi-token prediction's depth k asks for this rank's positions below S - k; that count
    was ``int((positions < length).sum())``, a device-to-host read (about three per depth and micro-batch on CUDA).
    Counted from the chunk bounds now: no ``aten._local_scalar_dense`` (what ``int()``/``.item()`` dispatch to), and
    the positions equal the filtered head-tail shard for every rank and length."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from moe_lightning.parallel.context_parallel import ContextParallelShard

    class ScalarReads(TorchDispatchMode):
        reads = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ScalarReads.reads += func is torch.ops.aten._local_scalar_dense.default
            return func(*args, **(kwargs or {}))

    S = 8 * size
    for rank in range(size):
        shard = ContextParallelShard.__new__(ContextParallelShard)
        shard.size, shard.rank = size, rank
        everything = head_tail_positions(S, size, rank)
        for length in range(S - 4, S + 1):
            with ScalarReads():
                got = shard.truncated(S, length).positions(length, torch.device("cpu"))
            assert got.tolist() == [p for p in everything.tolist() if p < length]
    assert ScalarReads.reads == 0


def test_multi_token_prediction_under_a_shard_reads_nothing_back_from_the_device():
    """The whole MTP forward and backward as rank 0 of a CP 2 group (the exchange stood in for by a local copy: its
    values do not matter here) makes exactly the host reads of the one-rank model: none of its own. Before, each
    depth read its position count back (``int((positions < length).sum())``): 6 reads at 3 depths counted here,
    and the loss's targets of each depth one more."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from moe_lightning.model import MoEConfig, MoETransformer
    from moe_lightning.parallel.context_parallel import ContextParallelShard

    class LocalPair(ContextParallelShard):  # rank 0 of 2; its "other rank" holds a copy of its rows
        def __init__(self):
            self.size, self.rank = 2, 0

        def gather(self, *key_side_BS):
            return tuple(torch.cat([x, x], dim=1) for x in key_side_BS)

        def sum_over_sequence(self, sums_BX):
            return sums_BX

    class ScalarReads(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.reads = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.reads += func is torch.ops.aten._local_scalar_dense.default
            return func(*args, **(kwargs or {}))

    config = MoEConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, max_seq_len=32, ffn_hidden=48, n_dense_layers=1,
                       num_experts=4, top_k=2, expert_hidden=16, attention="mla", q_lora_rank=0, kv_lora_rank=12,
                       qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, mtp_layers=3, document_masking=True,
                       eod_token_id=3, init_std=0.3)
    tokens_BS = torch.randint(4, 64, (2, 32), generator=torch.Generator().manual_seed(0))
    tokens_BS[:, [9, 20]] = 3
    reads = {}
    for name in ("one rank", "CP 2"):
        torch.manual_seed(0)
        model = MoETransformer(config)
        if name == "CP 2":
            model.sequence_shard = LocalPair()
        with ScalarReads() as counter:
            hidden = model(tokens_BS, return_hidden=True, mtp=True)
            sum((h * torch.linspace(-1, 1, h.numel()).view_as(h)).sum() for h in hidden).backward()
        reads[name] = counter.reads
        assert [h.shape[1] for h in hidden] == ([32, 31, 30, 29] if name == "one rank" else [16, 15, 14, 13])  # rank 0 of 2: chunks 0 and 3
    assert reads["CP 2"] == reads["one rank"]
