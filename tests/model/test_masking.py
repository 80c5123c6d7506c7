"""Document masking for packed sequences: document ids, the kernels' masks, isolation of documents, offload."""

import math
import warnings
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_mask

from moe_lightning import MoELanguageModel
from moe_lightning.training.callbacks import ActivationOffload
from moe_lightning.commands.cli import MoECLI
from moe_lightning.model import ConfigError, MoEConfig, MoETransformer, attention
from moe_lightning.model.kv_cache import KVCache
from moe_lightning.model.rotary import Rotary
from moe_lightning.model.attention import (DocumentMask, attend, dense_mask, document_block_mask, document_ids,
                                          document_mask_mod, flex_attend)
from tests.support.benchmark_script import load_benchmark

EOD = 63
# init_std 0.3 gives O(1) attention logits and routing scores (0.02 would make attention nearly uniform).
BASE = dict(vocab_size=64, dim=32, n_layers=3, n_heads=4, n_kv_heads=2, max_seq_len=32, ffn_hidden=64,
            n_dense_layers=1, num_experts=4, top_k=2, expert_hidden=16, eod_token_id=EOD, init_std=0.3)
MLA = dict(attention="mla", q_lora_rank=12, kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6)
KINDS = {"gqa": {}, "mla": MLA}


def counting(fn, counts: dict, key: str):
    """``fn`` that also adds one to ``counts[key]`` per call."""
    def wrapper(*args, **kwargs):
        counts[key] += 1
        return fn(*args, **kwargs)
    return wrapper


def model_for(kind: str, masking: bool = True) -> MoETransformer:
    torch.manual_seed(0)
    return MoETransformer(MoEConfig(**BASE, **KINDS[kind], document_masking=masking)).eval()


def packed(lengths: list[int], seed: int = 1) -> torch.Tensor:
    """One row of documents of the given lengths, each ending with EOD (the last one possibly unfinished)."""
    g = torch.Generator().manual_seed(seed)
    docs = [torch.cat([torch.randint(0, EOD, (n - 1,), generator=g), torch.tensor([EOD])]) for n in lengths]
    return torch.cat(docs)[None]


def test_document_ids_put_each_eod_in_the_document_it_ends():
    tokens = torch.tensor([[5, EOD, 7, 8, EOD, EOD, 9], [EOD, 1, 2, 3, 4, 5, 6]])
    assert document_ids(tokens, EOD).tolist() == [[0, 0, 1, 1, 1, 2, 3], [0, 1, 1, 1, 1, 1, 1]]
    # continuing after 4 cached tokens (one EOD among them in each row) gives the same ids
    assert document_ids(tokens[:, 4:], EOD, torch.tensor([1, 1])).tolist() == [[1, 2, 3], [1, 1, 1]]


def test_dense_mask_is_causal_within_documents_and_flex_predicate_agrees():
    doc_BT = document_ids(torch.tensor([[1, EOD, 2, 3, EOD, 4, 5, 6], [1, 2, 3, 4, 5, 6, 7, EOD]]), EOD)
    dense = DocumentMask(doc_BT).dense_B1ST[:, 0]
    for b in range(2):
        for q in range(8):
            for k in range(8):
                assert dense[b, q, k] == (k <= q and doc_BT[b, q] == doc_BT[b, k])
    # FlexAttention's predicate, evaluated on the full grid by torch itself, gives exactly the same mask
    assert torch.equal(create_mask(document_mask_mod(doc_BT), 2, 1, 8, 8, device="cpu")[:, 0], dense)
    # the last queries after cached keys: rows of the full mask
    assert torch.equal(DocumentMask(doc_BT, q_len=3).dense_B1ST[:, 0], dense[:, 5:])


