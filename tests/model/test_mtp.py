"""Multi-token prediction (DeepSeek-V3) against the equations, written out position by position in float64.

The reference takes the main model's final hidden states from the model (the main model is checked against
transformers elsewhere) and computes everything MTP adds by hand: the shifted embeddings, both RMSNorms, the
``2·dim -> dim`` projection in the released order ``[emb, hidden]``, the final norm, the shared head, which
targets exist at each depth, which cross an end-of-document token, and ``main + λ/D · Σ_k CE_k``. The MTP block
itself is run once per document segment without any mask, so document masking is checked independently too.

Tolerances: a dense model runs in float64 (the block included) but, by design, its loss takes the softmax of
fp32 logits: model and reference agree to fp32 rounding of O(1)-O(10) logits (observed 5e-9 relative in the
loss): ``rtol=1e-6``. The MoE model runs in fp32 (grouped GEMMs take no float64), so its block output carries
fp32 rounding (~1e-7 relative) into an otherwise float64 reference: ``rtol=1e-5``. A wrong order of the
concatenation, a one-position shift, a counted ignored target or a wrong weight all differ by > 1e-2.
"""

import math
from functools import partial

import lightning as L
import pytest
import torch
import torch.nn.functional as F

from moe_lightning import MoELanguageModel
from moe_lightning.model import ConfigError, MoEConfig, MoETransformer, mtp
from moe_lightning.optim import WarmupCosineLR
from moe_lightning.optim.grouping import parameter_roles

EOD = 256


def config(kind: str, **overrides) -> MoEConfig:
    """O(1) activations (init_std 0.3), so attention and routing are far from uniform."""
    dense = kind == "dense"
    fields = dict(vocab_size=300, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32, ffn_hidden=64,
                  n_dense_layers=2 if dense else 1, num_experts=4, top_k=2, expert_hidden=32, n_shared_experts=1,
                  init_std=0.3, mtp_layers=2, mtp_loss_weight=0.7, document_masking=True, eod_token_id=EOD)
    return MoEConfig(**{**fields, **overrides})


