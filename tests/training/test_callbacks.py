"""Monitoring callbacks: throughput/MFU, expert load, allocator monitor; the analytic FLOPs count."""

import csv
import re
import warnings
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import numpy as np
import pytest
import torch
from PIL import Image

from moe_lightning import MoEConfig, MoELanguageModel
from moe_lightning.training.callbacks import (ActivationOffload, AllocatorMonitor, ExpertLoad, ExpertLoadMonitor,
                                     MoEThroughputMonitor, NonFiniteGuard, TrainingCurves)
from moe_lightning.training.callbacks import allocator_monitor
from moe_lightning.training.callbacks.expert_load import load_figure
from moe_lightning.planner.flops import peak_bf16_flops
from moe_lightning.training.callbacks.training_curves import token_count
from moe_lightning.training.strategy import MoEFSDPStrategy
from moe_lightning.planner.flops import training_flops_per_token

CONFIG = dict(vocab_size=64, dim=32, n_layers=3, n_heads=4, n_kv_heads=2, max_seq_len=16, ffn_hidden=48,
              n_dense_layers=1, num_experts=4, top_k=2, expert_hidden=16, n_shared_experts=1,
              bias_update_rate=0.05)
BATCH, SEQ = 4, 16


def fit(tmp_path, logger, callbacks, max_steps=4, val_every=None):
    torch.manual_seed(0)
    data = torch.randint(0, CONFIG["vocab_size"], (BATCH * max_steps, SEQ + 1))
    val = torch.utils.data.DataLoader(data[:BATCH], batch_size=BATCH) if val_every else None
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, logger=logger, callbacks=callbacks,
                        default_root_dir=tmp_path, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, log_every_n_steps=1, val_check_interval=val_every,
                        limit_val_batches=1 if val_every else 0, num_sanity_val_steps=0)
    trainer.fit(MoELanguageModel(MoEConfig(**CONFIG)), torch.utils.data.DataLoader(data, batch_size=BATCH), val)
    return trainer


def png_size(path) -> tuple[int, int]:
    with Image.open(path) as image:
        return image.size


def logged(trainer) -> dict[str, dict[int, float]]:
    """CSVLogger's metrics.csv as {metric: {step: value}}."""
    out: dict[str, dict[int, float]] = {}
    with open(f"{trainer.logger.log_dir}/metrics.csv") as f:
        for row in csv.DictReader(f):
            for key, value in row.items():
                if key != "step" and value != "":
                    out.setdefault(key, {})[int(row["step"])] = float(value)
    return out


