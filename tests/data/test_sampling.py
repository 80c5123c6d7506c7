"""Weighted mixtures: the realized share, determinism, repeats, per-source validation; exact resume with mixtures,
shard folders and worker processes, reported to Lightning as resumable."""

import logging
import os
import subprocess
import sys
import warnings
from functools import partial

import lightning as L
import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from moe_lightning import MoEConfig, MoELanguageModel
from moe_lightning.data import MixtureSampler, MixtureSequences, TextDataModule, tokenize_to_folder, write_token_file
from tests.support.distributed import LAUNCHERS, clean_env

WEIGHTS, LENGTHS = [3.0, 1.0, 0.5], [5000, 300, 40]


def sampler(num_replicas=1, rank=0, seed=0, weights=WEIGHTS, lengths=LENGTHS):
    data = MixtureSequences([list(range(n)) for n in lengths])
    return MixtureSampler(data, weights, [f"s{k}" for k in range(len(lengths))], num_replicas, rank, seed)


def source_of(s: MixtureSampler, flat: np.ndarray) -> np.ndarray:
    return np.searchsorted(np.array(s.dataset.offsets), flat, side="right") - 1


def test_realized_share_is_within_1_5_points_over_any_10000_consecutive_sequences():
    s = sampler()
    order = []
    for epoch in range(4):  # consecutive epochs: the mixture continues across them
        s.set_epoch(epoch)
        order += list(s)
    sources = source_of(s, np.array(order))
    target = np.array(WEIGHTS) / sum(WEIGHTS)
    worst = 0.0
    for start in range(0, len(sources) - 10_000, 613):
        share = np.bincount(sources[start:start + 10_000], minlength=3) / 10_000
        worst = max(worst, np.abs(share - target).max())
    assert worst < 0.015
    assert worst < 0.001  # the interleave holds it far tighter than the promise (iid sampling would not)


def test_order_is_seeded_and_the_same_at_every_world_size():
    one = list(sampler())
    assert one == list(sampler())  # deterministic
    assert one != list(sampler(seed=1))  # the seed changes the shuffles, not the interleave
    assert (source_of(sampler(), np.array(one)) == source_of(sampler(), np.array(list(sampler(seed=1))))).all()
    for world in (2, 3):
        ranks = [list(sampler(world, r)) for r in range(world)]
        dealt = [i for row in zip(*ranks) for i in row]
        assert dealt == one[:len(dealt)] and len(one) - len(dealt) < world


@pytest.mark.parametrize("weights, world", [([1.0, 1.0], 2), ([1.0, 1.0], 4), (WEIGHTS, 2), (WEIGHTS, 4)])
def test_every_rank_reads_every_source_by_its_weight(weights, world):
    """Rank ``r`` takes every ``W``-th draw: the interleave must not line up with the world size."""
    lengths = [3000] * len(weights)
    target = np.array(weights) / sum(weights)
    for rank in range(world):
        s = sampler(world, rank, weights=weights, lengths=lengths)
        draws = np.array(list(s)[:2000])
        share = np.bincount(source_of(s, draws), minlength=len(weights)) / len(draws)
        assert np.abs(share - target).max() < 0.03, (rank, share)


def test_a_source_that_runs_out_repeats_with_a_new_shuffle_and_the_log_says_which_epoch(caplog):
    s = sampler()
    with caplog.at_level(logging.INFO, logger="lightning.pytorch"):
        order = np.array(list(s))
    small = order[source_of(s, order) == 2] - s.dataset.offsets[2]
    epochs = [small[i:i + 40] for i in range(0, len(small) - 39, 40)]
    assert len(epochs) > 10
    assert all(sorted(e) == list(range(40)) for e in epochs)  # each pass reads every sequence once
    assert len({tuple(e) for e in epochs}) == len(epochs)  # each pass its own shuffle
    line = next(r.getMessage() for r in caplog.records if "mixture epoch 0" in r.getMessage())
    assert f"s2 on its epochs 0-{len(small) // 40 - (len(small) % 40 == 0)}" in line and "s0 on its epoch 0" in line


def test_resume_at_another_world_size_skips_exactly_what_was_consumed():
    one = list(sampler())
    resumed = sampler(2, 1)
    resumed.resume_epoch, resumed.resume_samples = 0, 1000  # consumed by all ranks together
    assert list(resumed) == one[1001::2][:len(list(resumed))]
    assert len(one) - 1000 - 2 * len(list(resumed)) < 2
    resumed.set_epoch(1)
    full = sampler(2, 1)
    full.set_epoch(1)
    assert list(resumed) == list(full)  # only the interrupted epoch is shortened


