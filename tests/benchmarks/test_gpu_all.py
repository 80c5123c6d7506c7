"""The GPU benchmark driver cannot lose results: failures and time-outs are reported, the other parts still run.

``gpu_all.sh`` is run for real with a stand-in ``python`` on PATH whose behaviour per script is chosen by the
test (succeed, fail, hang), so the driver's budget, time boxes and exit status are checked without a GPU.
"""

import json
import os
import signal
import stat
import subprocess
import sys
import time
from argparse import Namespace
from pathlib import Path

import pytest
import torch

from tests.support.benchmark_script import load_benchmark
from tests.support.distributed import REPO_ROOT, clean_env

FAKE_PYTHON = """#!/usr/bin/env bash
# stand-in interpreter: "-c" prints a version line; a benchmark script behaves as $BEHAVIOUR_<name> says
[[ $1 == -c ]] && { echo "torch fake lightning fake gpus 1"; exit 0; }
name=$(basename "$1" .py)
echo "{\\"part\\": \\"$name\\", \\"box_s\\": $GPU_ALL_BOX_S}"
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
    env = clean_env(PYTHON=str(fake), OUT=str(tmp_path / "out"),
                    **{f"BEHAVIOUR_{k}": v for k, v in behaviour.items()})
    return subprocess.run(["bash", str(REPO_ROOT / "benchmarks" / "gpu_all.sh"), str(budget)], env=env,
                          capture_output=True, text=True, timeout=120)


def test_gpu_all_runs_every_part_reports_failures_and_exits_nonzero(tmp_path):
    done = run_gpu_all(tmp_path, 420, muon_gpu_step="fail")
    lines = done.stdout.splitlines()
    assert "gpu_all: total budget 420 s" in lines[0]
    parts = [line.split("--- ")[1].split(" ")[0] for line in lines if line.startswith("gpu_all: --- ")]
    assert parts == ["recipe", "offload", "attention", "muon", "strategy"]  # the 1T recipe first, then by value
    assert "gpu_all: FAILED muon (exit 3)" in lines and "gpu_all: ok strategy" in lines
    assert done.returncode == 1 and "FAILED PARTS: muon:exit3" in done.stdout
    assert (tmp_path / "out" / "strategy.log").read_text().splitlines() == [
        '{"part": "gpu_strategy", "box_s": 50}', '{"part": "gpu_strategy", "status": "ok"}']  # told its time box
    # the boxes add up to at most 7 minutes (a rerun fits the 15-minute lease), and the parts share one cache
    boxes = [int(line.split("time box ")[1].split(" ")[0]) for line in lines if "time box" in line]
    assert sum(boxes) <= 400
    # the summary table: one row per part with its outcome
    assert "| muon | FAILED (exit 3) |" in lines and "| part | outcome |" in lines
    assert any(line.startswith("| recipe | ok in ") for line in lines)


def test_gpu_all_checks_the_triton_launcher_first_and_skips_only_the_compiled_parts(tmp_path):
    done = run_gpu_all(tmp_path, 420, gpu_preflight="fail")
    lines = done.stdout.splitlines()
    assert "SKIPPED recipe (Triton cannot build its launcher" in done.stdout
    assert "SKIPPED attention (Triton cannot build its launcher" in done.stdout
    assert [line.split("--- ")[1].split(" ")[0] for line in lines if line.startswith("gpu_all: --- ")] == ["offload", "muon", "strategy"]
    assert done.returncode == 1 and "recipe:no-compiler" in done.stdout


def test_preflight_names_what_triton_lacks_in_one_line(monkeypatch, tmp_path, capsys):
    preflight = load_benchmark("gpu_preflight")
    # a stand-in libcuda.so (exports cuInit) where TRITON_LIBCUDA_PATH points: the launcher links
    (tmp_path / "cuda.c").write_text("int cuInit(unsigned int flags) { return flags; }\n")
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(tmp_path / "libcuda.so"), str(tmp_path / "cuda.c")],
                   check=True)
    monkeypatch.setenv("TRITON_LIBCUDA_PATH", str(tmp_path))
    assert preflight.main() == 0 and capsys.readouterr().out.count("\n") == 1  # this machine has gcc and Python.h
    # no libcuda (this CPU machine; a GPU machine has the driver's): the link fails, said in one line
    monkeypatch.setenv("TRITON_LIBCUDA_PATH", str(tmp_path / "empty"))
    assert preflight.main() == 2
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "linking with -lcuda failed" in out and "cannot find -lcuda" in out
    assert f"searched ['{tmp_path / 'empty'}']" in out and "set TRITON_LIBCUDA_PATH" in out
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setattr(preflight.sysconfig, "get_paths", lambda scheme=None: {"include": str(tmp_path)})
    assert preflight.main() == 2
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "no C compiler at CC=" in out and f"no Python.h under {tmp_path}" in out
    monkeypatch.delenv("CC")
    monkeypatch.setenv("PATH", str(tmp_path))
    assert preflight.problems()[0] == "no C compiler ($CC unset or missing, no gcc or clang on PATH)"


def test_gpu_all_exits_zero_only_when_every_part_succeeded(tmp_path):
    done = run_gpu_all(tmp_path, 420)
    assert done.returncode == 0 and done.stdout.splitlines()[-1] == "gpu_all: all parts ok"


def test_gpu_all_time_boxes_a_hanging_part_and_skips_what_the_budget_cannot_hold(tmp_path):
    done = run_gpu_all(tmp_path, 17, gpu_offload="hang")
    assert '{"part": "gpu_offload", "started": true}' in done.stdout  # printed before the hang, kept
    assert "gpu_all: TIMEOUT offload" in done.stdout
    assert "gpu_all: SKIPPED muon" in done.stdout and "gpu_all: SKIPPED strategy" in done.stdout
    assert done.returncode == 1


@pytest.fixture(scope="module")
def gpu_strategy():
    return load_benchmark("gpu_strategy")


def child_args(**overrides) -> Namespace:
    return Namespace(**({"devices": 1, "warmup": 1, "steps": 1, "peak_flops": None} | overrides))


def test_gpu_strategy_reports_a_child_that_runs_out_of_time(gpu_strategy):
    result = gpu_strategy.run_child(0, child_args(), timeout=0.5)
    assert result["status"] == "timeout" and result["unshard_async_op"] is False and result["prefetch_depth"] == 1


def test_gpu_strategy_budget_follows_the_time_box_and_sigterm_kills_the_child_group(tmp_path):
    """gpu_all.sh's ``timeout`` signals gpu_strategy.py only; its variant runs in a session of its own, so the
    script must kill that group itself, or a timed-out variant keeps training on the GPU."""
    os.environ["GPU_ALL_BOX_S"] = "60"
    try:
        assert load_benchmark("gpu_strategy").default_budget() == 50  # 10 s left to report and stop
    finally:
        del os.environ["GPU_ALL_BOX_S"]
    child_pid = tmp_path / "child.pid"
    script = f"""
