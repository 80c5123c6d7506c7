"""Chunked head + cross-entropy (``moe_lightning.model.loss``) against the plain full-logits ``F.cross_entropy``.

Tolerances: in fp32 the chunked loss sums per-chunk partial sums where the reference reduces all tokens at
once, and its gradients come from the same matmuls split by rows, so the two differ only by rounding
(observed <= 5e-7 absolute on O(1) values); ``rtol=1e-5, atol=1e-6`` leaves room for that and fails on any
real error (a missed chunk, a wrong softmax, an ignored target counted, a wrong scale: all >= 1e-2).
"""

import json
import os
from functools import partial

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from torch.utils._python_dispatch import TorchDispatchMode

from moe_lightning import MoEConfig, MoELanguageModel, TextDataModule
from moe_lightning.training.callbacks import ActivationOffload
from moe_lightning.model.loss import chunked_cross_entropy
from moe_lightning.optim import WarmupCosineLR
from tests.support.distributed import REPO_ROOT, run_ranks

TOL, APPROX = dict(rtol=1e-5, atol=1e-6), dict(rel=1e-5, abs=1e-6)
T, D, V = 64, 8, 50  # T·V = 3200 logits; one chunk of 16 holds 800, the head 400


def inputs(seed: int = 0):
    """O(1) logits (h ~ N(0, 1), W ~ N(0, 0.8²)): softmax far from uniform, so errors show."""
    g = torch.Generator().manual_seed(seed)
    h_TD = torch.randn(T, D, generator=g, requires_grad=True)
    w_VD = (0.8 * torch.randn(V, D, generator=g)).requires_grad_()
    targets_T = torch.randint(0, V, (T,), generator=g)
    targets_T[[3, 17, 40]] = -100  # ignored, as F.cross_entropy's default ignore_index
    return h_TD, w_VD, targets_T


def loss_and_grads(loss_fn, h_TD, w_VD, targets_T):
    h_TD.grad = w_VD.grad = None
    loss = loss_fn(h_TD, w_VD, targets_T)
    (3.0 * loss).backward()  # a non-unit upstream gradient, as with accumulation's 1/n scaling
    return loss.detach(), h_TD.grad.clone(), w_VD.grad.clone()


def full_logits(h_TD, w_VD, targets_T):
    return F.cross_entropy((h_TD @ w_VD.T).float(), targets_T)


@pytest.mark.parametrize("chunk", [1, 7, 16, 64, 1000])  # single tokens, a ragged last chunk, exact, one, > T
def test_chunked_loss_and_gradients_equal_full_logits_cross_entropy(chunk):
    h_TD, w_VD, targets_T = inputs()
    expected = loss_and_grads(full_logits, h_TD, w_VD, targets_T)
    got = loss_and_grads(partial(chunked_cross_entropy, chunk_size=chunk), h_TD, w_VD, targets_T)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, **TOL)
    assert got[1][[3, 17, 40]].abs().max() == 0  # ignored positions get no gradient


def test_every_target_ignored_gives_nan_like_cross_entropy():
    h_TD, w_VD, targets_T = inputs()
    targets_T[:] = -100
    assert full_logits(h_TD, w_VD, targets_T).isnan() and chunked_cross_entropy(h_TD, w_VD, targets_T, 16).isnan()


def test_bf16_autocast_matches_the_autocast_head():
    """Under autocast both multiply in bf16; the softmax stays fp32. bf16 rounding (2^-8 relative) bounds
    the gradient difference: the chunked weight gradient rounds each chunk's product once more."""
    h_TD, w_VD, targets_T = inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = loss_and_grads(full_logits, h_TD, w_VD, targets_T)
        got = loss_and_grads(partial(chunked_cross_entropy, chunk_size=16), h_TD, w_VD, targets_T)
    assert got[0] == pytest.approx(expected[0].item(), rel=1e-5)  # the same bf16 logits, fp32 reductions
    for g, e in zip(got[1:], expected[1:]):
        assert g.dtype == e.dtype == torch.float32
        torch.testing.assert_close(g, e, rtol=2e-2, atol=2e-3)


