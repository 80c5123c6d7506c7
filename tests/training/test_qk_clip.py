"""QK-clip: the recorded per-head max logits against a float64 recomputation, the rescaling against a float64
reference, a step's factors and effect on the same batch against float64 maxima, ActivationOffload, 1 process
against 2 (every rank's rows against a float64 clip), and the argument errors."""

import copy
import csv
import json
import math
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch

from moe_lightning import MoEConfig, MoELanguageModel
from moe_lightning.training.callbacks import ActivationOffload, QKClip
from moe_lightning.training.callbacks.qk_clip import attention_modules, clip_qk_
from moe_lightning.model.attention import DocumentMask, GroupedQueryAttention, attend, document_ids
from moe_lightning.model.kv_cache import KVCache
from moe_lightning.model.mla import MultiHeadLatentAttention
from moe_lightning.model.rotary import apply_rotary
from moe_lightning.optim import Muon
from tests.support.distributed import LAUNCHERS, run_ranks

BASE = dict(vocab_size=64, dim=32, n_layers=2, max_seq_len=16, ffn_hidden=48, n_dense_layers=1, num_experts=4,
            top_k=2, expert_hidden=16)
GQA = dict(BASE, n_heads=4, n_kv_heads=2)
MHA = dict(BASE, n_heads=4, n_kv_heads=4)
MLA = dict(BASE, n_heads=3, attention="mla", q_lora_rank=12, kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4,
           v_head_dim=6)
DOCS = dict(document_masking=True, eod_token_id=0)
BATCH, SEQ = 4, 16


