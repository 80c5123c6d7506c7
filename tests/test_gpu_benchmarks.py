"""The GPU benchmark driver cannot lose results: failures and time-outs are reported, the other parts still run.

``gpu_all.sh`` is run for real with a stand-in ``python`` on PATH whose behaviour per script is chosen by the
test (succeed, fail, hang), so the driver's budget, time boxes and exit status are checked without a GPU.
"""

import json
import os
import stat
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

import pytest
import torch

from tests.benchmark_script import load_benchmark
from tests.distributed import REPO_ROOT, clean_env

FAKE_PYTHON = """#!/usr/bin/env bash
# stand-in interpreter: "-c" prints a version line; a benchmark script behaves as $BEHAVIOUR_<name> says
[[ $1 == -c ]] && { echo "torch fake lightning fake gpus 1"; exit 0; }
name=$(basename "$1" .py)
case $(printenv "BEHAVIOUR_$name") in
  fail) echo "{\\"part\\": \\"$name\\", \\"status\\": \\"failed\\"}"; exit 3 ;;
  hang) echo "{\\"part\\": \\"$name\\", \\"started\\": true}"; sleep 60 ;;
  *) echo "{\\"part\\": \\"$name\\", \\"status\\": \\"ok\\"}" ;;
esac
"""


def run_gpu_all(tmp_path: Path, budget: int, **behaviour: str) -> subprocess.CompletedProcess:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    fake = bin_dir / "python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    env = clean_env(PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", OUT=str(tmp_path / "out"),
                    **{f"BEHAVIOUR_{k}": v for k, v in behaviour.items()})
    return subprocess.run(["bash", str(REPO_ROOT / "benchmarks" / "gpu_all.sh"), str(budget)], env=env,
                          capture_output=True, text=True, timeout=120)


def test_gpu_all_runs_every_part_reports_failures_and_exits_nonzero(tmp_path):
    done = run_gpu_all(tmp_path, 420, muon_gpu_step="fail")
    lines = done.stdout.splitlines()
    assert "gpu_all: total budget 420 s" in lines[0]
    parts = [line.split("--- ")[1].split(" ")[0] for line in lines if "--- " in line]
    assert parts == ["smoke", "offload", "attention", "muon", "strategy", "memory"]  # smoke first, then by value
    assert "gpu_all: FAILED muon (exit 3)" in lines and "gpu_all: ok strategy" in lines
    assert done.returncode == 1 and "FAILED PARTS: muon:exit3" in done.stdout
    assert (tmp_path / "out" / "strategy.log").read_text().strip() == '{"part": "gpu_strategy", "status": "ok"}'


def test_gpu_all_exits_zero_only_when_every_part_succeeded(tmp_path):
    done = run_gpu_all(tmp_path, 420)
    assert done.returncode == 0 and done.stdout.splitlines()[-1] == "gpu_all: all parts ok"


def test_gpu_all_time_boxes_a_hanging_part_and_skips_what_the_budget_cannot_hold(tmp_path):
    done = run_gpu_all(tmp_path, 17, gpu_offload="hang")
    assert '{"part": "gpu_offload", "started": true}' in done.stdout  # printed before the hang, kept
    assert "gpu_all: TIMEOUT offload" in done.stdout
    assert "gpu_all: SKIPPED muon" in done.stdout and "gpu_all: SKIPPED memory" in done.stdout
    assert done.returncode == 1


@pytest.fixture(scope="module")
def gpu_strategy():
    return load_benchmark("gpu_strategy")


def child_args(**overrides) -> Namespace:
    return Namespace(**({"devices": 1, "warmup": 1, "steps": 1, "peak_flops": None} | overrides))


def test_gpu_strategy_reports_a_child_that_runs_out_of_time(gpu_strategy):
    result = gpu_strategy.run_child(0, child_args(), timeout=0.5)
    assert result["status"] == "timeout" and result["unshard_async_op"] is False and result["prefetch_depth"] == 1


def test_gpu_strategy_reports_a_child_that_fails_with_its_error(gpu_strategy, monkeypatch):
    monkeypatch.setattr(gpu_strategy.sys, "executable", sys.executable)
    result = gpu_strategy.run_child(2, child_args(devices=0), timeout=120)  # Trainer rejects devices=0
    assert result["status"] == "failed" and result["exit"] != 0
    assert result["unshard_async_op"] is True and "devices" in result["stderr_tail"]


@pytest.fixture(scope="module")
def gpu_smoke():
    return load_benchmark("gpu_smoke")


def test_gpu_smoke_dry_run_trains_the_1t_mini_path_on_cpu(gpu_smoke, capsys):
    summary = gpu_smoke.main(["--dry-run"])
    assert summary["steps"] == 2 and summary["seq_len"] == 1024 and summary["precision"] == "32-true"
    assert all(0 < loss < 10 for loss in summary["losses"])
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith('{"step"')]
    assert [row["step"] for row in rows] == [0, 1]  # one line per step, printed as it ends


def test_gpu_smoke_names_the_package_frame_that_synchronised(gpu_smoke):
    """On CUDA, set_sync_debug_mode("warn") warns inside the op; the probe records the innermost frame of
    moe_lightning on the Python stack at that moment (here: the model's forward calling into a hooked op)."""
    from moe_lightning.model import MoEConfig, MoETransformer
    probe = gpu_smoke.SmokeProbe(probe_step=0)
    model = MoETransformer(MoEConfig(vocab_size=32, dim=16, n_layers=1, n_heads=2, n_kv_heads=1, max_seq_len=8,
                                     ffn_hidden=16, n_dense_layers=1, num_experts=2, top_k=1, expert_hidden=16))
    model.norm.register_forward_hook(lambda *_: probe._show("called a synchronizing CUDA operation", UserWarning,
                                                             "x.py", 1))
    model(torch.zeros(1, 4, dtype=torch.long))
    assert len(probe.sync_sites) == 1 and probe.sync_sites[0].startswith("transformer.py:")
    probe._show("an unrelated warning", UserWarning, "x.py", 1)
    assert len(probe.sync_sites) == 1