class LargestTensor(TorchDispatchMode):
    """The most elements of any tensor an operator returns while active."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return out


def test_autograd_keeps_no_vocab_sized_tensor_and_no_op_builds_one():
    h_TD, w_VD, targets_T = inputs()
    saved = []

    def pack(t):
        if t is not w_VD:  # the parameter itself costs nothing extra
            saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        full_logits(h_TD, w_VD, targets_T)
    assert sum(saved) >= 4 * T * V  # the plain loss keeps [T, V] fp32 (its log-softmax) for backward

    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = chunked_cross_entropy(h_TD, w_VD, targets_T, 16)
    # hidden states, targets (int64), valid mask (bool), fp32 log-sum-exp, the valid count
    assert sorted(saved) == sorted([4 * T * D, 8 * T, T, 4 * T, 8])

    largest = LargestTensor()
    with largest:
        loss = chunked_cross_entropy(h_TD, w_VD, targets_T, 16)
        loss.backward()
    assert largest.numel == 16 * V  # one chunk's logits, in forward and in backward (> V·D, the head grad)


def tiny_module(chunk: int | None) -> MoELanguageModel:
    torch.manual_seed(0)
    config = MoEConfig(vocab_size=300, dim=32, n_layers=3, n_heads=4, n_kv_heads=2, max_seq_len=32, ffn_hidden=64,
                       n_dense_layers=1, num_experts=4, top_k=2, expert_hidden=32, n_shared_experts=1, init_std=0.3)
    module = MoELanguageModel(config, optimizer=partial(torch.optim.AdamW, lr=3e-3),
                              lr_scheduler=partial(WarmupCosineLR, warmup_steps=1), loss_chunk_size=chunk)
    module.configure_model()
    return module


def test_bad_chunk_size_is_refused_naming_the_field():
    with pytest.raises(ValueError, match="model.loss_chunk_size=0"):
        MoELanguageModel(loss_chunk_size=0)


class Losses(Callback):
    def __init__(self):
        self.train = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.train.append(outputs["loss"].item())


def fit(chunk: int | None, tmp_path) -> tuple[list[float], float, MoELanguageModel]:
    """3 optimizer steps of 2 accumulated micro-batches, every block offloaded, then validation."""
    L.seed_everything(0)
    module, losses = tiny_module(chunk), Losses()
    offload = ActivationOffload(prefetch=1, min_offload_bytes=0)
    trainer = L.Trainer(max_steps=3, accumulate_grad_batches=2, accelerator="cpu", devices=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=2, val_check_interval=6, num_sanity_val_steps=0, callbacks=[losses, offload],
                        default_root_dir=tmp_path)
    trainer.fit(module, TextDataModule(os.__file__, seq_len=32, batch_size=4, val_fraction=0.05))
    assert offload.tensors_offloaded == 2  # the inputs of blocks 0 and 1 went to "host" in the last step
    return losses.train, trainer.callback_metrics["val/loss"].item(), module


def test_training_with_accumulation_offload_and_validation_equals_unchunked(tmp_path):
    train_full, val_full, full = fit(None, tmp_path)
    train_chunked, val_chunked, chunked = fit(7, tmp_path)  # 4 x 32 tokens: 18 full chunks and a ragged one
    assert len(train_chunked) == 6 and train_chunked == pytest.approx(train_full, **APPROX)
    assert val_chunked == pytest.approx(val_full, **APPROX)
    for (name, p), q in zip(full.named_parameters(), chunked.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-4, atol=1e-5, msg=name)  # after 3 AdamW steps


def test_validation_uses_the_chunked_loss(tmp_path):
    """No operator in a validation run builds the [4 x 32, 300] logits (the unchunked run does)."""
    largest = {}
    for chunk in (None, 7):
        trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                            enable_model_summary=False, limit_val_batches=1, default_root_dir=tmp_path)
        with LargestTensor() as mode:
            metrics = trainer.validate(tiny_module(chunk), TextDataModule(os.__file__, seq_len=32, batch_size=4),
                                       verbose=False)[0]
        largest[chunk] = mode.numel
        assert metrics["val/loss"] > 0
    assert largest[None] == 4 * 32 * 300 > largest[7]


@pytest.fixture(scope="module")
def fsdp_runs(tmp_path_factory):
    """2 gloo ranks, FSDP2 via MoEFSDPStrategy, 2 accumulated micro-batches per step, clipping on."""
    tmp, runs = tmp_path_factory.mktemp("loss_fsdp"), {}
    for name, extra in (("full", ()), ("chunked", ("--loss-chunk", "5"))):
        out = tmp / f"{name}.json"
        run_ranks(REPO_ROOT / "tests" / "launchers" / "strategy_run.py", 2, "--accumulate", "2", "--max-steps", "2",
                  "--clip", "1.0", "--batch-size", "2", *extra, "--out", str(out))
        runs[name] = json.loads(out.read_text())
    return runs


def test_fsdp_chunked_run_equals_unchunked_and_gathers_the_head_once(fsdp_runs):
    full, chunked = fsdp_runs["full"], fsdp_runs["chunked"]
    assert [r["loss"] for r in chunked["batches"]] == pytest.approx([r["loss"] for r in full["batches"]], **APPROX)
    assert len(chunked["grad_norms"]) == 2
    for c, f in zip(chunked["grad_norms"], full["grad_norms"]):
        assert c == pytest.approx(f, **APPROX)
    # 32 tokens x 2 sequences in chunks of 5: 13 chunks, yet the same collectives as the full-logits run
    for c, f in zip(chunked["batches"], full["batches"]):
        assert c["calls"] == f["calls"] and c["bytes"] == f["bytes"]
    calls = full["batches"][1]["calls"]  # the counter sees FSDP2's gathers (whichever API the torch version uses)
    assert calls.get("all_gather_single", 0) + calls.get("all_gather_into_tensor", 0) > 0