def test_callbacks_log_on_cpu_fit(tmp_path):
    offload = ActivationOffload(min_offload_bytes=0)
    throughput = MoEThroughputMonitor(log_every_n_steps=2, peak_flops=1e12)
    expert_load = ExpertLoadMonitor(log_every_n_steps=2, image_every_n_steps=4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = fit(tmp_path, L.pytorch.loggers.CSVLogger(tmp_path), [offload, throughput, expert_load,
                                                                        AllocatorMonitor(log_every_n_steps=1)])
    metrics = logged(trainer)
    assert not [w for w in caught if "AllocatorMonitor" in str(w.message)]
    assert not [k for k in metrics if k.startswith("memory/")]  # silent without CUDA
    # throughput: logged at steps 2 and 4 (from the start, no window); MFU consistent with the FLOPs count
    tokens_per_s = metrics["perf/tokens_per_sec_per_device"]
    assert sorted(tokens_per_s) == [2, 4] and all(v > 0 for v in tokens_per_s.values())
    flops_per_token = training_flops_per_token(MoEConfig(**CONFIG), SEQ)
    for step, mfu in metrics["perf/mfu"].items():
        assert mfu == pytest.approx(tokens_per_s[step] * flops_per_token / 1e12, rel=1e-6)
        assert metrics["perf/tflops_per_device"][step] == pytest.approx(mfu, rel=1e-6)
    # expert load: per-layer metrics for the MoE blocks 1 and 2, a heatmap PNG readable at full size
    for key in ("expert_load/layer1/max_over_mean", "expert_load/layer2/cv", "expert_load/max_over_mean",
                "expert_load/layer2/dead_fraction", "expert_load/load_entropy"):
        assert sorted(metrics[key]) == [2, 4]
    assert all(v >= 1 for v in metrics["expert_load/layer1/max_over_mean"].values())
    assert all(0 < v <= 1 for v in metrics["expert_load/layer1/load_entropy"].values())
    assert expert_load.last_image_path.name == "step_0000004.png"
    assert png_size(expert_load.last_image_path)[0] >= 800
    # offload: every block but the last offloads its [4, 16, 32] fp32 input once per step
    assert set(metrics["offload/bytes"].values()) == {2 * BATCH * SEQ * 32 * 4}
    assert set(metrics["offload/tensors_out"].values()) == {2} == set(metrics["offload/tensors_in"].values())
    assert all("forward" not in block.__dict__ for block in trainer.lightning_module.model.layers)


def test_expert_load_heatmap_goes_to_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = L.pytorch.loggers.TensorBoardLogger(tmp_path)
    expert_load = ExpertLoadMonitor(log_every_n_steps=1, image_every_n_steps=2)
    fit(tmp_path, logger, [expert_load], max_steps=2)
    logger.experiment.flush()
    events = EventAccumulator(logger.log_dir, size_guidance={"images": 0})
    events.Reload()
    (image,) = events.Images("expert_load/heatmap")
    assert image.step == 2 and (image.width, image.height) == png_size(expert_load.last_image_path)
    assert image.width >= 800


def test_training_flops_match_hand_count():
    config = MoEConfig(**{**CONFIG, "n_layers": 2})  # the bias rate does not enter the count
    D, H, KV, hd, V = 32, 4, 2, 8, 64
    attention = D * H * hd + 2 * D * KV * hd + H * hd * D          # wq, wk, wv, wo
    norms = 2 * D
    dense_block = attention + norms + 3 * D * 48                    # SwiGLU ffn_hidden=48
    routed = 3 * 4 * D * 16                                         # 4 experts of SwiGLU width 16
    moe_block = attention + norms + 4 * D + routed * 2 // 4 + 3 * D * 16   # router, top-2 of 4, 1 shared expert
    head = D + V * D                                                # final norm, output (embedding is a lookup)
    causal_attention = 12 * 2 * H * hd * (SEQ + 1) / 2  # each query scores itself and the keys before it
    assert training_flops_per_token(config, SEQ) == 6 * (dense_block + moe_block + head) + causal_attention


def test_peak_table_lookup():
    assert peak_bf16_flops("NVIDIA H200") == 989e12
    assert peak_bf16_flops("NVIDIA GH200 480GB") == 989e12
    assert peak_bf16_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_bf16_flops("NVIDIA H100 PCIe") == 756e12
    assert peak_bf16_flops("NVIDIA B200") == 2250e12
    assert peak_bf16_flops("Tesla T4") is None


def test_expert_load_metric_and_heatmap_colours():
    metric = ExpertLoad(num_layers=2, num_experts=4)
    metric.update(torch.tensor([[2, 2, 2, 2], [8, 0, 0, 0]]))
    metric.update(torch.tensor([[2, 2, 2, 2], [0, 0, 0, 0]]))
    result = metric.compute()
    assert result["max_over_mean"].tolist() == [1.0, 4.0]
    assert result["cv"][0] == 0 and result["cv"][1] == pytest.approx(3 ** 0.5)
    assert result["dead_fraction"].tolist() == [0.0, 0.75]
    assert result["load_entropy"].tolist() == [pytest.approx(1.0), 0.0]  # uniform; all tokens on one expert


def test_dead_fraction_and_entropy_match_hand_computation():
    metric = ExpertLoad(num_layers=1, num_experts=4)
    metric.update(torch.tensor([[6, 2, 0, 0]]))
    metric.update(torch.tensor([[0, 0, 0, 0]]))
    result = metric.compute()
    shares = [6 / 8, 2 / 8]  # two experts got tokens, two got none
    entropy = -sum(p * np.log(p) for p in shares) / np.log(4)
    assert result["dead_fraction"].item() == 0.5
    assert result["load_entropy"].item() == pytest.approx(entropy, rel=1e-12)  # float64 both sides
    assert result["max_over_mean"].item() == 6 / 2


def test_logged_expert_load_of_one_moe_layer_is_that_layer_and_their_mean():
    """Was: torchmetrics squeezed a one-layer result to scalars and the monitor raised TypeError at its first log
    (any model with one MoE layer, e.g. two layers with one dense)."""
    from moe_lightning.training.callbacks.expert_load import load_metrics
    metric = ExpertLoad(num_layers=1, num_experts=4)
    metric.update(torch.tensor([[6, 2, 0, 0]]))
    one = load_metrics(metric.compute(), layers=[1])
    assert one["expert_load/layer1/max_over_mean"] == one["expert_load/max_over_mean"] == 3.0
    assert one["expert_load/layer1/dead_fraction"] == 0.5 and len(one) == 8
    metric = ExpertLoad(num_layers=2, num_experts=4)
    metric.update(torch.tensor([[2, 2, 2, 2], [8, 0, 0, 0]]))
    two = load_metrics(metric.compute(), layers=[1, 3])
    assert two["expert_load/layer3/max_over_mean"] == 4.0 and two["expert_load/max_over_mean"] == 2.5


def test_load_entropy_of_a_single_expert_is_one_not_nan():
    metric = ExpertLoad(num_layers=2, num_experts=1)  # log E = 0: the normalisation would divide 0 by 0
    metric.update(torch.tensor([[5], [0]]))
    assert metric.compute()["load_entropy"].tolist() == [1.0, 1.0]


def test_load_figure_has_labelled_axes_colour_bar_and_step():
    fig = load_figure(torch.tensor([[4, 4, 4, 4], [16, 0, 0, 0]]), layer_ids=[1, 3], step=250)
    heatmap, bar = fig.axes
    assert heatmap.get_xlabel() == "expert" and "layer" in heatmap.get_ylabel()
    assert [t.get_text() for t in heatmap.get_yticklabels()] == ["1", "3"]
    assert bar.get_ylabel() == "load / mean load" and "250" in heatmap.get_title()
    ratio = heatmap.images[0].get_array()
    assert ratio[0].tolist() == [1, 1, 1, 1] and ratio[1, 0] == 4 and ratio[1, 1] == 0.25  # clipped at 4x
    assert heatmap.collections[0].get_offsets().tolist() == [[1, 1], [2, 1], [3, 1]]  # dead experts crossed
    assert fig.get_size_inches()[0] * fig.dpi >= 800


def test_training_curves_land_in_the_run_folder(tmp_path):
    curves = TrainingCurves(record_every_n_steps=1, plot_every_n_steps=3)
    expert_load = ExpertLoadMonitor(log_every_n_steps=2, image_every_n_steps=0)
    trainer = fit(tmp_path, L.pytorch.loggers.CSVLogger(tmp_path), [curves, expert_load], max_steps=6, val_every=3)
    assert curves.path == Path(trainer.log_dir) / "training_curves.png" and png_size(curves.path) == (1500, 800)
    tokens_per_step = BATCH * SEQ
    history = curves.history
    assert [t for t, _ in history["train loss"]] == [tokens_per_step * s for s in range(1, 7)]
    assert [t for t, _ in history["val loss"]] == [tokens_per_step * 3, tokens_per_step * 6]
    assert [t for t, _ in history["dead experts"]] == [tokens_per_step * s for s in (2, 4, 6)]
    assert len(history["tokens/s"]) == 6 and all(v > 0 for _, v in history["tokens/s"])  # timed from train start
    metrics = logged(trainer)
    assert [v for _, v in history["load entropy"]] == pytest.approx(list(metrics["expert_load/load_entropy"].values()))
    # the LR each next step uses, from step 0 (tokens 0) on: WarmupCosineLR's 100 warmup steps, (k + 1) / 100
    base_lr = trainer.optimizers[0].param_groups[0]["initial_lr"]
    assert history["learning rate"] == [(tokens_per_step * k, pytest.approx(base_lr * (k + 1) / 100))
                                        for k in range(7)]
    fig = curves.figure(6)
    titles = [ax.get_title() for ax in fig.axes]
    assert titles == ["loss", "learning rate", "throughput", "expert imbalance", "dead experts", "load entropy"]
    assert all(ax.get_xlabel() == "tokens seen" and ax.get_ylabel() for ax in fig.axes)
    assert all(ax.lines for ax in fig.axes)  # every panel has data
    fig.canvas.draw()  # tick labels in plain token units (384 tokens in all)
    labels = [t.get_text() for t in fig.axes[3].get_xticklabels() if t.get_text()]
    assert labels and all(re.fullmatch(r"-?\d+", label) for label in labels), labels


class _StagedTrainer(SimpleNamespace):
    """What TrainingCurves reads of a trainer, as on rank 0 of a 2-stage run logging every ``log_every`` steps:
    on those steps ``callback_metrics`` hold the whole model's values, between them stage 0's own."""

    def __init__(self, world_size: int, log_every: int):
        super().__init__(world_size=world_size, global_step=0, fast_dev_run=False, callbacks=[], callback_metrics={},
                         optimizers=[SimpleNamespace(param_groups=[{"lr": 1e-3}])],
                         fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace(_should_accumulate=lambda: False)),
                         _logger_connector=SimpleNamespace(should_update_logs=False))
        self.log_every = log_every

    def step(self, step: int) -> None:
        """``step`` just ended: the values its training step logged."""
        self.global_step = step
        written = step % self.log_every == 0
        self._logger_connector.should_update_logs = written
        value = 2.0 + step if written else -1.0  # -1: stage 0's layers' value
        self.callback_metrics = {"train/loss": torch.tensor(value), "train/expert_imbalance": torch.tensor(value)}


