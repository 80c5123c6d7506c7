"""Muon (FlexShard), QK-clip, the expert-load monitor and the logged balance under pipeline stages, on 2 gloo
processes (tests/launchers/pipeline_fit_run.py): configs/tiny-fsdp.yaml's model (blocks 0-1 on stage 0, 2-3 and
the head on stage 1) with balancing loss 0.01, 3 steps of the same 8 sequences, clipping at 0.5, against the same
fit without stages (FSDP over the 2 ranks, 4 sequences each); and the logged balance of one process's
micro-batches against a float64 recomputation.

Tolerance: rel 1e-6 on losses and gradient norms, as the AdamW fits of tests/parallel/test_pipeline.py: the same
fp32 terms summed in another order (Newton-Schulz in fp32 here: bf16 would round those 1e-7 differences into
1e-3 ones). Measured: losses equal to 1.6e-7 relative, gradient norms to 3e-8. A step that lost or doubled a
Muon update, or a layer clipped with another layer's maximum, moves the next loss by more than 1e-4."""

import json
from functools import partial

import lightning as L
import pytest
import torch
import yaml

from moe_lightning import MoEConfig, MoELanguageModel
from moe_lightning.optim import WarmupCosineLR
from moe_lightning.parallel.pipeline import stage_layout
from tests.support.distributed import LAUNCHERS, REPO_ROOT, run_nodes

TINY = yaml.safe_load((REPO_ROOT / "configs" / "tiny-fsdp.yaml").read_text())["model"]["init_args"]["config"]

STAGED = ("--pp", "2", "--microbatches", "2", "--batch", "8")
FLAT = ("--pp", "1", "--batch", "4")
COMMON = ("--clip", "0.5", "--optimizer", "muon", "--aux-loss-coef", "0.01", "--log-every", "1")


def _fit(folder, *args: str) -> tuple[list[float], list[list[dict]]]:
    """Per-step losses, and per rank the probe's rows (tests/launchers/stage_metrics_probe.py)."""
    folder.mkdir()
    run_nodes([str(LAUNCHERS / "pipeline_fit_run.py"), "--out", str(folder / "run.json"), "--record",
               str(folder / "probe"), *COMMON, *args], 1, 2, cwd=folder, timeout=900)
    losses = [row["loss"] for row in json.loads((folder / "run.json").read_text())["rows"]]
    return losses, [json.loads((folder / f"probe.rank{rank}.json").read_text()) for rank in (0, 1)]


def _logged(ranks: list[list[dict]], key: str) -> list[list[float]]:
    return [[row["logged"][key] for row in rows] for rows in ranks]


def _check_equal(staged: tuple, flat: tuple) -> None:
    """Losses, the gradient norm over every stage, and the whole model's balance logs on every rank."""
    (staged_losses, staged_ranks), (flat_losses, flat_ranks) = staged, flat
    assert len(staged_losses) == len(flat_losses) == 3
    assert staged_losses == pytest.approx(flat_losses, rel=1e-6)
    for rows in staged_ranks:
        assert [r["grad_norm"] for r in rows] == pytest.approx([r["grad_norm"] for r in flat_ranks[0]], rel=1e-6)
    for key in ("train/aux_loss", "train/expert_imbalance"):  # the whole model's, not the logging rank's stage
        want = _logged(flat_ranks, key)[0]
        assert _logged(staged_ranks, key) == [pytest.approx(want, rel=1e-6)] * 2, key