@pytest.mark.parametrize("entry, match", [
    ({"path": "stdlib", "weight": 0}, r"data.source\[1\].weight=0 .*positive"),
    ({"path": "stdlib", "weight": -2}, r"data.source\[1\].weight=-2"),
    ({"path": "stdlib", "weight": "3"}, r"data.source\[1\].weight='3'"),
    ({"path": "stdlib", "weight": True}, r"data.source\[1\].weight=True"),
    ({"path": "stdlib", "wieght": 2}, r"data.source\[1\] has unknown key\(s\) \['wieght'\]"),
    ({"weight": 2}, r"data.source\[1\]=.*needs a path"),
])
def test_bad_mixture_entries_are_refused_naming_the_entry(entry, match):
    with pytest.raises(ValueError, match=match):
        TextDataModule([{"path": "stdlib", "weight": 1}, entry])


def test_a_mixture_source_too_small_is_named(tmp_path):
    (tmp_path / "tiny.txt").write_text("abc")
    dm = TextDataModule([{"path": "stdlib", "weight": 1}, {"path": str(tmp_path / "tiny.txt"), "weight": 1}],
                        seq_len=16, max_tokens=10_000)
    with pytest.raises(ValueError, match=r"data.source\[1\] \('.*tiny.txt'\): only 4 tokens"):
        dm.setup()


# ---- training on mixtures -----------------------------------------------------------------------------------

TINY = dict(vocab_size=260, dim=32, n_layers=2, n_heads=2, n_kv_heads=1, ffn_hidden=64, n_dense_layers=1,
            num_experts=4, top_k=2, expert_hidden=32, max_seq_len=16)


class Record(Callback):
    def __init__(self):
        self.rows = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.rows.append({"step": trainer.global_step, "loss": outputs["loss"].item(), "first": batch[:, :4].tolist()})


def fit(dm, max_steps, ckpt_dir=None, resume=None, limit_val_batches=0, val_every=None):
    L.seed_everything(0, verbose=False)
    module = MoELanguageModel(MoEConfig(**TINY), optimizer=partial(torch.optim.AdamW, lr=1e-2))
    record = Record()
    callbacks = [record] + ([ModelCheckpoint(dirpath=ckpt_dir, filename="{step}", every_n_train_steps=2,
                                             save_top_k=-1)] if ckpt_dir else [])
    trainer = L.Trainer(accelerator="cpu", max_steps=max_steps, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=limit_val_batches,
                        val_check_interval=val_every, check_val_every_n_epoch=None if val_every else 1,
                        callbacks=callbacks, enable_checkpointing=bool(ckpt_dir))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, dm, ckpt_path=resume)
    return record.rows, trainer, module, [str(w.message) for w in caught]


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """A shard folder (several shards) and a `.npy` file, both byte tokens."""
    import os
    tmp = tmp_path_factory.mktemp("mix")
    tokenize_to_folder([os.path.dirname(os.__file__) + "/json"], str(tmp / "web"), workers=1, shard_tokens=20_000)
    write_token_file([os.__file__], str(tmp / "code.npy"))
    return str(tmp / "web"), str(tmp / "code.npy")


def mixture(sources, **kwargs):
    web, code = sources
    return TextDataModule([{"path": web, "weight": 3}, {"path": code, "weight": 1, "name": "code"}], seq_len=16,
                          batch_size=4, **kwargs)


def test_mixture_of_shards_and_a_token_file_resumes_exactly_with_workers_and_no_resumable_warning(sources, tmp_path):
    full, _, _, _ = fit(mixture(sources, num_workers=2), 6, ckpt_dir=tmp_path / "ckpt")
    resumed, _, _, said = fit(mixture(sources, num_workers=2), 6, resume=str(tmp_path / "ckpt" / "step=2.ckpt"))
    assert [r["step"] for r in resumed] == [3, 4, 5, 6]
    assert [r["first"] for r in resumed] == [r["first"] for r in full[2:]]  # the very next batches
    assert [r["loss"] for r in resumed] == pytest.approx([r["loss"] for r in full[2:]], abs=1e-6)
    assert not [w for w in said if "not resumable" in w]
    loops = torch.load(tmp_path / "ckpt" / "step=2.ckpt", weights_only=True)["loops"]
    state = loops["fit_loop"]["state_dict"]["combined_loader"]
    assert {k: state[0][k] for k in ("epoch", "samples", "mixture")} == {  # beside what the data describes
        "epoch": 0, "samples": 8, "mixture": [["web", 3.0, state[0]["mixture"][0][2]],
                                             ["code", 1.0, state[0]["mixture"][1][2]]]}
    web_only = TextDataModule([{"path": sources[0], "weight": 1}, {"path": sources[1], "weight": 1, "name": "code"}],
                              seq_len=16, batch_size=4)
    with pytest.raises(ValueError, match=r"was trained on other data(.|\n)*data mixture: checkpoint \[\['web', 3.0"):
        fit(web_only, 6, resume=str(tmp_path / "ckpt" / "step=2.ckpt"))