def batch(seed: int = 0) -> torch.Tensor:
    """Two rows of 17 tokens with end-of-document tokens inside, one right before the end."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, EOD, (2, 17), generator=g)
    tokens[0, [4, 11]] = EOD
    tokens[1, [7, 14]] = EOD
    return tokens


def rms(x, w, eps):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def block_per_document(block, x_SD, doc_S, rotary, dtype):
    """The block on each document segment alone (plain causal attention, rotary at the packed positions)."""
    out = torch.empty_like(x_SD)
    for doc in doc_S.unique():
        pos = (doc_S == doc).nonzero().flatten()
        start, n = int(pos[0]), len(pos)
        y = block(x_SD[None, start:start + n].to(dtype), mask=None, cache=None, cos_sin=rotary.cos_sin(start, n))
        out[start:start + n] = y[0].double()
    return out


def reference_loss(model: MoETransformer, tokens_BS1: torch.Tensor, masking: bool = True) -> tuple:
    """``(main + λ/D · Σ CE_k, [CE_1..CE_D])`` from the equations, in float64 (the MTP block in the model's dtype)."""
    c, dtype = model.config, model.output.weight.dtype
    B, S = tokens_BS1.shape[0], tokens_BS1.shape[1] - 1
    W, E = model.output.weight.double(), model.tok_embeddings.weight.double()
    hidden = model(tokens_BS1[:, :-1], return_hidden=True).double()  # h^0: the main model's final-normed state

    def ce(h_D, target):
        return -torch.log_softmax(W @ h_D, -1)[target]

    main = torch.stack([ce(hidden[b, i], tokens_BS1[b, i + 1]) for b in range(B) for i in range(S)]).mean()
    ces = []
    for k, module in enumerate(model.mtp, start=1):
        n, nxt, terms = S - k, [], []
        P = module.eh_proj.weight.double()
        for b in range(B):
            row = tokens_BS1[b]
            x = torch.stack([P @ torch.cat([rms(E[row[i + k]], module.enorm.weight.double(), c.norm_eps),
                                              rms(hidden[b, i], module.hnorm.weight.double(), c.norm_eps)])
                             for i in range(n)])
            doc = torch.tensor([int((row[:i] == EOD).sum()) if masking else 0 for i in range(n)])
            h = rms(block_per_document(module.block, x, doc, model.rotary, dtype), module.norm.weight.double(),
                    c.norm_eps)
            nxt.append(h)
            for i in range(n):
                crosses = masking and bool((row[i:i + k] == EOD).any())  # hidden at i and t[i+k]: two documents
                if not crosses:
                    terms.append(ce(h[i], row[i + k + 1]))
        hidden = torch.stack(nxt)
        ces.append(torch.stack(terms).mean())
    return main + c.mtp_loss_weight / c.mtp_layers * torch.stack(ces).sum(), ces


def module_for(cfg: MoEConfig, chunk: int | None = None, dtype=torch.float32) -> MoELanguageModel:
    torch.manual_seed(0)
    module = MoELanguageModel(cfg, loss_chunk_size=chunk)
    module.configure_model()
    module.model.to(dtype)
    for moe in module.model.moe_layers():  # a non-zero balancing bias, so the test sees it is used
        moe.router.expert_bias.normal_(0, 0.5)
    return module.train()


@pytest.mark.parametrize("kind, chunk", [("dense", None), ("dense", 5), ("moe", 7)])
def test_loss_and_gradients_equal_the_float64_equations(kind, chunk):
    dtype = torch.float64 if kind == "dense" else torch.float32
    tol = dict(rtol=1e-6, atol=1e-8) if kind == "dense" else dict(rtol=1e-5, atol=1e-6)
    grad_tol = dict(rtol=1e-5, atol=1e-7) if kind == "dense" else dict(rtol=1e-4, atol=1e-6)  # ~0.1 gradients
    module, tokens = module_for(config(kind), chunk, dtype), batch()
    loss = module._loss(tokens)
    loss.backward()
    got = {n: p.grad.double().clone() for n, p in module.model.named_parameters()}
    module.model.zero_grad()
    expected, ces = reference_loss(module.model, tokens)
    expected.backward()
    torch.testing.assert_close(loss.double(), expected, **tol)
    assert all(1.0 < ce < 20.0 for ce in ces)  # O(1) losses, far from a degenerate uniform softmax
    assert module._main_loss.item() == pytest.approx((expected - 0.7 / 2 * sum(ces)).item(), rel=1e-5)
    for name, p in module.model.named_parameters():
        if p.grad is None:
            continue
        torch.testing.assert_close(got[name], p.grad.double(), **grad_tol, msg=name)
    assert got["mtp.0.eh_proj.weight"].abs().sum() > 0 and got["mtp.1.enorm.weight"].abs().sum() > 0


def test_without_document_masking_every_target_inside_the_batch_counts():
    module, tokens = module_for(config("dense", document_masking=False), None, torch.float64), batch()
    expected, _ = reference_loss(module.model, tokens, masking=False)
    torch.testing.assert_close(module._loss(tokens).double(), expected, rtol=1e-6, atol=1e-8)


def test_targets_crossing_an_end_of_document_are_ignored():
    tokens = torch.tensor([[1, EOD, 3, 4, EOD, 5, 6]])  # S = 6
    assert mtp.targets(tokens, 0, EOD).tolist() == [[EOD, 3, 4, EOD, 5, 6]]  # the main loss: nothing ignored
    # depth 2, position i predicts t[i+3] and is ignored when t[i] or t[i+1] ends a document
    assert mtp.targets(tokens, 2, EOD).tolist() == [[-100, -100, 5, -100]]
    assert mtp.targets(tokens, 2, None).tolist() == [[4, EOD, 5, 6]]


def test_a_document_predicts_the_same_packed_after_another_as_alone():
    """Depth-k hidden states of a document's positions do not see the document before it. (Rotary tables are
    fp32, so the shifted positions agree to ~1e-6; a leak across the boundary changes them by O(0.1).)"""
    model = module_for(config("dense"), None, torch.float64).model
    first, second = torch.tensor([5, 6, 7, 8, EOD]), torch.tensor([9, 10, 11, 12, 13, 14, 15, 16])
    packed = model(torch.cat([first, second])[None], mtp=True)
    alone = model(second[None], mtp=True)
    for k in range(1, 3):
        torch.testing.assert_close(packed[k][0, len(first):], alone[k][0], rtol=1e-4, atol=1e-5)
    leaked = model(torch.cat([first.flip(0)[1:], first[-1:], second])[None], mtp=True)  # another first document
    torch.testing.assert_close(leaked[1][0, len(first):], packed[1][0, len(first):], rtol=1e-4, atol=1e-5)


def test_runs_without_mtp_are_unchanged():
    """mtp_layers=0: no MTP parameter, the training loss is the plain next-token cross-entropy, bitwise."""
    module = module_for(config("moe", mtp_layers=0))
    assert len(module.model.mtp) == 0 and not any(n.startswith("mtp") for n in module.model.state_dict())
    tokens = batch()
    expected = F.cross_entropy(module.model(tokens[:, :-1]).flatten(0, 1).float(), tokens[:, 1:].flatten())
    assert torch.equal(module._loss(tokens), expected)
    assert len(MoETransformer(config("moe")).moe_layers()) == len(module.model.moe_layers()) + 2  # MTP blocks route
    assert not any(m.block.is_moe for m in MoETransformer(config("dense")).mtp)  # shaped like the last layer


def test_generation_validation_and_test_ignore_the_mtp_modules():
    module = module_for(config("moe"))
    tokens = batch()
    model = module.model
    reference = MoETransformer(config("moe", mtp_layers=0))
    reference.load_state_dict({k: v for k, v in model.state_dict().items() if not k.startswith("mtp.")})
    g1, g2 = (torch.Generator().manual_seed(1) for _ in range(2))
    assert torch.equal(model.generate(tokens[:, :5], 6, generator=g1), reference.generate(tokens[:, :5], 6, generator=g2))
    module.eval()  # validation and test: the main next-token loss only
    expected = F.cross_entropy(reference(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    torch.testing.assert_close(module._loss(tokens), expected, rtol=0, atol=0)


def test_muon_roles_of_the_mtp_parameters():
    roles = parameter_roles(MoETransformer(config("moe")))
    assert roles["mtp.0.eh_proj.weight"] == "hidden_matrix"
    assert {roles[f"mtp.1.{n}.weight"] for n in ("enorm", "hnorm", "norm")} == {"norm"}
    assert roles["mtp.0.block.ffn.experts.w1_EFD"] == "expert_stack"
    assert roles["mtp.0.block.ffn.router.gate.weight"] == "router"
    assert roles["mtp.0.block.attention.wq.weight"] == "hidden_matrix"


@pytest.mark.parametrize("field, value, match", [
    ("mtp_layers", -1, r"mtp_layers=-1: must be an integer >= 0"),
    ("mtp_layers", 1.5, r"mtp_layers=1.5"),
    ("mtp_layers", True, r"mtp_layers=True"),
    ("mtp_loss_weight", -0.1, r"mtp_loss_weight=-0.1: must be a finite number >= 0"),
    ("mtp_loss_weight", math.inf, r"mtp_loss_weight=inf"),
    ("mtp_loss_weight", math.nan, r"mtp_loss_weight=nan"),
])
def test_bad_mtp_settings_name_the_field(field, value, match):
    with pytest.raises(ConfigError, match=match):
        MoEConfig(**{field: value})


def test_mtp_with_a_cache_or_too_short_an_input_is_refused():
    model = MoETransformer(config("dense"))
    with pytest.raises(ValueError, match="multi-token prediction runs in training only"):
        model(torch.zeros(1, 2, dtype=torch.long), mtp=True)


class Recorder(L.Callback):
    def __init__(self):
        self.metrics, self.counts = [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.metrics.append({k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("train/")})

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.counts.append(pl_module._pending_expert_counts.clone())


def test_fit_logs_mtp_loss_moves_the_mtp_router_bias_and_equals_itself_with_activation_offload(tmp_path):
    """Two fits of 2 steps: with ActivationOffload (every main block checkpointed) the weights are bitwise those of
    a plain fit; train/mtp_loss is logged, train/loss is the main loss, the MTP block's balancing bias moves."""
    from moe_lightning import TextDataModule
    from moe_lightning.training.callbacks import ActivationOffload
    import os

    runs = []
    for offload in (False, True):
        L.seed_everything(0)
        cfg = config("moe", document_masking=False, max_seq_len=32)
        module = MoELanguageModel(cfg, optimizer=partial(torch.optim.AdamW, lr=3e-3), loss_chunk_size=9,
                                  lr_scheduler=partial(WarmupCosineLR, warmup_steps=1))
        recorder = Recorder()
        callbacks = [recorder] + ([ActivationOffload(min_offload_bytes=0)] if offload else [])
        trainer = L.Trainer(max_steps=2, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                            num_sanity_val_steps=0, log_every_n_steps=1, callbacks=callbacks, default_root_dir=tmp_path)
        trainer.fit(module, TextDataModule(os.__file__, seq_len=32, batch_size=2, val_fraction=0.05))
        runs.append((module, recorder))
    (plain, rec), (offloaded, _) = runs
    for (name, p), q in zip(plain.named_parameters(), offloaded.parameters()):
        assert torch.equal(p, q), name
    assert all("train/mtp_loss" in m and m["train/mtp_loss"] > 0 for m in rec.metrics)
    assert rec.counts[0].shape == (len(plain.model.moe_layers()), 4) and rec.counts[0][-1].sum() == 2 * 30 * 2
    assert plain.model.mtp[1].block.ffn.router.expert_bias.abs().sum() > 0


def test_plan_counts_mtp_parameters_flops_and_memory():
    """Parameters exactly; FLOPs against torch's FLOP counter on a real training step; memory against
    saved-tensor hooks (attention as fused GPU kernels keep it, as for the blocks' own formula)."""
    from torch.utils.flop_counter import FlopCounterMode

    from moe_lightning.planner.flops import attention_flops_per_token, training_flops_per_token
    from moe_lightning.planner.plan import block_working_set_bytes, count_parameters, mtp_activation_bytes
    from tests.support.block_reference import fused_attention, saved_bytes

    plain, one = config("dense", mtp_layers=0), config("dense", mtp_layers=1)
    roles0, units0 = count_parameters(plain)
    roles1, units1 = count_parameters(one)
    d, V = one.dim, one.vocab_size
    block = next(u.numel for u in units0 if u.name == f"layers.{plain.n_layers - 1}")  # the last main block (dense)
    assert sum(roles1.values()) - sum(roles0.values()) == 2 * d * d + 3 * d + block
    assert [(u.name, u.numel) for u in units1 if u.name.startswith("mtp")] == [
        ("mtp.0.block", block), ("mtp.0", 2 * d * d + 3 * d)]  # the MTP block and its norms + eh_proj: FSDP units

    def step_matmul_flops(cfg):
        module = module_for(cfg)
        with FlopCounterMode(display=False) as counter:
            module._loss(batch()).backward()
        return counter.get_total_flops()  # matmuls only: CPU SDPA is not counted

    B, S = batch().shape[0], batch().shape[1] - 1
    linear = 2 * d * d + sum(p.numel() for p in MoETransformer(one).mtp[0].block.parameters() if p.ndim == 2)
    measured = step_matmul_flops(one) - step_matmul_flops(plain)
    assert measured == 6 * B * (S - 1) * (linear + V * d)  # depth 1 covers S - 1 positions
    formula = training_flops_per_token(one, S) - training_flops_per_token(plain, S)
    one_layer = attention_flops_per_token(one, S) - attention_flops_per_token(plain, S)
    assert one_layer == attention_flops_per_token(config("dense", n_layers=1, n_dense_layers=1, mtp_layers=0), S)
    assert formula - one_layer == 6 * (linear + V * d + 5 * d)  # + the five norms' gains, counted as the blocks' are

    moe_cfg = config("moe", mtp_layers=1, document_masking=False)
    module = MoETransformer(moe_cfg).mtp[0].to(torch.bfloat16)
    T = 64
    hidden, emb = (torch.randn(1, T, d, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    cos_sin = MoETransformer(moe_cfg).rotary.cos_sin(0, T)
    with fused_attention():
        kept = saved_bytes(lambda h, e: module(h, e, mask=None, cache=None, cos_sin=cos_sin), hidden, emb,
                           exclude=[*module.parameters(), *module.buffers(), hidden, emb])
    kept += 2 * d * T + 2 * d * T  # the output the loss keeps, and the embedding output the modules read
    assert mtp_activation_bytes(moe_cfg, T) == pytest.approx(kept, rel=0.05)
    assert mtp_activation_bytes(moe_cfg, T) > block_working_set_bytes(moe_cfg, T, moe=True)
    assert mtp_activation_bytes(plain, T) == 0


@pytest.mark.extended
def test_fsdp_with_expert_parallel_mtp_equals_one_process(tmp_path):
    """MoEFSDPStrategy (MTP block and its experts their own FSDP units, ep 2) on 2 gloo ranks against one process:
    3 steps of 2 accumulated micro-batches, chunked loss, clipping (observed equal to ~2e-7)."""
    import json

    from tests.support.distributed import REPO_ROOT, run_ranks

    run = REPO_ROOT / "tests" / "launchers" / "strategy_run.py"
    common = ("--accumulate", "2", "--max-steps", "3", "--clip", "1.0", "--config", '{"mtp_layers": 1}',
              "--loss-chunk", "7")
    run_ranks(run, 1, *common, "--strategy", "single", "--batch-size", "4", "--out", str(tmp_path / "one.json"))
    run_ranks(run, 2, *common, "--batch-size", "2", "--ep", "2", "--out", str(tmp_path / "two.json"))
    one, two = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("one", "two"))
    assert len(one["batches"]) == 6
    assert [r["loss"] for r in two["batches"]] == pytest.approx([r["loss"] for r in one["batches"]], rel=1e-5)
    for a, b in zip(two["grad_norms"], one["grad_norms"]):
        assert a == pytest.approx(b, rel=1e-5)


def test_chunked_sum_reduction_equals_cross_entropy_sum_and_is_zero_when_nothing_is_left():
    from moe_lightning.model.loss import chunked_cross_entropy

    g = torch.Generator().manual_seed(0)
    h, w = torch.randn(20, 8, generator=g, requires_grad=True), torch.randn(30, 8, generator=g)
    targets = torch.randint(0, 30, (20,), generator=g)
    targets[[2, 5]] = -100
    torch.testing.assert_close(chunked_cross_entropy(h, w, targets, 7, reduction="sum"),
                               F.cross_entropy(h @ w.T, targets, reduction="sum"), rtol=1e-6, atol=1e-5)
    nothing = chunked_cross_entropy(h, w, torch.full((20,), -100), 7, reduction="sum")
    nothing.backward()
    assert nothing.item() == 0 and h.grad.abs().max() == 0
    with pytest.raises(ValueError, match=r"reduction='none': use 'mean' or 'sum'"):
        chunked_cross_entropy(h, w, targets, 7, reduction="none")


def test_on_the_flex_path_every_depth_attends_at_the_main_length_through_one_block_mask(monkeypatch):
    """The CUDA path (FlexAttention; eager here, forward only: CPU FlexAttention has no backward): each depth's
    ``S - k`` positions are zero-padded to ``S`` and attend through the main forward's block mask, so the compiled
    kernel and the mask keep one static shape (was: a mask and a kernel shape per depth, which recompiled with
    dynamic shapes). Its outputs equal the dense CPU path's, which the float64 equations above check."""
    from moe_lightning.model import attention, transformer
    model = module_for(config("moe")).model
    tokens = batch()[:, :-1]
    with torch.no_grad():
        dense = model(tokens, mtp=True)
        lengths, masks = [], []
        kernel, build = attention.flex_attention, attention.create_block_mask
        monkeypatch.setattr(attention, "flex_attention",
                            lambda q, *args, **kwargs: lengths.append(q.shape[2]) or kernel(q, *args, **kwargs))
        monkeypatch.setattr(attention, "create_block_mask", lambda *args, **kwargs: masks.append(args[3:5]) or
                            build(*args, **kwargs))
        monkeypatch.setattr(transformer, "DocumentMask", partial(attention.DocumentMask, flex=True))
        flex = model(tokens, mtp=True)
    S = tokens.shape[1]
    assert lengths == [S] * (model.config.n_layers + model.config.mtp_layers) and masks == [(S, S)]
    assert [h.shape[1] for h in flex] == [S, S - 1, S - 2]
    for flex_h, dense_h in zip(flex, dense):
        torch.testing.assert_close(flex_h, dense_h, rtol=1e-5, atol=1e-5)  # two fp32 kernels' orders of sums


def test_padded_rows_never_reach_the_qk_clip_maxima(monkeypatch):
    """QK-clip's maxima on the flex path come from the kernel's per-row ``max_scores``; a zero-padded query row
    scores 0 against every key it sees, which would beat logits that are all negative. Only the real rows count.
    CPU FlexAttention has no ``max_scores``: a stand-in kernel returns them from the dense scores, padded rows
    included, as the CUDA kernel does."""
    from types import SimpleNamespace

    from torch.nn.attention.flex_attention import create_mask, flex_attention

    from moe_lightning.model import attention

    def kernel(q, k, v, block_mask, scale, enable_gqa, return_aux=None):
        out = flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa)
        B, H, L, _ = q.shape
        scores = q @ k.repeat_interleave(H // k.shape[1], 1).transpose(-1, -2) * scale
        visible = create_mask(block_mask.mask_mod, B, 1, L, L, device=q.device)
        return out, SimpleNamespace(max_scores=scores.masked_fill(~visible, float("-inf")).amax(-1))

    monkeypatch.setattr(attention, "flex_attention", kernel)
    tokens = batch()[:, :-1]
    doc_BS, n = attention.document_ids(tokens, EOD), tokens.shape[1] - 2
    g = torch.Generator().manual_seed(1)
    q = torch.rand(2, 4, n, 8, generator=g) + 0.5  # every logit negative: q > 0, k < 0
    k, v = -torch.rand(2, 2, n, 8, generator=g) - 0.5, torch.randn(2, 2, n, 8, generator=g)
    full = attention.DocumentMask(doc_BS, flex=True)
    out, max_logits = attention.flex_attend(q, k, v, full.block_mask, 0.5, return_max_logits=True, length=full.length)
    own = attention.DocumentMask(doc_BS[:, :n])
    expected = attention.exact_max_logits(q, k, own, 0.5)
    assert (expected < -1).all()
    torch.testing.assert_close(max_logits, expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out, attention.attend(q, k, v, own, 0.5), rtol=1e-5, atol=1e-5)


def test_padded_depths_meet_the_compiled_kernel_in_its_layout_and_pass_gradients_back(monkeypatch):
    """The main forward's q, k and v are transposed views (MLA's value a split view); padded copies with other
    strides would make the compiled kernel recompile once (dynamo guards on strides). A counting compile backend
    stands in for Inductor: the main call and two padded depths make one graph. Backward through the padding: a
    stand-in kernel (SDPA with the block mask's predicate, as CPU FlexAttention has no backward) gives each depth
    the gradients of attending over its own positions alone."""
    from torch.nn.attention.flex_attention import create_mask, flex_attention

    from moe_lightning.model import attention
    graphs = []
    monkeypatch.setattr(attention, "flex_attention", torch.compile(
        flex_attention, backend=lambda gm, example_inputs: graphs.append(gm) or gm.forward))
    B, S, H, N, V = 1, 256, 2, 16, 8
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, EOD, (B, S), generator=g)
    tokens[0, [40, 130, 200]] = EOD
    doc_BS = attention.document_ids(tokens, EOD)
    mask = attention.DocumentMask(doc_BS, flex=True)

    def model_layout(n):  # as MLA makes them: q a transposed view, v a split view of the up-projection
        kv_BTHX = torch.randn(B, n, H, N + V, generator=g)
        k_BTHN, v_BTHV = kv_BTHX.split([N, V], -1)
        return (torch.randn(B, n, H, N, generator=g).transpose(1, 2), k_BTHN.contiguous().transpose(1, 2),
                v_BTHV.transpose(1, 2))
    torch._dynamo.reset()
    with torch.no_grad():
        for n in (S, S - 1, S - 2):
            attention.flex_attend(*model_layout(n), mask.block_mask, 0.25, length=mask.length)
    assert len(graphs) == 1

    def stand_in(q, k, v, block_mask, scale, enable_gqa):
        visible = create_mask(block_mask.mask_mod, q.shape[0], 1, q.shape[2], k.shape[2], device=q.device)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=scale)
    monkeypatch.setattr(attention, "flex_attention", stand_in)
    n = S - 2
    q, k, v = (t.detach().requires_grad_() for t in model_layout(n))
    out = attention.flex_attend(q, k, v, mask.block_mask, 0.25, length=mask.length)
    weights = torch.randn(out.shape, generator=g)
    grads = torch.autograd.grad((out * weights).sum(), (q, k, v))
    alone = F.scaled_dot_product_attention(q, k, v, attn_mask=attention.dense_mask(doc_BS[:, :n], n), scale=0.25)
    torch.testing.assert_close(out, alone, rtol=1e-6, atol=1e-6)
    for padded, own in zip(grads, torch.autograd.grad((alone * weights).sum(), (q, k, v))):
        torch.testing.assert_close(padded, own, rtol=1e-5, atol=1e-6)