def test_muon_with_a_stage_holding_no_muon_matrix_and_two_mtp_depths_at_two_stages_equals_one_stage(tmp_path):
    """The main suite's fit at 2 stages against one stage (2 processes each, 3 steps of 8 sequences, clipping at 0.5
    deciding every step): Muon, two MTP depths (the last stage holds the embedding's copy, the MTP modules and the
    head: blocks [3, 1]) and the balancing loss. The last stage's block and MTP modules go to AdamW
    (``adamw_patterns``), so it holds no Muon matrix: the first stage plans its FlexShard exchanges agreeing over its
    own ranks only (``Muon.trainers_group``, the strategy's ``stage`` group); before, that check all-gathered over
    every rank, which the last stage never joins. Losses, gradient norms, the whole model's balancing loss and
    imbalance, ``train/mtp_loss`` and ``train/tokens_seen`` on every rank equal one stage's (1e-6: fp32 sums in
    another order; the tokens exactly: a pipeline is one data replica, its stages count its batch once)."""
    assert stage_layout(MoEConfig(**{**TINY, "mtp_layers": 2}), 2) == [3, 1]
    muon_free_last_stage = ("--adamw-patterns", "layers.3.*", "mtp.*", "--model-json", json.dumps({"mtp_layers": 2}))
    staged = _fit(tmp_path / "pp2", *STAGED, *muon_free_last_stage)
    flat = _fit(tmp_path / "pp1", *FLAT, *muon_free_last_stage)
    _check_equal(staged, flat)
    (_, staged_ranks), (_, flat_ranks) = staged, flat
    want = _logged(flat_ranks, "train/mtp_loss")[0]
    assert len(want) == 3 and _logged(staged_ranks, "train/mtp_loss") == [pytest.approx(want, rel=1e-6)] * 2
    tokens = [8 * 128 * step for step in (1, 2, 3)]  # 8 sequences of 128 tokens a step
    assert _logged(flat_ranks, "train/tokens_seen") == _logged(staged_ranks, "train/tokens_seen") == [tokens] * 2


@pytest.mark.slow
def test_muon_qk_clip_and_expert_load_at_two_stages_equal_one_stage(tmp_path):
    """Muon on every block's matrices, QK-clip at 0.23 (the heads' largest logits are 0.20-0.26 here, so some heads
    clip on every step: 5, 4 and 1 measured) and the expert-load monitor every step, a heatmap at step 2. Every
    rank clips the same heads by the same factors as one stage and sees every layer's maximum; the monitor reports
    every MoE block of the model (1 on stage 0; 2 and 3 on stage 1) with one stage's values, and rank 0 draws the
    heatmap of all of them."""
    extra = ("--qk-clip", "0.23", "--expert-load")
    staged = _fit(tmp_path / "pp2", *STAGED, *extra)
    flat = _fit(tmp_path / "pp1", *FLAT, *extra)
    _check_equal(staged, flat)
    (_, staged_ranks), (_, flat_ranks) = staged, flat
    want = flat_ranks[0]
    assert sum(row["logged"]["attention/clipped_heads"] for row in want) > 0  # the threshold bites
    for rows in staged_ranks:
        for got, ref in zip(rows, want):
            assert len(got["max_logits"]) == 4  # every block's attention, on both stages' ranks
            assert got["max_logits"] == [pytest.approx(r, rel=1e-5) for r in ref["max_logits"]]
            assert [[g < 1 for g in h] for h in got["gamma"]] == [[g < 1 for g in h] for h in ref["gamma"]]
            assert got["gamma"] == [pytest.approx(r, rel=1e-5) for r in ref["gamma"]]
            assert got["logged"]["attention/clipped_heads"] == ref["logged"]["attention/clipped_heads"]
            layers = sorted({key.split("/")[1] for key in got["expert_load"] if key.count("/") == 2})
            assert layers == ["layer1", "layer2", "layer3"]
            assert got["expert_load"] == pytest.approx(ref["expert_load"], rel=1e-6)
    assert staged_ranks[0][1]["heatmap"].endswith("step_0000002.png")