def float64_max_logits(attention, x_BSD: torch.Tensor, doc_BS: torch.Tensor | None) -> torch.Tensor:
    """Per head, the largest ``scale · q·k`` over visible pairs, recomputed in float64 from the weights."""
    B, S, _ = x_BSD.shape
    x = x_BSD.double()
    cos, sin = (t.double() for t in attention.rotary.cos_sin(0, S))
    if isinstance(attention, MultiHeadLatentAttention):
        H, N, R = attention.n_heads, attention.nope_dim, attention.rope_dim
        q_a = x @ attention.wq_a.weight.double().T
        q_a = q_a * torch.rsqrt(q_a.pow(2).mean(-1, keepdim=True) + attention.q_norm.eps) * attention.q_norm.weight.double()
        q = (q_a @ attention.wq_b.weight.double().T).view(B, S, H, N + R)
        latent, k_rope = (x @ attention.wkv_a.weight.double().T).split([attention.kv_lora_rank, R], -1)
        latent = latent * torch.rsqrt(latent.pow(2).mean(-1, keepdim=True) + attention.kv_norm.eps) \
            * attention.kv_norm.weight.double()
        k_nope = (latent @ attention.wkv_b.weight.double().T).view(B, S, H, -1)[..., :N]
        q = torch.cat([q[..., :N], apply_rotary(q[..., N:], cos, sin)], -1)
        k = torch.cat([k_nope, apply_rotary(k_rope[:, :, None], cos, sin).expand(-1, -1, H, -1)], -1)
        scale = attention.scale
    else:
        H, G, K = attention.n_heads, attention.n_kv_heads, attention.head_dim
        q = apply_rotary((x @ attention.wq.weight.double().T).view(B, S, H, K), cos, sin)
        k = apply_rotary((x @ attention.wk.weight.double().T).view(B, S, G, K), cos, sin).repeat_interleave(H // G, 2)
        scale = K ** -0.5
    scores_BHST = torch.einsum("bshk,bthk->bhst", q, k) * scale
    visible_BST = torch.ones(S, S, dtype=torch.bool).tril().expand(B, S, S)
    if doc_BS is not None:
        visible_BST = visible_BST & (doc_BS[:, :, None] == doc_BS[:, None, :])
    return scores_BHST.masked_fill(~visible_BST[:, None], -math.inf).amax(dim=(0, 2, 3))


def build(config: dict, std: float = 0.5):
    """One attention module with O(1) logits (std 0.5 on O(1) inputs), recording."""
    cfg = MoEConfig(**config)
    attention = MultiHeadLatentAttention(cfg) if cfg.attention == "mla" else GroupedQueryAttention(cfg)
    attention.init_weights(std, std)
    attention.record_max_logits = True
    return attention


@pytest.mark.parametrize("config", [GQA, MLA], ids=["gqa", "mla"])
@pytest.mark.parametrize("docs", ["none", "dense", "flex"])
def test_recorded_max_logits_equal_a_float64_recomputation(config, docs):
    torch.manual_seed(0)
    attention = build(config)
    micro_batches = [torch.randn(2, 12, 32) for _ in range(2)]
    tokens = [torch.randint(0, 4, (2, 12)) for _ in range(2)]  # eod 0: several documents per row
    expected = []
    for x, tokens_BS in zip(micro_batches, tokens):
        doc_BS = None if docs == "none" else document_ids(tokens_BS, 0)
        mask = None if doc_BS is None else DocumentMask(doc_BS, flex=docs == "flex")
        with torch.no_grad():  # FlexAttention has no CPU backward; recording needs train mode, not gradients
            attention(x, mask=mask)
        expected.append(float64_max_logits(attention, x, doc_BS))
    assert attention.max_logits.dtype == torch.float32 and attention.max_logits.shape == (attention.n_heads,)
    # fp32 scores of O(10) from fp32 projections: ~1e-6 relative
    torch.testing.assert_close(attention.max_logits.double(), torch.maximum(*expected), rtol=2e-6, atol=1e-6)
    assert not torch.equal(expected[0], expected[1])  # the running maximum really folded two batches


def test_nothing_is_recorded_unless_asked_in_a_training_forward():
    torch.manual_seed(0)
    attention = build(MLA)
    x = torch.randn(2, 8, 32)
    attention.record_max_logits = False
    attention(x)
    assert attention.max_logits is None  # off: training without QKClip computes nothing extra
    attention.record_max_logits = True
    attention.eval()
    attention(x)
    assert attention.max_logits is None  # validation and generation do not record
    attention.train()
    attention(x[:, :4], cache=KVCache(1, 8).layers[0])
    assert attention.max_logits is None  # nor does a cached (decoding) forward
    attention(x)
    assert attention.max_logits is not None


def test_attend_refuses_max_logits_after_cached_keys():
    q, kv = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 5, 8)
    with pytest.raises(ValueError, match="S == T"):
        attend(q, kv, kv, None, return_max_logits=True)


def float64_clip(attention, max_H: torch.Tensor, threshold: float, alpha: float) -> dict[str, torch.Tensor]:
    """The K2 rescaling, written head by head in float64 from the weights before it."""
    gamma = [threshold / m if m > threshold else 1.0 for m in max_H.double().tolist()]
    out = {}
    if isinstance(attention, MultiHeadLatentAttention):
        N, R, V = attention.nope_dim, attention.rope_dim, attention.v_dim
        wq = (attention.wq_b if attention.q_lora_rank else attention.wq).weight.double().clone()
        wkv = attention.wkv_b.weight.double().clone()
        for h, g in enumerate(gamma):
            wq[h * (N + R):h * (N + R) + N] *= g ** alpha
            wq[h * (N + R) + N:(h + 1) * (N + R)] *= g
            wkv[h * (N + V):h * (N + V) + N] *= g ** (1 - alpha)
        out["q"], out["k"] = wq, wkv
    else:
        K, per_group = attention.head_dim, attention.n_heads // attention.n_kv_heads
        wq, wk = attention.wq.weight.double().clone(), attention.wk.weight.double().clone()
        for h, g in enumerate(gamma):
            wq[h * K:(h + 1) * K] *= g ** alpha
        for kv in range(attention.n_kv_heads):
            wk[kv * K:(kv + 1) * K] *= min(gamma[kv * per_group:(kv + 1) * per_group]) ** (1 - alpha)
        out["q"], out["k"] = wq, wk
    return out