@pytest.mark.parametrize("world_size, recorded_steps", [(2, [5, 10]), (1, list(range(1, 11)))])
def test_training_curves_record_train_metrics_only_when_they_are_the_whole_models(world_size, recorded_steps):
    """With several processes the train loss and imbalance are recorded on the log grid only (off it a rank holds
    its own batch's loss and, under pipeline stages, its stage's imbalance: before, 4 of 5 points with the defaults);
    with one process every recorded step is the whole model's. The LR is recorded on every recorded step."""
    curves = TrainingCurves(record_every_n_steps=1)
    trainer = _StagedTrainer(world_size, log_every=5)
    module = SimpleNamespace(tokens_seen=0)
    for step in range(1, 11):
        trainer.step(step)
        module.tokens_seen = 100 * step
        curves.on_train_batch_end(trainer, module, None, None, step - 1)
    want = [(100.0 * s, 2.0 + s if s % 5 == 0 else -1.0) for s in recorded_steps]
    assert curves.history["expert imbalance"] == want and curves.history["train loss"] == want
    assert [t for t, _ in curves.history["learning rate"]] == [100.0 * s for s in range(1, 11)]


def test_token_tick_labels_are_plain_units():
    assert [token_count(x) for x in (0, 1, 950, 20_000, 1_500_000, 999_999, 2.1e9, 3e12)] == \
        ["0", "1", "950", "20k", "1.5M", "1M", "2.1B", "3T"]