import os, sys, time
sys.path.insert(0, {str(REPO_ROOT)!r})
from tests.support.benchmark_script import load_benchmark
from argparse import Namespace
module = load_benchmark("gpu_strategy")
fake_child = {str(tmp_path / "child.sh")!r}
module.sys.executable = fake_child
module.stop_children_on_sigterm()
module.run_child(0, Namespace(devices=1, warmup=1, steps=1, peak_flops=None), timeout=300)
"""
    (tmp_path / "child.sh").write_text(f"#!/usr/bin/env bash\necho $$ > {child_pid}\nsleep 300\n")
    (tmp_path / "child.sh").chmod(0o755)
    parent = subprocess.Popen([sys.executable, "-c", script], env=clean_env())
    for _ in range(3000):  # importing torch and Lightning may take a while on a loaded machine
        if child_pid.exists() and child_pid.read_text().strip() or parent.poll() is not None:
            break
        time.sleep(0.1)
    pid = int(child_pid.read_text())
    parent.send_signal(signal.SIGTERM)
    assert parent.wait(timeout=60) == 128 + signal.SIGTERM
    for _ in range(100):
        if subprocess.run(["ps", "-o", "stat=", "-p", str(pid)], capture_output=True, text=True).stdout.strip() in ("", "Z"):
            break
        time.sleep(0.1)
    else:
        os.killpg(pid, signal.SIGKILL)
        raise AssertionError("the variant's process outlived gpu_strategy.py")


def test_gpu_strategy_reports_a_child_that_fails_with_its_error(gpu_strategy, monkeypatch):
    monkeypatch.setattr(gpu_strategy.sys, "executable", sys.executable)
    result = gpu_strategy.run_child(2, child_args(devices=0), timeout=120)  # Trainer rejects devices=0
    assert result["status"] == "failed" and result["exit"] != 0
    assert result["unshard_async_op"] is True and "devices" in result["stderr_tail"]


@pytest.fixture(scope="module")
def gpu_smoke():
    return load_benchmark("gpu_smoke")


def test_gpu_smoke_dry_run_trains_the_1t_mini_path_on_cpu(gpu_smoke, capsys):
    summary = gpu_smoke.main(["--dry-run", "--peak-flops", "1e12"])
    assert summary["steps"] == 2 and summary["seq_len"] == 1024 and summary["precision"] == "32-true"
    assert summary["mtp_layers"] == 1 and summary["doc_len"] == 256  # the recipe: MTP and documents on
    assert all(0 < loss < 10 for loss in summary["losses"])
    out = capsys.readouterr().out.splitlines()
    rows = [json.loads(line) for line in out if line.startswith('{"step"')]
    assert [row["step"] for row in rows] == [0, 1]  # one line per step, printed as it ends
    # MFU from the document-masked count: FLOPs per token below the whole-sequence causal count
    from moe_lightning.planner.flops import training_flops_per_token
    config = gpu_smoke.MoEConfig(**{**gpu_smoke.yaml.safe_load(open(gpu_smoke.CONFIG))["model"]["init_args"]["config"],
                                    "mtp_layers": 1})
    for row in rows:
        flops_per_token = row["mfu"] * 1e12 / row["tokens_per_s"]
        assert 0 < flops_per_token < training_flops_per_token(config, 1024)
        assert flops_per_token == pytest.approx(training_flops_per_token(config, 1024, doc_len=256), rel=0.02)
    table = [line for line in out if line.startswith("|")]
    assert table[0] == "| measurement | value |" and any("MFU (document-masked" in line for line in table)


def test_offload_overlap_is_measured_from_the_device_timeline(gpu_smoke):
    """Copies of the boundary size against kernels on other streams, from the profiler's Chrome trace."""
    def ev(cat, name, ts, dur, stream, nbytes=None):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur,
                "args": {"stream": stream, **({"bytes": nbytes} if nbytes else {})}}
    trace = {"traceEvents": [
        ev("kernel", "gemm", 0, 100, 7), ev("kernel", "gemm", 150, 100, 7), ev("kernel", "nccl", 90, 30, 9),
        ev("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 80, 40, 20, 4096),    # 80-120: covered 100 %
        ev("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 230, 40, 21, 4096),   # 230-270: 20 of 40 covered
        ev("gpu_memcpy", "Memcpy HtoD (Pageable -> Device)", 0, 500, 7, 64),     # other size: not offload
    ]}
    timeline = gpu_smoke.offload_timeline(trace, 4096)
    assert timeline["copies"] == 2 and timeline["overlap_fraction"] == pytest.approx(60 / 80)
    assert timeline["timeline"] == [("out", 0.08, 0.04), ("in", 0.23, 0.04)]
    assert gpu_smoke.offload_timeline(trace, 1)["overlap_fraction"] is None
    assert gpu_smoke.merged([(0, 2), (1, 3), (5, 6)]) == [(0, 3), (5, 6)]


def test_gpu_smoke_counts_every_blocking_cuda_call_and_names_the_package_frame(gpu_smoke):
    """The profiler's CUDA runtime events, as ``events()`` gives them (name, enclosing op, that op's Python
    stack, innermost first): stream, event and device synchronisation and synchronous copies count, launches
    and asynchronous copies do not; each is named by the innermost frame of this package on the nearest stack."""
    import moe_lightning
    ours = str(Path(moe_lightning.__file__).resolve().parent / "module.py")
    lightning_frame = str(Path(gpu_smoke.L.__file__).resolve().parent / "loops" / "x.py") + "(3): run"

    def event(name, parent=None, stack=()):
        return Namespace(name=name, cpu_parent=parent, stack=list(stack))
    item = event("aten::item", stack=[f"{ours}(158): _loss", lightning_frame])
    wait = event("aten::record_stream", stack=[lightning_frame])
    events = [event("cudaLaunchKernel", item), event("cudaMemcpyAsync", item), event("cudaStreamSynchronize", item),
              event("cudaEventSynchronize", wait), event("cudaDeviceSynchronize"), event("cudaMemcpy", item)]
    assert gpu_smoke.sync_sites(events) == ["module.py(158): _loss", "x.py(3): run", "unknown",
                                            "module.py(158): _loss"]


def test_gpu_attention_reports_every_shape_before_failing_on_a_relative_difference(monkeypatch, capsys):
    """A wrong kernel must still leave the numbers of both shapes (GQA, then MLA) in the log; the difference is
    relative to the reference's magnitude (outputs and gradients reach ~30 at 8k tokens: an absolute bound
    would fail on bf16 rounding alone)."""
    module = load_benchmark("gpu_attention")
    flex_attend = module.flex_attend
    monkeypatch.setattr(module, "flex_attend", lambda *args: flex_attend(*args) * 1.001)
    with pytest.raises(AssertionError, match="gqa.*mla"):
        module.main(["--dry-run", "--runs", "1"])
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == ["gqa", "mla"]
    assert all("max relative diff 1.0" in line for line in lines)  # 1e-3: the 0.1 % the stand-in kernel adds
    big = torch.full((4,), 30.0)
    assert module.relative_diff(big + 0.125, big) == pytest.approx(0.125 / 30)