def qk_weights(attention) -> dict[str, torch.Tensor]:
    if isinstance(attention, MultiHeadLatentAttention):
        return {"q": (attention.wq_b if attention.q_lora_rank else attention.wq).weight, "k": attention.wkv_b.weight}
    return {"q": attention.wq.weight, "k": attention.wk.weight}


@pytest.mark.parametrize("config", [GQA, MHA, MLA, dict(MLA, q_lora_rank=0)], ids=["gqa", "mha", "mla", "mla-no-q-lora"])
@pytest.mark.parametrize("alpha", [0.5, 0.25])
def test_rescaling_equals_a_float64_reference(config, alpha):
    torch.manual_seed(0)
    attention = build(config)
    H = attention.n_heads
    max_H = torch.tensor([5.0, 1.5, 3.0, 2.0][:H])  # threshold 3: head 0 above, head 2 exactly at, 1 and 3 below
    before = {name: w.detach().clone() for name, w in qk_weights(attention).items()}
    expected = float64_clip(attention, max_H, 3.0, alpha)
    gamma_LH = clip_qk_([attention], max_H[None], 3.0, alpha)
    assert gamma_LH.tolist() == [[0.6000000238418579] + [1.0] * (H - 1)]  # fp32 3 / 5; exactly 1 elsewhere
    for name, weight in qk_weights(attention).items():
        torch.testing.assert_close(weight.double(), expected[name], rtol=2e-7, atol=0)  # one fp32 rounding
        unchanged_rows = (expected[name] == before[name].double()).all(-1)
        assert torch.equal(weight[unchanged_rows], before[name][unchanged_rows])  # bitwise untouched
        assert unchanged_rows.any() and not unchanged_rows.all()


@pytest.mark.parametrize("config", [GQA, MLA], ids=["gqa", "mla"])
def test_rescaled_head_logits_shrink_by_gamma_and_the_shared_rotary_key_stays(config):
    """On the same input, every logit of a clipped head is multiplied by gamma (MLA: rotary and non-rotary parts
    alike); unclipped heads of MLA keep theirs bitwise; the rotary key projection is never touched."""
    torch.manual_seed(0)
    attention = build(config)
    x = torch.randn(2, 10, 32)
    attention(x)
    before = attention.max_logits.clone()
    threshold = float(before.median())
    rotary_key = attention.wkv_a.weight.clone() if isinstance(attention, MultiHeadLatentAttention) else None
    gamma_H = clip_qk_([attention], before[None], threshold, 0.5)[0]
    attention.max_logits = None
    attention(x)
    after = attention.max_logits
    clipped = before > threshold
    assert clipped.any() and not clipped.all()
    torch.testing.assert_close(after[clipped], torch.full_like(after[clipped], threshold), rtol=1e-4, atol=0)
    if rotary_key is not None:
        assert torch.equal(attention.wkv_a.weight, rotary_key)
        assert torch.equal(after[~clipped], before[~clipped])
    else:  # GQA: an unclipped head sharing a key head with a clipped one shrinks by min(gamma)^(1 - alpha)
        group_gamma = gamma_H.view(attention.n_kv_heads, -1).amin(1).repeat_interleave(2)
        torch.testing.assert_close(after[~clipped], before[~clipped] * group_gamma[~clipped].sqrt(), rtol=1e-5, atol=0)


def test_qk_norm_full_scales_the_norm_weights_and_bounds_the_logits():
    torch.manual_seed(0)
    attention = build(dict(GQA, qk_norm="full"))
    with torch.no_grad():
        attention.q_norm.weight.normal_(2.0, 0.5)  # O(1) logits after the norm
        attention.k_norm.weight.normal_(2.0, 0.5)
    x = torch.randn(2, 10, 32)
    attention(x)
    before = attention.max_logits.clone()
    threshold = float(before.min()) * 0.9
    wq = attention.wq.weight.clone()
    clip_qk_([attention], before[None], threshold, 0.5)
    assert torch.equal(attention.wq.weight, wq)  # the projection's scale is normalised away: not used
    attention.max_logits = None
    attention(x)
    assert (attention.max_logits <= threshold * (1 + 1e-4)).all()