def test_one_corpus_resumes_without_the_resumable_warning_and_refuses_other_data(sources, tmp_path):
    dm = partial(TextDataModule, sources[1], seq_len=16, batch_size=4)
    full, _, _, _ = fit(dm(), 4, ckpt_dir=tmp_path / "ckpt")
    resumed, _, _, said = fit(dm(), 4, resume=str(tmp_path / "ckpt" / "step=2.ckpt"))
    assert [r["loss"] for r in resumed] == pytest.approx([r["loss"] for r in full[2:]], abs=1e-6)
    assert not [w for w in said if "not resumable" in w]
    for other in (dict(source=sources[1], seq_len=12), dict(source=sources[0], seq_len=16)):  # was: silently resumed
        with pytest.raises(ValueError, match=r"was trained on other data(.|\n)*data train_sequences"):
            fit(TextDataModule(batch_size=4, **other), 4, resume=str(tmp_path / "ckpt" / "step=2.ckpt"))


def test_text_given_to_fit_is_tokenized_once_into_the_run_folder_and_reused_on_restart(tmp_path):
    """Was: every rank tokenized the text itself, at every start. Now global rank 0 writes shards under the
    logger's folder (Lightning's prepare_data, the other ranks at its barrier) and every rank maps them."""
    import os
    from lightning.pytorch.loggers import CSVLogger
    text = os.path.dirname(os.__file__) + "/json"

    def run():
        L.seed_everything(0, verbose=False)
        record = Record()
        trainer = L.Trainer(accelerator="cpu", max_steps=2, logger=CSVLogger(tmp_path / "logs"), callbacks=[record],
                            enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                            limit_val_batches=0, enable_checkpointing=False)
        trainer.fit(MoELanguageModel(MoEConfig(**TINY), optimizer=partial(torch.optim.AdamW, lr=1e-2)),
                    TextDataModule(text, seq_len=16, batch_size=4))
        return record.rows
    first = run()
    [folder] = (tmp_path / "logs" / "lightning_logs" / "tokenized").iterdir()
    shards = {p: p.stat().st_mtime_ns for p in folder.glob("part-*.npy")}
    assert shards and (folder / "manifest.json").is_file()
    assert run() == first  # the restart reads the same shards, untouched
    assert {p: p.stat().st_mtime_ns for p in folder.glob("part-*.npy")} == shards
    in_memory, _, _, _ = fit(TextDataModule(text, seq_len=16, batch_size=4), 2)  # no logger: tokenized in memory
    assert [r["first"] for r in in_memory] == [r["first"] for r in first]


def logged_module(tmp_path, global_rank=0):
    """A data module over one small text file, attached to a trainer-like object that logs under tmp_path."""
    from types import SimpleNamespace
    from lightning.pytorch.loggers import CSVLogger
    (tmp_path / "a.txt").write_text("some text to tokenize " * 200)
    dm = TextDataModule(str(tmp_path / "a.txt"), seq_len=8, batch_size=2)
    dm.trainer = SimpleNamespace(logger=CSVLogger(tmp_path / "logs"), global_rank=global_rank,
                                 default_root_dir=str(tmp_path))
    return dm


def test_fit_waits_for_another_run_tokenizing_the_same_text_then_reuses_it(tmp_path, capfd):
    """Two runs of a sweep sharing a logger root and a corpus. Was: the second failed, and its one line had lost
    the cause ("tokenizing it into X failed: ; fix that")."""
    from moe_lightning.run import locks
    module = logged_module(tmp_path)
    folder = module._tokenized_folder(0)
    folder.mkdir(parents=True)
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from pathlib import Path; "
                               "from moe_lightning.run import locks; locks.acquire(Path(sys.argv[1])); "
                               "print('held', flush=True); time.sleep(3)", str(folder / locks.LOCK_FILE)],
                              env=clean_env(), stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    module.prepare_data()  # waits for the holder to exit, then tokenizes (the holder wrote nothing)
    assert holder.poll() is not None and (folder / "manifest.json").is_file()
    said = capfd.readouterr().err
    assert f"another run is tokenizing into {folder} (host " in said and "waiting for it to finish" in said
    assert not locks._HELD  # given back