class _MicroBatches(L.Callback):
    """Each micro-batch's counts and summed balancing loss as its forward left them, and what the step logged."""

    def __init__(self):
        self.counts, self.aux, self.logged = [], [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        layers = pl_module.model.moe_layers()
        self.counts.append(torch.stack([m.tokens_per_expert for m in layers]).double())
        self.aux.append(sum(m.aux_loss.double() for m in layers))
        if batch_idx % trainer.accumulate_grad_batches == trainer.accumulate_grad_batches - 1:
            self.logged.append({k: float(trainer.callback_metrics[k])
                                for k in ("train/aux_loss", "train/expert_imbalance")})


def test_the_logged_balance_is_the_whole_steps_over_its_micro_batches():
    """One process, 2 micro-batches a step (``accumulate_grad_batches``), O(1) weights: ``train/expert_imbalance``
    is each layer's busiest expert over the mean of the step's summed counts, averaged over the layers, and
    ``train/aux_loss`` the mean over the micro-batches of the losses summed over the layers (float64 reference;
    fp32 means of 2 values: rel 1e-6). Before, both were the last micro-batch's (as a rank was its stage's)."""
    torch.manual_seed(0)
    config = MoEConfig(vocab_size=64, dim=32, n_layers=3, n_heads=4, n_kv_heads=2, max_seq_len=16, ffn_hidden=64,
                       n_dense_layers=1, num_experts=4, top_k=2, expert_hidden=32, init_std=0.3, aux_loss_coef=0.01,
                       z_loss_coef=0.001)
    model = MoELanguageModel(config, optimizer=partial(torch.optim.AdamW, lr=3e-3),
                             lr_scheduler=partial(WarmupCosineLR, warmup_steps=1))
    data = torch.randint(0, config.vocab_size, (16, 17))
    probe = _MicroBatches()
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, max_steps=2, log_every_n_steps=1,
                        accumulate_grad_batches=2, callbacks=[probe])
    trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=4))
    assert len(probe.logged) == 2
    for step, logged in enumerate(probe.logged):
        counts_LE = probe.counts[2 * step] + probe.counts[2 * step + 1]
        imbalance = (counts_LE.max(-1).values / counts_LE.mean(-1)).mean()
        aux = (probe.aux[2 * step] + probe.aux[2 * step + 1]) / 2
        assert logged["train/expert_imbalance"] == pytest.approx(imbalance.item(), rel=1e-6)
        assert logged["train/aux_loss"] == pytest.approx(aux.item(), rel=1e-6)
        assert logged["train/aux_loss"] != pytest.approx(probe.aux[2 * step + 1].item(), rel=1e-4)  # not the last's


@pytest.mark.extended
def test_off_the_log_grid_every_rank_holds_the_last_whole_model_balance(tmp_path):
    """P=2, logs written every 2nd step (``--log-every 2``), 4 steps: what ``callback_metrics`` holds of
    ``train/aux_loss`` and ``train/expert_imbalance`` (read by TrainingCurves or a ``ModelCheckpoint`` monitor) is
    the whole model's on every step: absent before the first logged step, then the last logged value, the same on
    both stages' ranks. Before, off the grid each rank held its own stage's layers' values (stage 0's aux about a
    third of the model's here, so the ranks differed)."""
    folder = tmp_path / "pp2"
    folder.mkdir()
    run_nodes([str(LAUNCHERS / "pipeline_fit_run.py"), "--out", str(folder / "run.json"), "--record",
               str(folder / "probe"), *STAGED, "--aux-loss-coef", "0.01", "--log-every", "2", "--steps", "4"],
              1, 2, cwd=folder, timeout=900)
    ranks = [json.loads((folder / f"probe.rank{rank}.json").read_text()) for rank in (0, 1)]
    keys = ("train/aux_loss", "train/expert_imbalance")
    held = [[{k: row["logged"].get(k) for k in keys} for row in rows] for rows in ranks]
    assert [row["step"] for row in ranks[0]] == [1, 2, 3, 4]
    assert held[0] == held[1]  # exactly: one all-reduced value on every rank
    assert held[0][0] == dict.fromkeys(keys)  # step 1 is off the grid: nothing whole yet
    assert all(value is not None for value in held[0][1].values())
    assert held[0][2] == held[0][1]  # step 3: still step 2's
    assert held[0][3] != held[0][1]  # step 4 is logged again: a new value