def built(config: dict, seed: int = 0) -> MoELanguageModel:
    """A module whose model is already built (``configure_model`` is idempotent: fit keeps it)."""
    torch.manual_seed(seed)
    model = MoELanguageModel(MoEConfig(**config))
    model.configure_model()
    return model


def trainer_for(tmp_path, callbacks, steps: int = 1, accumulate: int = 1) -> L.Trainer:
    return L.Trainer(accelerator="cpu", devices=1, max_steps=steps, accumulate_grad_batches=accumulate,
                     callbacks=callbacks, default_root_dir=tmp_path, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1,
                     logger=L.pytorch.loggers.CSVLogger(tmp_path), limit_val_batches=0, num_sanity_val_steps=0)


def batches(count: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 64, (BATCH * count, SEQ + 1), generator=torch.Generator().manual_seed(seed))


def fit(tmp_path, config: dict, callbacks, optimizer, steps: int = 1, accumulate: int = 1):
    model = built(config)
    model.optimizer_factory = optimizer
    trainer = trainer_for(tmp_path, callbacks, steps, accumulate)
    trainer.fit(model, torch.utils.data.DataLoader(batches(steps * accumulate), batch_size=BATCH))
    return trainer, model


@pytest.mark.parametrize("config", [dict(MHA, **DOCS), dict(MLA, **DOCS)], ids=["mha", "mla"])
def test_after_a_step_every_head_is_at_most_the_threshold_on_the_same_batch(tmp_path, config):
    """lr 0: the step leaves the weights as the forward saw them, so the recorded maxima are those of the current
    weights. Each layer's own input from that forward is replayed: clipped heads land on the threshold (to 1e-4),
    the others keep their maxima and their weights bit for bit."""
    config = dict(config, init_std=0.3)  # O(1) embeddings and projections: logits of a few units
    probe = built(config)
    for attention in attention_modules(probe):
        attention.record_max_logits = True
    probe.model(batches(1)[:, :-1])
    maxima = torch.cat([a.max_logits for a in attention_modules(probe)])
    threshold = float(maxima.median())  # about half of the heads clipped

    inputs, weights, copies = {}, {}, {}

    class Capture(L.Callback):
        def on_fit_start(self, trainer, pl_module):
            for i, attention in enumerate(attention_modules(pl_module)):
                copies[i] = copy.deepcopy(attention)  # the weights the step's forward sees
                attention.register_forward_pre_hook(partial(self.keep_input, i), with_kwargs=True)
                weights[i] = {n: w.detach().clone() for n, w in qk_weights(attention).items()}

        @staticmethod
        def keep_input(i, module, args, kwargs) -> None:
            inputs.setdefault(i, (args[0].detach().clone(), kwargs.get("mask")))

    qk_clip = QKClip(threshold=threshold)
    trainer, model = fit(tmp_path, config, [Capture(), qk_clip], partial(torch.optim.SGD, lr=0.0))
    recorded = qk_clip.last_max_logits
    doc_BS = document_ids(batches(1)[:, :-1], 0)
    S_LH = torch.stack([float64_max_logits(copies[i], inputs[i][0], doc_BS) for i in sorted(copies)])
    torch.testing.assert_close(recorded.double(), S_LH, rtol=2e-6, atol=1e-6)  # as in the recording test above
    torch.testing.assert_close(qk_clip.last_gamma.double(), torch.where(S_LH > threshold, threshold / S_LH, 1.0),
                               rtol=2e-6, atol=0)  # gamma = tau / S_h
    for i, attention in enumerate(attention_modules(model)):
        attention.train()
        attention.record_max_logits, attention.max_logits = True, None
        x, mask = inputs[i]
        with torch.no_grad():
            attention(x, mask=mask)
        after, clipped = attention.max_logits, recorded[i] > threshold
        assert (after <= threshold * (1 + 1e-4)).all()
        torch.testing.assert_close(after[clipped], torch.full_like(after[clipped], threshold), rtol=1e-4, atol=0)
        assert torch.equal(after[~clipped], recorded[i][~clipped])
        for name, weight in qk_weights(attention).items():
            rows_per_head = weight.shape[0] // attention.n_heads
            untouched = (~clipped).repeat_interleave(rows_per_head)
            assert torch.equal(weight[untouched], weights[i][name][untouched])
            assert not torch.equal(weight[~untouched], weights[i][name][~untouched]) or not clipped.any()
    rows = list(csv.DictReader(open(Path(trainer.logger.log_dir) / "metrics.csv")))
    logged = {k: float(r[k]) for r in rows for k in ("attention/max_logit", "attention/clipped_heads") if r.get(k)}
    assert logged == pytest.approx({"attention/max_logit": float(maxima.max()),
                                    "attention/clipped_heads": float((maxima > threshold).sum())})


