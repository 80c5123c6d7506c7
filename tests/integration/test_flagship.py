"""The flagship path in miniature: configs/1t-mini.yaml is configs/1t.yaml at toy size, and it trains on 2 CPU
processes with every optimization on, survives SIGKILL and resumes exactly."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.support.distributed import REPO_ROOT, clean_env, free_port

CONFIGS = REPO_ROOT / "configs"


def flatten(node, prefix: str = "") -> dict[str, object]:
    """``{dotted.key: leaf}``; list items are keyed by position and, for callbacks, by class path."""
    if isinstance(node, dict):
        return {k: v for key, value in node.items() for k, v in flatten(value, f"{prefix}{key}.").items()}
    if isinstance(node, list) and all(isinstance(item, dict) and "class_path" in item for item in node):
        return {k: v for item in node for k, v in flatten(item, f"{prefix}{item['class_path']}.").items()}
    return {prefix.rstrip("."): node}


def test_1t_and_1t_mini_differ_only_in_sizes_counts_and_the_accelerator():
    big, mini = (flatten(yaml.safe_load((CONFIGS / name).read_text())) for name in ("1t.yaml", "1t-mini.yaml"))
    assert sorted(big) == sorted(mini), f"keys only in 1t: {set(big) - set(mini)}; only in mini: {set(mini) - set(big)}"
    may_differ_as_text = {"trainer.accelerator", "trainer.logger.init_args.name"}
    for key in big:
        a, b = big[key], mini[key]
        if a == b or key in may_differ_as_text:
            continue
        numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (a, b))
        assert numbers, f"{key}: 1t has {a!r}, 1t-mini {b!r}; only sizes, counts and the accelerator may differ"
    for key in ("trainer.strategy.init_args.meta_init", "trainer.strategy.init_args.cpu_offload",
                "model.init_args.config.document_masking", "model.init_args.loss_chunk_size",
                "moe_lightning.training.callbacks.ActivationOffload.init_args.prefetch"):
        assert any(k.endswith(key) for k in mini), f"1t-mini lacks {key}"
    assert mini["model.init_args.optimizer.class_path"] == "moe_lightning.optim.Muon"
    assert mini["data.init_args.seq_len"] >= 8 * yaml.safe_load((CONFIGS / "tiny.yaml").read_text())["data"]["init_args"]["seq_len"]


def fit_1t_mini(tmp: Path, name: str, *overrides: str, expect_kill: bool = False) -> list[dict]:
    """``moe-lightning fit --config configs/1t-mini.yaml`` as its own 2-process launch; the probe's loss rows."""
    out = tmp / name / "run.json"
    out.parent.mkdir()
    args = [sys.executable, "-m", "moe_lightning", "fit", "--config", str(CONFIGS / "1t-mini.yaml"),
            "--trainer.max_steps=6", "--trainer.limit_val_batches=0", "--trainer.logger=false",
            "--trainer.enable_progress_bar=false", "--data.init_args.max_tokens=400000",
            "--trainer.callbacks+=tests.support.flagship_probe.FlagshipProbe", f"--trainer.callbacks.out={out}", *overrides]
    result = subprocess.run(args, env=clean_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())),
                            cwd=tmp / name, capture_output=True, text=True, timeout=600)
    log = result.stdout[-3000:] + result.stderr[-5000:]
    if expect_kill:
        assert result.returncode != 0, log
    else:
        assert result.returncode == 0, log
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def flagship_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("flagship")
    full = fit_1t_mini(tmp, "full")
    killed = fit_1t_mini(tmp, "killed", "--trainer.callbacks.save_at_steps=[4]", "--trainer.callbacks.kill_at_step=5",
                         expect_kill=True)
    resumed = fit_1t_mini(tmp, "resumed", f"--ckpt_path={tmp / 'killed' / 'step=4.ckpt'}")
    return full, killed, resumed


@pytest.mark.extended
def test_1t_mini_trains_on_two_processes_with_every_optimization(flagship_runs):
    full, killed, _ = flagship_runs
    assert [row["step"] for row in full] == [1, 2, 3, 4, 5, 6]
    # The killed run is the same configuration up to its step 5, plus a checkpoint save after step 4: the same
    # arithmetic on the same data, so the same losses (the save changes nothing it resumes from)
    assert [row["loss"] for row in killed] == pytest.approx([row["loss"] for row in full[:5]], rel=0, abs=1e-6)


@pytest.mark.slow  # two more fits (about 75 s)
def test_1t_mini_on_two_processes_equals_one_process(tmp_path):
    """Expert parallelism, FSDP2 with CPU offload, FlexShard Muon, ActivationOffload and QK-clip over 2 processes
    against one process reading the same 4 sequences a step (ranks take every other sequence of the global order).
    Both build the whole model from the seed (``meta_init`` draws each rank's shards, so its weights depend on
    the layout); the 2-process losses are the mean over ranks of equal token counts."""
    whole = "--trainer.strategy.init_args.meta_init=false"
    two = fit_1t_mini(tmp_path, "two", whole)
    one = fit_1t_mini(tmp_path, "one", whole, "--trainer.devices=1",
                      "--trainer.strategy.init_args.expert_parallel_size=1", "--data.init_args.batch_size=4")
    assert [row["step"] for row in one] == [row["step"] for row in two] == [1, 2, 3, 4, 5, 6]
    # fp32, different reduction order across 2 ranks (~1e-7 a step), amplified by Newton-Schulz: measured <= 3e-7
    assert [row["loss"] for row in two] == pytest.approx([row["loss"] for row in one], rel=2e-6, abs=0)


@pytest.mark.extended
def test_1t_mini_killed_mid_run_resumes_exactly(flagship_runs):
    full, killed, resumed = flagship_runs
    assert [row["step"] for row in killed] == [1, 2, 3, 4, 5]  # step 5 ran; SIGKILL at the start of the next
    assert [row["step"] for row in resumed] == [5, 6]
    for before, after in zip(full[4:], resumed):
        assert after["loss"] == pytest.approx(before["loss"], abs=1e-6)  # same arithmetic, same data order


@pytest.mark.extended
def test_1t_mini_with_multi_token_prediction_trains_and_resumes_exactly(tmp_path):
    """The flagship path with one MTP module (its block MoE, expert-parallel, its own FSDP units, Muon roles):
    2 processes, every optimization on, SIGKILL after the step-4 checkpoint, resumed steps equal the full run."""
    mtp = "--model.init_args.config.mtp_layers=1"
    full = fit_1t_mini(tmp_path, "full", mtp)
    fit_1t_mini(tmp_path, "killed", mtp, "--trainer.callbacks.save_at_steps=[4]", "--trainer.callbacks.kill_at_step=5",
                expect_kill=True)
    resumed = fit_1t_mini(tmp_path, "resumed", mtp, f"--ckpt_path={tmp_path / 'killed' / 'step=4.ckpt'}")
    assert [row["step"] for row in full] == [1, 2, 3, 4, 5, 6] and [row["step"] for row in resumed] == [5, 6]
    for before, after in zip(full[4:], resumed):
        assert after["loss"] == pytest.approx(before["loss"], abs=1e-6)