@pytest.mark.parametrize("heads, qk_dim, v_dim", [((4, 2), 8, 8), ((3, 3), 12, 6)])
def test_flex_path_equals_sdpa_path(heads, qk_dim, v_dim):
    """The CUDA branch's kernel (FlexAttention with our block mask; eager on CPU) equals the CPU branch."""
    torch.manual_seed(0)
    B, S = 2, 40
    tokens = torch.randint(0, EOD, (B, S))
    tokens[0, [6, 7, 25]] = EOD
    tokens[1, [0, 39]] = EOD
    doc_BS = document_ids(tokens, EOD)
    mask = DocumentMask(doc_BS)
    q = torch.randn(B, heads[0], S, qk_dim)
    k, v = torch.randn(B, heads[1], S, qk_dim), torch.randn(B, heads[1], S, v_dim)
    sdpa_out = attend(q, k, v, mask, scale=0.4)
    flex_out = flex_attend(q, k, v, document_block_mask(doc_BS), scale=0.4)
    torch.testing.assert_close(flex_out, sdpa_out, atol=1e-5, rtol=1e-5)  # fp32 softmax rounding
    # both equal an explicit float64 masked softmax
    kk = k.double().repeat_interleave(heads[0] // heads[1], 1)
    vv = v.double().repeat_interleave(heads[0] // heads[1], 1)
    scores = (q.double() @ kk.transpose(-1, -2) * 0.4).masked_fill(~dense_mask(doc_BS, S), -math.inf)
    torch.testing.assert_close(sdpa_out.double(), scores.softmax(-1) @ vv, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["gqa", "mla"])
def test_changing_an_earlier_document_leaves_later_documents_unchanged(kind):
    tokens = packed([7, 5, 9])
    changed = tokens.clone()
    changed[0, :6] = (changed[0, :6] + 1) % EOD  # first document's text, not its EOD
    first_end = 7
    with torch.no_grad():
        masked, masked_changed = model_for(kind)(tokens), model_for(kind)(changed)
        plain, plain_changed = model_for(kind, False)(tokens), model_for(kind, False)(changed)
    # later documents see none of the change: equal up to the rounding of batched matmuls (sizes identical)
    torch.testing.assert_close(masked_changed[:, first_end:], masked[:, first_end:], atol=1e-5, rtol=0)
    assert (masked_changed[:, :first_end] - masked[:, :first_end]).abs().amax() > 1e-2
    # without masking the later documents' logits move: the test would catch a mask that does nothing
    assert (plain_changed[:, first_end:] - plain[:, first_end:]).abs().amax(-1).min() > 1e-3


@pytest.mark.parametrize("kind", ["gqa", "mla"])
def test_packed_logits_equal_each_document_run_alone(kind):
    lengths = [6, 10, 4, 12]
    tokens = packed(lengths)
    with torch.no_grad():
        logits = model_for(kind)(tokens)
        alone = model_for(kind, False)  # same weights (same seed), plain causal attention
        expected = torch.cat([alone(doc) for doc in tokens.split(lengths, dim=1)], dim=1)
    # rotary positions differ (packed vs from 0); scores agree up to fp32 rounding of the rotations
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)


def test_validation_loss_uses_the_mask():
    lengths = [9, 8]
    batch = torch.cat([packed(lengths, seed=2), torch.tensor([[EOD]])], dim=1)  # inputs 17 tokens, targets shifted
    module = MoELanguageModel(MoEConfig(**BASE, document_masking=True))
    torch.manual_seed(0)
    module.configure_model()
    alone = model_for("gqa", False)
    module.model.load_state_dict(alone.state_dict())
    module.model.eval()
    with torch.no_grad():
        loss = module._loss(batch)
        inputs, targets = batch[:, :-1], batch[:, 1:]
        logits = torch.cat([alone(doc) for doc in inputs.split(lengths, dim=1)], dim=1)
        expected = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        unmasked = F.cross_entropy(alone(inputs).flatten(0, 1), targets.flatten())
    torch.testing.assert_close(loss, expected, atol=1e-5, rtol=1e-5)
    assert abs(unmasked - expected) > 1e-3


@pytest.mark.parametrize("kind", ["gqa", "mla"])
def test_generation_continues_only_the_last_document(kind):
    prompt = packed([8, 5], seed=3)[:, :-1]  # an earlier document, then an unfinished one
    other = prompt.clone()
    other[0, :7] = (other[0, :7] + 5) % EOD
    model = model_for(kind)
    out, out_other = model.generate(prompt, 8, temperature=0), model.generate(other, 8, temperature=0)
    alone = model.generate(prompt[:, 8:], 8, temperature=0)
    assert torch.equal(out[:, 12:], out_other[:, 12:]) and torch.equal(out[:, 12:], alone[:, 4:])
    plain = model_for(kind, False)
    assert not torch.equal(plain.generate(prompt, 8, temperature=0)[:, 12:],
                           plain.generate(other, 8, temperature=0)[:, 12:])


def train_step(offload: ActivationOffload | None):
    model = model_for("mla").train()
    if offload is not None:
        offload.apply(model.layers)
    tokens = torch.cat([packed([7, 5, 9], seed=4), packed([12, 9], seed=5)])
    loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def test_activation_offload_with_masking_is_bit_identical_and_offloads_only_block_inputs():
    ref_loss, ref_grads = train_step(None)
    offload = ActivationOffload(prefetch=1, min_offload_bytes=0, blocks=[0, 1, 2])
    loss, grads = train_step(offload)
    assert torch.equal(loss, ref_loss)
    assert all(torch.equal(grads[n], ref_grads[n]) for n in ref_grads)
    # one hidden-state tensor [2, 20, 32] fp32 per block: the document ids/mask were never offloaded
    assert offload.tensors_offloaded == 3 and offload.bytes_offloaded == 3 * 2 * 20 * 32 * 4


def test_eod_token_id_is_validated_when_masking():
    with pytest.raises(ConfigError, match="MoEConfig.eod_token_id=64"):
        MoEConfig(**{**BASE, "eod_token_id": 64}, document_masking=True)
    MoEConfig(**{**BASE, "eod_token_id": 64})  # unused without masking


def test_fit_refuses_an_eod_id_that_is_not_the_tokenizers():
    cli = SimpleNamespace(datamodule=SimpleNamespace(vocab_size=64, seq_len=8, tokenizer=SimpleNamespace(eos_id=256)),
                          model=SimpleNamespace(config=MoEConfig(**BASE, document_masking=True)))
    with pytest.raises(ValueError, match="model.config.eod_token_id=63 .* set model.config.eod_token_id: 256"):
        MoECLI._check_model_fits_data(cli)
    cli.datamodule.tokenizer.eos_id = EOD
    MoECLI._check_model_fits_data(cli)


def test_gpu_attention_benchmark_builds_masks_in_each_timed_call_and_reports_medians(monkeypatch):
    """benchmarks/gpu_attention.py stays runnable without a GPU; both kernels pay for their own mask per call."""
    module = load_benchmark("gpu_attention")
    built = {"block": 0, "dense": 0}
    monkeypatch.setattr(module, "DocumentMask", counting(module.DocumentMask, built, "block"))
    monkeypatch.setattr(module, "dense_mask", counting(module.dense_mask, built, "dense"))
    report = module.main(["--dry-run", "--runs", "3"])
    assert set(report) == {"gqa", "mla"} and all(r["max_rel_diff"] < 1e-5 for r in report.values())
    # 1 warm-up + 3 timed calls per kernel and shape, each building its own mask
    assert built == {"block": 8, "dense": 8}


def test_qk_norm_with_masking_under_bf16_autocast_gives_the_kernels_one_dtype(monkeypatch):
    """RMSNorm's fp32 weight makes q/k fp32 while v stays bf16; compiled FlexAttention's backward refuses that."""
    seen = []

    def recording(kernel):
        def wrapper(q, k, v, *args, **kwargs):
            seen.append((q.dtype, k.dtype, v.dtype))
            return kernel(q, k, v, *args, **kwargs)
        return wrapper
    monkeypatch.setattr(F, "scaled_dot_product_attention", recording(F.scaled_dot_product_attention))
    monkeypatch.setattr(attention, "flex_attention", recording(attention.flex_attention))
    torch.manual_seed(0)
    model = MoETransformer(MoEConfig(**BASE, qk_norm="head", document_masking=True))
    tokens = packed([7, 5, 9])
    with torch.autocast("cpu", torch.bfloat16):
        model(tokens).float().sum().backward()  # the CPU path: SDPA with the dense mask
        assert len(seen) == 3
        doc_BS = document_ids(tokens, EOD)
        q, k = torch.randn(1, 4, 21, 8), torch.randn(1, 2, 21, 8)  # fp32, as QK-norm returns them
        v = torch.randn(1, 2, 21, 8, dtype=torch.bfloat16)
        flex_out = attend(q, k, v, DocumentMask(doc_BS, flex=True))  # the CUDA path's kernel, eager here
        dense_out = attend(q, k, v, DocumentMask(doc_BS))
    assert seen == [(torch.bfloat16,) * 3] * 5
    torch.testing.assert_close(flex_out, dense_out, atol=1e-2, rtol=1e-2)  # bf16 rounding of O(1) outputs


@pytest.mark.parametrize("kind", ["gqa", "mla"])
@pytest.mark.parametrize("flex", [False, True])
def test_masked_block_compiles_with_fullgraph_and_equals_eager(kind, flex):
    """The mask (and its BlockMask) is built outside the blocks, so a fullgraph-compiled block only reads it.
    ``backend="eager"``: Dynamo's tracing is what is tested; CPU FlexAttention has no backward (no_grad)."""
    model = model_for(kind)
    tokens = torch.cat([packed([7, 5, 9], seed=4), packed([12, 9], seed=5)])
    mask = DocumentMask(document_ids(tokens, EOD), flex=flex)
    cos_sin = model.rotary.cos_sin(0, tokens.shape[1])
    h_BSD = model.tok_embeddings(tokens)
    block = model.layers[0]  # attention + dense FFN (the MoE layer's compile belongs to its own tests)
    torch._dynamo.reset()
    with torch.no_grad():
        expected = block(h_BSD, mask=mask, cos_sin=cos_sin)
        compiled = torch.compile(block, backend="eager", fullgraph=True)(h_BSD, mask=mask, cos_sin=cos_sin)
    torch.testing.assert_close(compiled, expected, atol=1e-6, rtol=1e-6)  # same ops, same order


def test_block_mask_blocks_agree_with_the_dense_mask():
    """CPU FlexAttention evaluates mask_mod on the whole grid and ignores the block lists, so the lists are
    checked here against the dense mask: 200 positions (not a multiple of 128), rows with 1 and 4 documents."""
    tokens = torch.randint(0, EOD, (2, 200), generator=torch.Generator().manual_seed(6))
    tokens[1, [30, 127, 141]] = EOD  # row 1: queries 128.. see no key below 128
    doc_BS = document_ids(tokens, EOD)
    block_mask = DocumentMask(doc_BS, flex=True).block_mask
    dense_BSS = F.pad(dense_mask(doc_BS, 200)[:, 0], (0, 56, 0, 56))  # padding attends nowhere
    blocks_BQKxy = dense_BSS.unflatten(1, (2, 128)).unflatten(3, (2, 128)).permute(0, 1, 3, 2, 4)
    any_BQK, all_BQK = blocks_BQKxy.flatten(3).any(-1), blocks_BQKxy.flatten(3).all(-1)
    assert block_mask.BLOCK_SIZE == (128, 128) and block_mask.kv_num_blocks.shape == (2, 1, 2)
    assert torch.equal(block_mask.to_dense()[:, 0].bool(), any_BQK)  # partial or full: exactly the blocks in use
    for b in range(2):
        for i in range(2):
            partial = set(block_mask.kv_indices[b, 0, i, :block_mask.kv_num_blocks[b, 0, i]].tolist())
            full = set(block_mask.full_kv_indices[b, 0, i, :block_mask.full_kv_num_blocks[b, 0, i]].tolist())
            assert not partial & full
            assert full == {j for j in range(2) if all_BQK[b, i, j]}  # mask_mod skipped only where all attend
    assert any_BQK[0, 1, 0] and not any_BQK[1, 1, 0]  # the rows differ: a mask shared across rows would fail


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlexAttention's fused kernel needs CUDA")
def test_cuda_attend_with_block_mask_equals_dense_sdpa():
    """On CUDA the block lists decide what is computed: ``attend`` (compiled FlexAttention) against SDPA given
    the dense mask, forward and backward, and no deprecation warning from building the mask."""
    torch.manual_seed(0)
    tokens = torch.randint(0, EOD, (2, 200), generator=torch.Generator().manual_seed(6))
    tokens[1, [30, 127, 141]] = EOD  # row 1: queries 128.. see no key below 128
    doc_BS = document_ids(tokens, EOD).cuda()
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        mask = DocumentMask(doc_BS)
    assert mask.block_mask is not None and mask.dense_B1ST is None
    q = torch.randn(2, 4, 200, 64, device="cuda", requires_grad=True)
    k, v = (torch.randn(2, 2, 200, 64, device="cuda", requires_grad=True) for _ in range(2))
    out = attend(q, k, v, mask)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=dense_mask(doc_BS, 200), enable_gqa=True)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
    for a, b in zip((out, *grads), (ref, *ref_grads)):  # fp32 kernels, different tiling: ~1e-6; TF32 matmuls ~1e-3
        torch.testing.assert_close(a, b, atol=2e-3, rtol=2e-3)


def test_rotary_tables_and_the_cached_causal_mask_are_built_once_per_forward(monkeypatch):
    calls = {"cos_sin": 0, "dense_mask": 0}
    monkeypatch.setattr(Rotary, "cos_sin", counting(Rotary.cos_sin, calls, "cos_sin"))
    monkeypatch.setattr(attention, "dense_mask", counting(attention.dense_mask, calls, "dense_mask"))
    for kind in KINDS:
        model, cache = model_for(kind, masking=False), KVCache(3, 32)
        tokens = packed([7, 5, 9])
        with torch.no_grad():
            model(tokens[:, :10], cache=cache)
            calls.update(cos_sin=0, dense_mask=0)
            model(tokens[:, 10:], cache=cache)  # several queries after cached keys: an offset causal mask
        assert calls == {"cos_sin": 1, "dense_mask": 1}, kind  # not once per layer (3)