def test_activation_offload_and_accumulation_give_the_same_clipped_weights(tmp_path):
    """Recomputed blocks record again (the maximum is idempotent): Muon at a high learning rate with two
    micro-batches per step ends bit-identical with and without ActivationOffload."""
    config = dict(MLA, **DOCS, init_std=0.3)
    runs = []
    for callbacks in ([QKClip(threshold=2.0)], [QKClip(threshold=2.0), ActivationOffload(min_offload_bytes=0)]):
        _, model = fit(tmp_path, config, callbacks, partial(Muon, lr=0.05), steps=2, accumulate=2)
        runs.append((callbacks[0], {n: p.detach().clone() for n, p in model.named_parameters()}))
    (plain, plain_weights), (offloaded, offloaded_weights) = runs
    assert (plain.last_gamma < 1).any()  # heads were clipped on the last step
    assert torch.equal(plain.last_max_logits, offloaded.last_max_logits)
    for name, weight in plain_weights.items():
        assert torch.equal(weight, offloaded_weights[name]), name


@pytest.mark.extended
def test_one_process_equals_two_under_moe_fsdp_strategy(tmp_path):
    """Muon at a high learning rate, 4 steps of 2 micro-batches, MLA with odd row counts (uneven shards),
    document masking; the two-process run adds expert parallelism and ActivationOffload."""
    script = LAUNCHERS / "qk_clip_run.py"
    run_ranks(script, 1, "--out", str(tmp_path / "single.json"))
    run_ranks(script, 2, "--ep", "2", "--offload", "--out", str(tmp_path / "two.json"))
    single, two = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("single", "two"))
    # The launcher's last clip (fixed maxima) against its float64 recomputation, rank by rank: scaled rows to a few
    # fp32 roundings (gamma, its square root, the product: each <= 2^-24 relative), the others bit for bit.
    fixed_LH = torch.tensor([[8.0, 3.0, 5.0], [2.0, 6.0, 4.0], [4.5, 1.0, 9.0]], dtype=torch.float64)
    for run, world in ((single, 1), (two, 2)):
        torch.testing.assert_close(torch.tensor(run["clip_gammas"], dtype=torch.float64),
                                   torch.where(fixed_LH > 4.0, 4.0 / fixed_LH, 1.0), rtol=1e-7, atol=0)
        assert len(run["ranks"]) == world
        for rank in run["ranks"]:
            assert rank["max_rel_diff"] < 3e-7 and rank["unscaled_diff"] == 0.0, rank  # measured: 9e-8
        full_rows = {name: len(weight) for name, weight in run["weights"].items()}
        assert {name: sum(r["rows"][name] for r in run["ranks"]) for name in full_rows} == full_rows
    assert all(0 < rows < len(two["weights"][name]) for rank in two["ranks"] for name, rows in rank["rows"].items())
    assert len(single["max_logits"]) == len(two["max_logits"]) == 4
    clipped_somewhere = False
    for step_single, step_two, gamma_single, gamma_two in zip(single["max_logits"], two["max_logits"],
                                                              single["gammas"], two["gammas"]):
        a, b = torch.tensor(step_single), torch.tensor(step_two)
        for maxima, gammas in ((a, gamma_single), (b, gamma_two)):  # gamma = tau / S_h, recomputed in float64
            S = maxima.double()
            torch.testing.assert_close(torch.tensor(gammas, dtype=torch.float64),
                                       torch.where(S > 4.0, 4.0 / S, 1.0), rtol=1e-7, atol=0)
        # Muon's Newton-Schulz amplifies the ranks' different reduction order (~1e-7) to ~1e-5 over 4 steps
        torch.testing.assert_close(b, a, rtol=1e-4, atol=0)
        clear = (a - 4.0).abs() > 4e-3  # heads not within 1e-3 of the threshold: the same decision
        assert torch.equal((torch.tensor(gamma_single) < 1)[clear], (torch.tensor(gamma_two) < 1)[clear])
        clipped_somewhere |= bool((torch.tensor(gamma_single) < 1).any())
    assert clipped_somewhere
    for name, weight in single["weights"].items():
        torch.testing.assert_close(torch.tensor(two["weights"][name]), torch.tensor(weight), rtol=0, atol=2e-4)