def test_a_signal_or_failure_while_fit_tokenizes_is_a_preemption_or_one_line_for_fit(tmp_path, monkeypatch):
    """Was: SIGTERM in prepare_data gave a traceback and exit 1; a failure advised tokenize's --resume."""
    import os
    import signal
    from moe_lightning.data.tokenize import workers
    from moe_lightning.run.exits import Preempted
    original = workers.tokenize_unit

    def signalled(index):
        os.kill(os.getpid(), signal.SIGTERM)  # delivered here, in the main thread, as in a preempted job
        return original(index)
    monkeypatch.setattr(workers, "tokenize_unit", signalled)
    with pytest.raises(Preempted) as raised:
        logged_module(tmp_path).prepare_data()
    assert raised.value.code == 128 + signal.SIGTERM and "nothing to save" in str(raised.value)

    def failing(index):
        raise ValueError("the disk said no")
    monkeypatch.setattr(workers, "tokenize_unit", failing)
    with pytest.raises(ValueError, match="a.txt.*failed: unit 0.*the disk said no; fix that and start the run") as e:
        logged_module(tmp_path).prepare_data()
    assert "--resume" not in str(e.value)


def test_a_rank_that_cannot_see_rank_0s_tokenized_folder_is_told_to_share_the_log_folder(tmp_path):
    """Was: a rank on another node silently tokenized the text in memory."""
    with pytest.raises(ValueError, match="global rank 1 finds no tokenized corpus.*every node shares"):
        logged_module(tmp_path, global_rank=1).setup()
    logged_module(tmp_path).setup()  # rank 0 (no prepare_data: as without Lightning) still reads the text


def test_a_mid_epoch_position_of_an_earlier_shuffle_order_is_refused(tmp_path):
    """Was: no order version in the position, so a checkpoint of the earlier shuffle resumed into another order."""
    dm = TextDataModule(os.path.dirname(os.__file__) + "/json", seq_len=16, batch_size=4)
    dm.setup()
    position = {"epoch": 1, "samples": 40, **dm.description()}
    assert position["order"] == "feistel-v1" and dm._restore(position) == (1, 40)
    earlier = {k: v for k, v in position.items() if k != "order"}
    with pytest.raises(ValueError, match="40 sequences into epoch 1 of the shuffle order of an earlier version"):
        dm._restore(earlier)
    assert dm._restore({**earlier, "samples": 0}) == (1, 0)  # at an epoch's start no order is needed
    # a checkpoint older still kept the position in the datamodule's own state (was: resumed without a check)
    with pytest.raises(ValueError, match="40 sequences into epoch 1 of the shuffle order of an earlier version"):
        dm.load_state_dict({"epoch": 1, "samples": 40})
    dm.load_state_dict({"epoch": 2, "samples": 0})
    sampler = dm.train_dataloader().sampler
    assert (sampler.resume_epoch, sampler.resume_samples) == (2, 0)


def test_a_source_given_twice_is_refused():
    """Was: silently counted twice in training and validation."""
    with pytest.raises(ValueError, match=r"data.source\[1\] \('stdlib'\) repeats data.source\[0\]"):
        TextDataModule([{"path": "stdlib", "weight": 1}, {"path": "stdlib", "weight": 2}])
    with pytest.raises(ValueError, match=r"repeats data.source\[0\]"):
        TextDataModule(["/tmp/x.npy", "/tmp/../tmp/x.npy"])


def test_validation_logs_each_source_and_the_overall_loss(sources):
    _, trainer, module, _ = fit(mixture(sources), 2, limit_val_batches=2, val_every=2)
    metrics = trainer.callback_metrics
    dm = trainer.datamodule
    module.eval()
    per_source = {}
    with torch.no_grad():
        for loader in dm.val_dataloader():
            batches = [b for _, b in zip(range(2), loader)]
            per_source[loader.name] = [module._loss(b).item() for b in batches]
    assert metrics["val/loss/web"].item() == pytest.approx(np.mean(per_source["web"]), abs=1e-6)
    assert metrics["val/loss/code"].item() == pytest.approx(np.mean(per_source["code"]), abs=1e-6)
    everything = per_source["web"] + per_source["code"]
    assert metrics["val/loss"].item() == pytest.approx(np.mean(everything), abs=1e-6)
    assert metrics["val/perplexity"].item() == pytest.approx(np.exp(np.mean(everything)), rel=1e-5)