def test_training_curves_panels_without_data_share_the_runs_token_axis(tmp_path):
    curves = TrainingCurves(record_every_n_steps=1)
    fit(tmp_path, False, [curves], max_steps=3)  # no ExpertLoadMonitor: its two panels stay empty
    assert "dead experts" not in curves.history and curves.history["learning rate"][0][0] == 0
    fig = curves.figure(3)
    fig.canvas.draw()
    empty = fig.axes[4]  # "not recorded"; before: x from 0 to 1 token, ticks "200 m" ... "1"
    assert not empty.lines and empty.get_xlim() == fig.axes[0].get_xlim()
    labels = [t.get_text() for t in empty.get_xticklabels() if t.get_text()]
    assert labels and not any("m" in label for label in labels)


def test_allocator_monitor_warns_once_with_advice(monkeypatch):
    stats = {"num_alloc_retries": 0, "num_ooms": 0, "allocated_bytes.all.peak": 3 << 30,
             "reserved_bytes.all.peak": 4 << 30, "allocated_bytes.all.current": 1 << 30,
             "reserved_bytes.all.current": 2 << 30}
    monkeypatch.setattr(allocator_monitor, "read_cuda_memory_stats", lambda device: dict(stats))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device: None)

    class Trainer:  # what the callback reads from the trainer; every call ends an optimizer step
        global_step, loggers = 0, []
        fit_loop = SimpleNamespace(epoch_loop=SimpleNamespace(_should_accumulate=lambda: False))

    class Module:
        device = torch.device("cuda", 0)

    monitor = AllocatorMonitor(log_every_n_steps=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step, retries in enumerate([0, 0, 3, 5], start=1):
            stats["num_alloc_retries"] = retries
            Trainer.global_step = step
            monitor.on_train_batch_end(Trainer, Module, None, None, step)
    messages = [str(w.message) for w in caught if "AllocatorMonitor" in str(w.message)]
    assert len(messages) == 1 and "3 times" in messages[0]
    assert "unshard_async_op" in messages[0] and "ActivationOffload" in messages[0] and "batch_size" in messages[0]


@pytest.mark.parametrize("build, match", [
    (lambda: MoEThroughputMonitor(log_every_n_steps=0), "log_every_n_steps=0"),
    (lambda: MoEThroughputMonitor(peak_flops=-1.0), "peak_flops=-1.0"),
    (lambda: ExpertLoadMonitor(log_every_n_steps=10, image_every_n_steps=15), "image_every_n_steps=15"),
    (lambda: AllocatorMonitor(log_every_n_steps=-2), "log_every_n_steps=-2"),
    (lambda: NonFiniteGuard(check_every_n_steps=0), "check_every_n_steps=0"),
    (lambda: NonFiniteGuard(check_every_n_steps=2.5), "check_every_n_steps=2.5"),
    (lambda: TrainingCurves(plot_every_n_steps=-1), "plot_every_n_steps=-1"),
    (lambda: TrainingCurves(record_every_n_steps=0), "record_every_n_steps=0"),
    (lambda: MoEFSDPStrategy(async_checkpoint=True, save_distributed_checkpoint=False), "async_checkpoint=True"),
    (lambda: MoELanguageModel(compile="false"), "model.compile='false'"),
])
def test_bad_arguments_name_the_argument(build, match):
    with pytest.raises(ValueError, match=match):
        build()


CALLBACKS_YAML = """
trainer:
  callbacks:
    - class_path: moe_lightning.training.callbacks.MoEThroughputMonitor
      init_args:
        log_every_n_steps: 10
    - class_path: moe_lightning.training.callbacks.ExpertLoadMonitor
      init_args:
        log_every_n_steps: 50
        image_every_n_steps: 100
    - class_path: moe_lightning.training.callbacks.AllocatorMonitor
    - class_path: moe_lightning.training.callbacks.ActivationOffload
      init_args:
        prefetch: 2
        blocks: [0, 1]
"""


def test_callbacks_come_from_yaml(tmp_path, capsys):
    from moe_lightning.commands.main import run

    (tmp_path / "callbacks.yaml").write_text(CALLBACKS_YAML)
    with pytest.raises(SystemExit):
        run(["fit", "--config", "configs/tiny.yaml", "--config", str(tmp_path / "callbacks.yaml"), "--print_config"])
    printed = capsys.readouterr().out
    for expected in ("moe_lightning.training.callbacks.MoEThroughputMonitor", "peak_flops: null", "image_every_n_steps: 100",
                     "moe_lightning.training.callbacks.AllocatorMonitor", "prefetch: 2", "min_offload_bytes: 1048576"):
        assert expected in printed


def test_the_step_bar_counts_to_the_step_the_run_ends_at(tmp_path):
    """Was: ``max_steps`` whenever set, although ``max_epochs`` may end the run first."""
    from moe_lightning import TextDataModule
    from moe_lightning.training.callbacks.console import StepProgressBar
    config = MoEConfig(vocab_size=260, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32, ffn_hidden=64,
                       num_experts=4, top_k=2, expert_hidden=32)
    trainer = L.Trainer(max_steps=100, max_epochs=1, limit_train_batches=3, accelerator="cpu", devices=1,
                        logger=False, enable_checkpointing=False, limit_val_batches=0, enable_model_summary=False,
                        callbacks=[StepProgressBar()], default_root_dir=tmp_path)
    trainer.fit(MoELanguageModel(config), TextDataModule("stdlib", seq_len=32, batch_size=2, max_tokens=5_000))
    bar = trainer.progress_bar_callback.train_progress_bar
    assert trainer.global_step == bar.n == bar.total == 3