@pytest.mark.parametrize("kwargs, message", [
    (dict(threshold=0), "threshold=0"), (dict(threshold=-5.0), "threshold=-5.0"),
    (dict(threshold=math.inf), "threshold=inf"), (dict(threshold="100"), "threshold='100'"),
    (dict(threshold=True), "threshold=True"), (dict(alpha=1.5), "alpha=1.5"), (dict(alpha=-0.1), "alpha=-0.1"),
])
def test_bad_arguments_name_the_argument(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        QKClip(**kwargs)


@pytest.mark.parametrize("overrides, message", [(dict(qk_norm="head"), "qk_norm='head'"),
                                                (dict(clip_qkv=8.0), "clip_qkv=8.0")])
def test_attention_it_cannot_bound_is_refused_before_the_model_is_built(tmp_path, overrides, message):
    started = []

    class Watch(L.Callback):
        def on_fit_start(self, trainer, pl_module):
            started.append(True)

    model = MoELanguageModel(MoEConfig(**GQA, **overrides))
    with pytest.raises(ValueError, match=message):
        trainer_for(tmp_path, [QKClip(), Watch()]).fit(model, torch.utils.data.DataLoader(batches(1), batch_size=BATCH))
    assert not started and model.model is None


@pytest.mark.extended  # ~40 s of tracing on 2 cores
def test_compiled_blocks_record_what_eager_records():
    """Per-block ``torch.compile`` with ``fullgraph=True`` (``aot_eager``: Dynamo and AOTAutograd, no Inductor
    code generation) captures the recording as part of the graph, and two forwards fold into a running maximum."""
    from moe_lightning.model import MoETransformer
    from moe_lightning.parallel.compile import compile_blocks
    torch.manual_seed(0)
    config = MoEConfig(**MLA, **DOCS, init_std=0.3)
    eager, compiled = MoETransformer(config), MoETransformer(config)
    compiled.load_state_dict(eager.state_dict())
    compile_blocks(compiled.layers, backend="aot_eager")
    tokens = [torch.randint(0, 64, (2, 16)) for _ in range(2)]
    for model in (eager, compiled):
        for attention in attention_modules(model):
            attention.record_max_logits = True
        for tokens_BS in tokens:
            model(tokens_BS).sum().backward()
    for ours, reference in zip(attention_modules(compiled), attention_modules(eager)):
        torch.testing.assert_close(ours.max_logits, reference.max_logits, rtol=1e-6, atol=1e-6)


def test_a_model_without_recording_attention_is_refused(tmp_path):
    class NoAttention(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(4, 4)

        def training_step(self, batch, batch_idx):
            return self.linear(batch).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    with pytest.raises(ValueError, match="QKClip: the model has no attention module"):
        trainer_for(tmp_path, [QKClip()]).fit(NoAttention(), torch.utils.data.DataLoader(torch.randn(4, 4)))


class _StageWithoutAttention(torch.nn.Module):
    """What QKClip reads of a LightningModule, as on the rank of a pipeline stage holding only an attention-free
    block: the model's config (MLA, 3 heads), no attention module, and what it logs."""

    def __init__(self):
        super().__init__()
        self.config, self.device, self.logged = MoEConfig(**MLA), torch.device("cpu"), {}
        self.mlp = torch.nn.Linear(4, 4)

    def log(self, name, value):
        self.logged[name] = value


@pytest.mark.parametrize("model_layers", [2, 0])
def test_a_rank_without_attention_gathers_first_and_raises_only_for_the_whole_model(monkeypatch, model_layers):
    """A rank holding no attention module joins the fit-start gather (``model_rows``) before anything raises, and
    steps with a table of the whole model's layers and the config's heads (its rows ``-inf`` here; the other
    stages' all-reduce fills them). Only a model with no attention on any rank is refused, on every rank alike.
    Before, this rank raised before the gather (the others would hang in it) and took the heads from its own first
    attention module."""
    gathered = []
    monkeypatch.setattr("moe_lightning.training.callbacks.qk_clip.model_rows",
                        lambda names: (gathered.append(names), ([], model_layers))[1])
    qk_clip, module = QKClip(threshold=1.0), _StageWithoutAttention()
    if not model_layers:
        with pytest.raises(ValueError, match="QKClip: the model has no attention module"):
            qk_clip.on_fit_start(None, module)
        assert gathered == [[]]
        return
    qk_clip.on_fit_start(None, module)
    assert gathered == [[]]
    trainer = SimpleNamespace(  # only its loop's accumulation test is read
        fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace(_should_accumulate=lambda: False)))
    qk_clip.on_train_batch_end(trainer, module, None, None, 0)
    assert qk_clip.last_max_logits.shape == (2, MLA["n_heads"]) and qk_clip.last_max_logits.isneginf().all()
    assert torch.equal(qk_clip.last_gamma, torch.ones(2, MLA["n_heads"]))
    assert module.logged["attention/clipped_heads"].item() == 0


def test_a_clipping_step_reads_nothing_back_to_the_host():
    """Recording, the all-reduce-free single-rank combine, the rescaling and the logging stay on the device: with
    QKClip on (heads clipped every step) a step reads back only what it reads without it."""
    from collections import Counter

    from moe_lightning.training.strategy import MoEFSDPStrategy
    from tests.training.test_host_syncs import HostReads
    probe, qk_clip = HostReads(), QKClip(threshold=0.5)
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=MoEFSDPStrategy(), max_steps=4, log_every_n_steps=2,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, callbacks=[qk_clip, probe])
    try:
        trainer.fit(MoELanguageModel(MoEConfig(**MLA, **DOCS, init_std=0.3)),
                    torch.utils.data.DataLoader(batches(2)[:8], batch_size=2))
    finally:
        probe.restore()
    assert (qk_clip.last_gamma < 1).any()
    assert len(probe.steps) == 4
    for step, reads in enumerate(probe.steps):
        reads = Counter({site: n for site, n in reads.items() if not site.startswith("item optimizer.py:_get_value")})
        if step == 0:  # AdamW creates its host step counters once, as test_host_syncs allows
            reads.pop("tensor(number) adam.py:_init_group", None)
        if step < 2:  # Lightning creates its result objects when a key is first logged
            reads.pop("tensor(number) result.py:__init__", None)
        if (step + 1) % 2 == 0:  # logs written: the guard's one read and the logged values
            reads.pop("tolist nonfinite.py:_max_over_ranks", None)
            reads.pop("item apply_func.py:to_item", None)
            reads.pop("tensor(number) module.py:__to_tensor", None)  # train/tokens_seen, only when written
        assert not reads, f"step {step} reads back {dict(reads)}"