# ---- real processes: kill -9, resume at the same and at another world size -----------------------------------

@pytest.mark.extended
def test_killed_two_process_mixture_run_resumes_exactly_on_two_and_on_one_process(sources, tmp_path):
    """Two ranks of MoEFSDPStrategy, two loader workers each, on a mixture of a shard folder and a token file;
    SIGKILL after step 3, resume from the step-2 checkpoint. On two processes the losses repeat the
    uninterrupted run's to 1e-6 (the same arithmetic); on one process with the same global batch the same
    sequences are trained in each step (none repeated or skipped) and the losses agree to 1e-5 (gradients are
    reduced in another order, see test_strategy)."""
    import json
    from tests.support.distributed import run_ranks
    run = LAUNCHERS / "data_resume_run.py"
    source = json.dumps([{"path": sources[0], "weight": 3}, {"path": sources[1], "weight": 1}])

    def launch(name, world, *args):
        run_ranks(run, world, "--source", source, "--batch-size", str(4 // world), "--out", str(tmp_path / name),
                  *args, timeout=600)
        return [json.loads((tmp_path / f"{name}.rank{r}.json").read_text()) for r in range(world)]

    def per_step(ranks):
        """Step -> (world-mean loss, the global batch's sequences in any order)."""
        steps = {}
        for rows in ranks:
            for row in rows:
                loss, seqs = steps.get(row["step"], (row["loss"], []))
                steps[row["step"]] = (loss, sorted(seqs + row["sequences"]))
        return steps

    reference = per_step(launch("reference", 2))
    with pytest.raises(RuntimeError, match="exit -9"):
        launch("killed", 2, "--ckpt-dir", str(tmp_path / "ckpt"), "--kill-at-step", "3")
    checkpoint = str(tmp_path / "ckpt" / "step=2.ckpt")
    on_two = per_step(launch("on_two", 2, "--resume", checkpoint))
    on_one = per_step(launch("on_one", 1, "--resume", checkpoint))
    assert sorted(on_two) == sorted(on_one) == [3, 4, 5, 6]
    for step in (3, 4, 5, 6):
        assert on_two[step][1] == on_one[step][1] == reference[step][1]
        assert on_two[step][0] == pytest.approx(reference[step][0], abs=1e-6)
        assert on_one[step][0] == pytest.approx(reference[step][0], rel=1e-5)
    consumed = [tuple(s) for step in range(1, 7) for s in reference[step][1]]
    assert len(set(consumed)) == len(consumed)  # no sequence twice in the run (the sources are far from repeating)


def test_samplers_hand_out_an_epoch_in_chunks_without_changing_the_order(monkeypatch):
    from moe_lightning.data import ResumableSampler, sampling
    whole = [list(sampler(2, 1)), list(ResumableSampler(list(range(1000)), 2, 1, seed=3))]
    monkeypatch.setattr(sampling, "CHUNK", 7)  # many chunks, many crossing a source's pass
    assert [list(sampler(2, 1)), list(ResumableSampler(list(range(1000)), 2, 1, seed=3))] == whole


def test_the_one_resume_check_refuses_an_earlier_order_before_anything_is_built(tmp_path):
    """Was: found only at restore, after the folders were locked and cleaned and the model built and loaded."""
    from moe_lightning.checkpoint.compat import ResumeMismatchError, check_checkpoint
    for name, state in [("loader.ckpt", {"loops": {"fit_loop": {"state_dict": {"combined_loader": [
                            {"epoch": 1, "samples": 40}]}}}}),
                        ("datamodule.ckpt", {"TextDataModule": {"epoch": 1, "samples": 40}})]:
        torch.save({"hyper_parameters": {}, **state}, tmp_path / name)
        with pytest.raises(ResumeMismatchError, match="40 sequences into epoch 1 of the shuffle order of an earlier"):
            check_checkpoint(tmp_path / name, {})
    assert check_checkpoint(tmp_path / "loader.ckpt", {}, training=False) == []  # validate/test/predict: no order
    torch.save({"hyper_parameters": {}, "TextDataModule": {"epoch": 2, "samples": 0}}, tmp_path / "start.ckpt")
    assert check_checkpoint(tmp_path / "start.ckpt", {}) == []  # at an epoch's start: resumes
