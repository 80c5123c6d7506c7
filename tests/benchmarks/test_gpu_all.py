"""The GPU benchmark driver cannot lose results: failures and time-outs are reported, the other parts still run.

``gpu_all.sh`` is run for real with a stand-in ``python`` on PATH whose behaviour per script is chosen by the
test (succeed, fail, hang), so the driver's budget, time boxes and exit status are checked without a GPU.
"""

import inspect
import itertools
import json
import math
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
# stand-in interpreter: "-" (the machine facts) prints a line; a part behaves as $BEHAVIOUR_<script name> says
[[ $1 == - ]] && { cat >/dev/null; echo "torch fake"; exit 0; }
name=$(basename "$1" .py)
alloc=${PYTORCH_CUDA_ALLOC_CONF:-}
echo "{\\"part\\": \\"$name\\", \\"box_s\\": $GPU_ALL_BOX_S, \\"args\\": \\"${*:2}\\", \\"alloc\\": \\"$alloc\\"}"
case $(printenv "BEHAVIOUR_$name") in
  fail) echo "{\\"part\\": \\"$name\\", \\"status\\": \\"failed\\"}"; exit 3 ;;
  hang) echo "figure: $name | early | t | PASS"; sleep 60 ;;
  *) echo "figure: $name | 42 things | >= 1 | PASS" ;;
esac
"""
ORDER = ["paths", "recipe", "attention", "compile", "offload", "muon", "strategy", "ep_chunks"]
SCRIPTS = ["gpu_paths", "gpu_recipe", "gpu_attention", "gpu_compile", "gpu_offload", "gpu_muon", "gpu_strategy",
           "gpu_ep_chunks"]


def run_gpu_all(tmp_path: Path, *args: str, python: str | None = None, **env: str) -> subprocess.CompletedProcess:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    fake = bin_dir / "python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    behaviour = {f"BEHAVIOUR_{k}": v for k, v in env.items() if not k.isupper()}
    env = clean_env(PYTHON=python or str(fake), OUT=str(tmp_path / "out"), PYTORCH_CUDA_ALLOC_CONF="",
                    GPU_ALL_CACHE=str(tmp_path / "cache"), GPU_ALL_CARRIED=str(tmp_path / "carried"),
                    **behaviour, **{k: v for k, v in env.items() if k.isupper()})
    return subprocess.run(["bash", str(REPO_ROOT / "benchmarks" / "gpu_all.sh"), *args], env=env,
                          capture_output=True, text=True, timeout=300)


def parts_run(stdout: str) -> list[str]:
    return [line.split("--- ")[1].split(" ")[0] for line in stdout.splitlines() if line.startswith("gpu_all: --- ")]


def table(stdout: str) -> list[str]:
    return [line for line in stdout.splitlines() if line.startswith("| ")]


def part_log(tmp_path: Path, name: str) -> list[str]:
    """The lines ``name`` printed, from the one log of every part."""
    lines = (tmp_path / "out" / "gpu_all.log").read_text().splitlines()
    start = lines.index(next(line for line in lines if line.startswith(f"=== {name} ("))) + 1
    return list(itertools.takewhile(lambda line: not line.startswith("=== "), lines[start:]))


def test_gpu_all_runs_every_part_reports_failures_in_one_table_and_exits_nonzero(tmp_path):
    done = run_gpu_all(tmp_path, gpu_preflight="ok", gpu_muon="fail")
    assert parts_run(done.stdout) == ORDER  # the path check first, then the recipe, then by value
    assert "gpu_all: muon: FAILED (exit 3)" in done.stdout and "gpu_all: strategy: ok in " in done.stdout
    assert done.returncode == 1 and "FAILED PARTS: muon:exit3" in done.stdout
    assert "GPU_ALL_PARTS=muon bash benchmarks/gpu_all.sh" in done.stdout  # the rerun, spelled out
    assert json.loads(part_log(tmp_path, "strategy")[0])["box_s"] == 40  # told its time box
    boxes = [int(line.split("time box ")[1].split(" ")[0]) for line in done.stdout.splitlines() if "time box" in line]
    assert sum(boxes) == 460  # with start-up (~15 s) inside the 500 s budget; cache packing after, within a 600 s call
    assert "budget 500 s" in done.stdout.splitlines()[0]
    # one table: the machine facts first, then a row per part (its figure, or why it has none)
    rows = table(done.stdout)
    assert rows[0] == "| part | key number | target | pass/fail | outcome |"
    assert [row.split(" | ")[0][2:] for row in rows[2:]] == [  # the stand-in names its figure by its script
        name if name != "gpu_muon" else "muon" for name in SCRIPTS]
    assert rows[2].startswith("| gpu_paths | 42 things | >= 1 | PASS | ok in ")
    assert rows[7].startswith("| muon | (no figure) | - | FAIL | FAILED (exit 3)")
    report = (tmp_path / "out" / "gpu_all.md").read_text()
    assert report.index("torch fake") < report.index("start-up: ") < report.index("| part | key number")
    assert [line.split()[1] for line in (tmp_path / "out" / "gpu_all.log").read_text().splitlines()
            if line.startswith("=== ")] == ORDER  # every part's lines, in order
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["gpu_all.log", "gpu_all.md"]  # nothing compiled
    # expandable segments for every part but the one that reports the default allocator's retries
    allocators = {name: json.loads(part_log(tmp_path, name)[0])["alloc"] for name in ORDER}
    assert allocators == {name: "" if name == "strategy" else "expandable_segments:True" for name in ORDER}


def test_gpu_all_packs_no_cache_piece_when_nothing_was_compiled(tmp_path):
    """Importing torch creates the Inductor and Triton cache folders; empty, they are not a cache to bring back
    (tar of the empty folders made a 172-byte compile_cache.tgz.0)."""
    for folder in ("inductor", "triton/cache"):
        (tmp_path / "cache" / folder).mkdir(parents=True)
    done = run_gpu_all(tmp_path, GPU_ALL_PARTS="muon")
    assert "compile cache: empty (nothing compiled)" in done.stdout
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["gpu_all.log", "gpu_all.md"]


def test_gpu_all_brings_the_compile_cache_back_in_pieces_the_device_returns_and_unpacks_it_when_carried(tmp_path):
    """A full run leaves room for the cache: 2 files of results, then the cache gzipped in 15 MiB pieces (at most
    3, so the carried tree stays under the 64 MiB a call sends); carried back in .gpu_cache/, it is unpacked before
    any part runs; past 45 MiB it is not kept, and the report says so."""
    cache = tmp_path / "cache" / "triton"
    cache.mkdir(parents=True)
    kernel = os.urandom(20 << 20)  # incompressible: two pieces
    (cache / "kernel.cubin").write_bytes(kernel)
    done = run_gpu_all(tmp_path)
    out = tmp_path / "out"
    files = sorted(p.name for p in out.iterdir())
    assert files == ["compile_cache.tgz.0", "compile_cache.tgz.1", "gpu_all.log", "gpu_all.md"]
    assert all((out / name).stat().st_size <= 16 << 20 for name in files)
    assert "in 2 piece(s)" in done.stdout
    carried = tmp_path / "carried"
    carried.mkdir()
    for name in files[:2]:
        (carried / name).write_bytes((out / name).read_bytes())
    (tmp_path / "cache" / "triton" / "kernel.cubin").unlink()  # a fresh machine: nothing compiled there
    done = run_gpu_all(tmp_path, GPU_ALL_PARTS="muon")
    assert "compile cache: unpacked " in done.stdout.splitlines()[1]  # before the machine facts and every part
    assert (cache / "kernel.cubin").read_bytes() == kernel
    (cache / "kernel.cubin").unlink()
    (carried / "compile_cache.tgz.2").write_bytes(os.urandom(1024))  # a piece of another run
    done = run_gpu_all(tmp_path, GPU_ALL_PARTS="muon")
    assert "do not unpack (pieces of two runs, or one missing): not used" in done.stdout
    assert not (cache / "kernel.cubin").exists()  # nothing half-unpacked
    for piece in carried.iterdir():
        piece.unlink()
    (cache / "big.bin").write_bytes(os.urandom(46 << 20))
    done = run_gpu_all(tmp_path, GPU_ALL_PARTS="muon")
    assert "MiB packed, over 45 MiB: not kept" in done.stdout
    assert sorted(p.name for p in out.iterdir()) == ["gpu_all.log", "gpu_all.md"]


def test_gpu_all_skips_only_the_compiled_parts_when_triton_cannot_build_its_launcher(tmp_path):
    done = run_gpu_all(tmp_path, gpu_preflight="fail")
    assert parts_run(done.stdout) == ["offload", "muon", "strategy", "ep_chunks"]
    for name in ("paths", "recipe", "attention", "compile"):
        assert f"gpu_all: {name}: skipped: Triton cannot build its launcher" in done.stdout
    assert done.returncode == 1 and "paths:no-compiler" in done.stdout


def test_gpu_all_exits_zero_only_when_every_part_succeeded(tmp_path):
    done = run_gpu_all(tmp_path)
    assert done.returncode == 0 and done.stdout.splitlines()[-1] == "gpu_all: all parts ok"


@pytest.mark.extended
def test_gpu_all_time_boxes_a_hanging_part_keeps_its_early_figure_and_skips_what_the_budget_cannot_hold(tmp_path):
    done = run_gpu_all(tmp_path, "17", gpu_paths="hang")
    assert "gpu_all: paths: TIMEOUT after 17 s" in done.stdout
    assert "| gpu_paths | early | t | PASS | TIMEOUT after 17 s (CPU " in done.stdout  # printed before the hang, kept
    assert "gpu_all: strategy: skipped: " in done.stdout and done.returncode == 1


def test_gpu_all_parts_selects_the_parts_to_rerun_and_refuses_an_unknown_one(tmp_path):
    done = run_gpu_all(tmp_path, "--dry-run", GPU_ALL_PARTS="muon,paths")
    assert parts_run(done.stdout) == ["paths", "muon"] and done.returncode == 0  # in the table's order
    assert json.loads(part_log(tmp_path, "muon")[0])["args"] == "--dry-run"
    assert "gpu_preflight" not in (tmp_path / "out" / "gpu_all.md").read_text()  # a dry run compiles nothing
    done = run_gpu_all(tmp_path, GPU_ALL_PARTS="muon,nope")
    assert done.returncode == 2 and "unknown part 'nope'" in done.stdout


def test_gpu_all_list_prints_each_parts_box_and_the_recipe_the_card_holds_without_a_gpu(tmp_path):
    """``--list --gpu-memory 80``: an H100 80 GB gets a recipe of >= 1B active parameters whose planned peak (from
    ``plan``) stays within 92 % of 80 GiB; each box is written with its cold-start estimate."""
    done = run_gpu_all(tmp_path, "--list", "--gpu-memory", "80", python=sys.executable)
    lines = done.stdout.splitlines()
    assert done.returncode == 0 and [line.split()[0] for line in lines if line[0] != " "][:8] == ORDER
    assert lines[0].split()[1:3] == ["45", "s"] and lines[1].strip().startswith("box: imports ")  # with its estimate
    recipe = next(line for line in lines if line.startswith("recipe, "))
    active = float(recipe.split(" active")[0].split(", ")[-1].rstrip("B"))
    peak = float(recipe.split("planned peak ")[1].split(" GiB")[0])
    memory = float(recipe.split(" GiB of ")[1].split(" GiB")[0])
    assert active >= 1.0 and memory == 80.0 and peak <= 0.92 * memory
    assert recipe.startswith("recipe, 16 blocks: 5.11B parameters, 1.24B active, sequence 8192 x batch 2")
    assert lines[-1].startswith("boxes: 460 s of a 500 s budget")
    assert not (tmp_path / "out").exists()  # nothing run, nothing written


def test_preflight_names_what_triton_lacks_in_one_line(monkeypatch, tmp_path, capsys):
    preflight = load_benchmark("gpu_preflight")
    # the documented search rule, whether or not this torch ships Triton (its own libcuda_dirs caches its first
    # answer and fails without a driver): importing it fails here, as where Triton is absent
    monkeypatch.setitem(sys.modules, "triton", None)
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


@pytest.fixture(scope="module")
def gpu_strategy():
    return load_benchmark("gpu_strategy")


def child_args(**overrides) -> Namespace:
    return Namespace(**({"devices": 1, "warmup": 1, "steps": 1, "peak_flops": None} | overrides))


def test_gpu_strategy_reports_a_child_that_runs_out_of_time(gpu_strategy):
    result = gpu_strategy.run_child(0, child_args(), timeout=0.5)
    assert result["status"] == "timeout" and result["unshard_async_op"] is False and result["prefetch_depth"] == 1


@pytest.mark.extended
def test_gpu_strategy_budget_follows_the_time_box_and_sigterm_kills_the_child_group(tmp_path):
    """gpu_all.sh's ``timeout`` signals gpu_strategy.py only; its variant runs in a session of its own, so the
    script must kill that group itself, or a timed-out variant keeps training on the GPU."""
    os.environ["GPU_ALL_BOX_S"] = "60"
    try:
        assert load_benchmark("gpu_strategy").default_budget() == 55  # 5 s left to report and stop
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


def test_gpu_strategy_gives_its_variant_what_is_left_of_the_box_from_process_start(gpu_strategy, monkeypatch):
    """The time box counts from the process's start: 20 s spent on imports, CUDA's start and the fit check leave the
    one variant of a 40 s box 40 - 5 - 20 = 15 s, not 35 s (gpu_all.sh's timeout then killed the parent first, with
    no line printed)."""
    monkeypatch.setenv("GPU_ALL_BOX_S", "40")
    monkeypatch.setattr(gpu_strategy, "STARTED", time.monotonic() - 20)
    monkeypatch.setattr(gpu_strategy.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gpu_strategy, "card_memory_gib", lambda: (80.0, "stand-in"))
    monkeypatch.setattr(gpu_strategy, "check_fits", lambda *args: None)
    monkeypatch.setattr(gpu_strategy, "stop_children_on_sigterm", lambda: None)
    timeouts = []
    monkeypatch.setattr(gpu_strategy, "run_child", lambda index, args, timeout: timeouts.append(timeout) or {
        **gpu_strategy.VARIANTS[index], "status": "ok", "tokens_per_s": 1.0})
    gpu_strategy.main(["--devices", "1"])
    assert len(timeouts) == 1 and 14 <= timeouts[0] <= 15


def test_gpu_strategy_times_each_step_and_leaves_out_the_fit_teardown(gpu_strategy, monkeypatch):
    """Each step after the warm-up is timed from its batch start to its batch end (a clock that advances 1, 2, 3 s
    over steps 1-3); what comes after the last batch (teardown: 100 s here) is in none of them."""
    clock = [0.0]
    monkeypatch.setattr(gpu_strategy.time, "perf_counter", lambda: clock[0])
    timer, cpu = gpu_strategy.StepTimer(warmup=1), Namespace(device=torch.device("cpu"))
    for batch_idx, seconds in enumerate([50.0, 1.0, 2.0, 3.0]):
        timer.on_train_batch_start(None, cpu, None, batch_idx)
        clock[0] += seconds
        timer.on_train_batch_end(None, cpu, None, None, batch_idx)
        clock[0] += 0.5  # between steps: the loop's own work
    clock[0] += 100.0
    assert timer.step_s == [1.0, 2.0, 3.0]
    line = gpu_strategy.figure_line([{"tokens_per_s": 10.0, "timed_steps": 3, "step_s_min": 1.0, "step_s_max": 3.0,
                                      "mfu": 0.25}])
    assert "10 tokens/s (median of 3 steps, 1.000-3.000 s), MFU 25.0%" in line and line.endswith("PASS")


@pytest.mark.slow
def test_gpu_strategy_reports_a_child_that_fails_with_its_error(gpu_strategy, monkeypatch):
    monkeypatch.setattr(gpu_strategy.sys, "executable", sys.executable)
    monkeypatch.setenv("PYTHONPATH", str(REPO_ROOT))  # as gpu_all.sh exports it: the package need not be installed
    result = gpu_strategy.run_child(2, child_args(devices=0), timeout=120)  # Trainer rejects devices=0
    assert result["status"] == "failed" and result["exit"] != 0
    assert result["unshard_async_op"] is True and "devices" in result["stderr_tail"]


def test_gpu_attention_prints_its_figure_after_the_mla_shape_and_fails_on_a_relative_difference(monkeypatch, capsys):
    """The recipe's MLA shape first, its figure at once (a time-out in the GQA shape keeps it); a wrong kernel
    still leaves both shapes' numbers before the failure; the difference is relative to the reference's magnitude
    (outputs and gradients reach ~30 at 8k tokens: an absolute bound would fail on bf16 rounding alone); the
    kernel is called for its max scores, as QK-clip makes the recipe call it."""
    module = load_benchmark("gpu_attention")
    attend, calls = module.attend, []

    def wrong(*args, **kwargs):  # q, k, v in the model's layout: [B, S, H, D] tensors seen as [B, H, S, D]
        calls.append(kwargs.get("return_max_logits") and all(
            not t.is_contiguous() and t.transpose(1, 2).is_contiguous() for t in args[:3]))
        out, max_logits_H = attend(*args, **kwargs)
        return out * 1.001, max_logits_H
    monkeypatch.setattr(module, "attend", wrong)
    with pytest.raises(AssertionError, match="mla.*gqa"):
        module.main(["--dry-run", "--runs", "1"])
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == ["mla", "figure", "gqa"]
    assert all("max relative diff 1.0" in line for line in (lines[0], lines[2]))  # the stand-in's 0.1 %
    assert lines[1].startswith("figure: attention | MLA 2 x 96: FlexAttention + max scores ")
    assert lines[1].endswith("| FAIL")
    assert calls and all(calls)
    big = torch.full((4,), 30.0)
    assert module.relative_diff(big + 0.125, big) == pytest.approx(0.125 / 30)


def test_gpu_paths_dry_run_passes_every_check_and_names_a_failure_with_its_error_and_the_ln2_rescaling(capsys,
                                                                                                        monkeypatch):
    paths = load_benchmark("gpu_paths")
    outcome = paths.main(["--dry-run"])
    lines = capsys.readouterr().out.splitlines()
    assert outcome == dict.fromkeys(["grouped_mm", "offload", "host_ns", "all_to_all", "flex_S", "flex_S-1"], "PASS")
    checks = [line for line in lines if line.startswith("paths: ")]
    assert len(checks) == 6 and all(line.split()[1] == "PASS" and line.split()[4] == "s)" for line in checks)
    assert lines[-1] == "figure: paths | 6/6 checks pass | all 6 | PASS"
    # a figure before the compiled FlexAttention checks: a time-out there keeps what passed
    assert lines.index("figure: paths | 4/6 checks pass, 2 pending | all 6 | FAIL") < lines.index(checks[4])
    # a kernel whose max scores come back divided by ln 2 (torch 2.11's AuxRequest rescaling): named; later checks run
    attend = paths.attend
    monkeypatch.setattr(paths, "attend", lambda *a, **k: (lambda out, m: (out, m / math.log(2)))(*attend(*a, **k)))
    monkeypatch.setattr(paths, "check_grouped_mm", lambda *a: 1 / 0)
    outcome = paths.main(["--dry-run"])
    lines = capsys.readouterr().out.splitlines()
    assert outcome["grouped_mm"] == "FAIL" and outcome["offload"] == "PASS" and outcome["flex_S"] == "FAIL"
    assert any(line.startswith("paths: FAIL grouped_mm (") and "ZeroDivisionError" in line for line in lines)
    flex = next(line for line in lines if line.startswith("paths: FAIL flex_S ("))
    assert "median ratio 1.4427 (= 1/ln 2: torch 2.11 rescales AuxRequest.max_scores)" in flex
    assert lines[-1].endswith("(failed: grouped_mm, flex_S, flex_S-1) | all 6 | FAIL")


def test_gpu_paths_reaches_nccl_group_creation_with_a_device_id_torch_accepts(monkeypatch, tmp_path):
    """On a stand-in accelerator (this CPU build has none), the all-to-all check passes ``init_process_group`` a
    ``device_id`` that its own validation accepts (one with an index: ``torch.device("cuda")`` raised "Please use a
    device_id with index" on every GPU run) and reaches the NCCL group's creation with it."""
    paths = load_benchmark("gpu_paths")
    c10d = torch.distributed.distributed_c10d
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)  # older torch checks the index against this
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *a, **k: torch.device("cuda"))
    monkeypatch.setattr(torch.accelerator, "device_count", lambda: 1)
    reached = {}

    class Reached(Exception):
        pass

    signature = inspect.signature(c10d._new_process_group_helper)

    def new_group(*args, **kwargs):  # where torch creates the backend's process group
        given = signature.bind(*args, **kwargs).arguments
        reached.update(backend=str(given["backend"]), device_id=given.get("device_id"))
        raise Reached
    monkeypatch.setattr(c10d, "_new_process_group_helper", new_group)
    device = paths.compute_device(cuda=True)
    with pytest.raises(Reached):
        paths.check_all_to_all(device, tmp_path / "store")
    assert reached == {"backend": "nccl", "device_id": torch.device("cuda", 0)}
    monkeypatch.setattr(c10d, "_new_process_group_helper", lambda *a, **k: 1 / 0)
    with pytest.raises(ValueError, match="device_id with index"):  # what the device without an index met
        paths.check_all_to_all(torch.device("cuda"), tmp_path / "store2")


def test_gpu_ep_chunks_dry_run_times_every_mode_with_one_host_read_and_equal_outputs(capsys):
    """The GPU part's code end to end on CPU (a one-rank gloo group, tiny shapes): every mode timed, one host read
    per forward, chunked outputs equal the unchunked within fp32 sum order (1e-5), FP8 dispatch within e4m3's
    2^-3 step; the figure once 4 chunks are measured (a time-out in FP8 keeps it), again with FP8's ratio last."""
    results = load_benchmark("gpu_ep_chunks").main(["--dry-run"])
    assert list(results) == ["chunks1", "chunks2", "chunks4", "chunks4_fp8"]
    assert all(r["host_reads_per_forward"] == 1 and r["median_ms"] > 0 for r in results.values())
    assert max(results[m]["relative_difference_vs_chunks1"] for m in ("chunks2", "chunks4")) <= 1e-5
    assert 0 < results["chunks4_fp8"]["relative_difference_vs_chunks1"] < 2 ** -3
    lines = capsys.readouterr().out.splitlines()
    figure = "figure: ep_chunks | one MoE layer fwd+bwd"
    assert [line.split(",")[0] for line in lines] == [
        '{"mode": "chunks1"', '{"mode": "chunks2"', '{"mode": "chunks4"', figure, '{"mode": "chunks4_fp8"', figure]
    assert "FP8 dispatch" not in lines[3] and "FP8 dispatch x" in lines[5] and "<= 1.10x" in lines[5]


def test_gpu_ep_chunks_sets_an_indexed_cuda_device_before_its_nccl_group(monkeypatch):
    """On a stand-in accelerator, the GPU path passes ``torch.cuda.set_device`` a device torch's own index check
    accepts (a bare ``torch.device("cuda")`` raised "Expected a torch.device with a specified index") and goes on to
    the NCCL group."""
    module = load_benchmark("gpu_ep_chunks")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    set_to = []
    monkeypatch.setattr(torch._C, "_cuda_setDevice", set_to.append, raising=False)  # absent from a CPU build

    class Reached(Exception):
        pass

    def group(backend):
        raise Reached(backend)
    monkeypatch.setattr(module, "one_rank_group", group)
    with pytest.raises(Reached, match="nccl"):
        module.main([])
    assert set_to == [0]


@pytest.fixture(scope="module")
def gpu_muon():
    return load_benchmark("gpu_muon")


def test_gpu_muon_takes_one_gpus_share_of_the_1t_experts_from_the_config(gpu_muon):
    """configs/1t.yaml: 61 layers of which 6 dense, 384 experts, expert parallel 96 over 384 GPUs, so each GPU holds
    384 / 96 / 4 = 1 expert of each MoE layer whole: 55 x 3 matrices (gate and up 2048 x 7168, down 7168 x 2048)."""
    shapes = gpu_muon.expert_shard_shapes(gpu_muon.REPO / "configs" / "1t.yaml")
    assert len(shapes) == 55 * 3 and sorted(set(shapes)) == [(2048, 7168), (7168, 2048)]


def test_gpu_muon_scales_the_host_time_by_newton_schulz_flops(gpu_muon, monkeypatch):
    """The host runs what fits in its time and the rest is scaled by FLOPs: on a clock that advances one second per
    GFLOP, the scaled time is the FLOPs of every matrix; drawing the inputs (1000 s each here) is outside it."""
    clock = [0.0]
    monkeypatch.setattr(gpu_muon.time, "perf_counter", lambda: clock[0])
    randn = torch.randn

    def slow_randn(*args, **kwargs):
        clock[0] += 1000.0
        return randn(*args, **kwargs)
    monkeypatch.setattr(gpu_muon.torch, "randn", slow_randn)

    def newton_schulz(G, schedule, dtype):
        clock[0] += gpu_muon.newton_schulz_flops(*G.shape[-2:], len(schedule)) / 1e9
    monkeypatch.setattr(gpu_muon, "newton_schulz", newton_schulz)
    shapes = [(64, 256), (256, 64), (128, 512)]
    seconds, done, _ = gpu_muon.time_host_ns(shapes, threads=1, seconds=1e-12)
    assert done == 1 and seconds == pytest.approx(sum(gpu_muon.newton_schulz_flops(*s, 5) for s in shapes) / 1e9)


def test_gpu_muon_dry_run_prints_the_ns_figure_then_both_optimizer_steps(gpu_muon, capsys):
    report = gpu_muon.main(["--dry-run"])
    shard = report["ns_1t"]
    assert shard["matrices"] == 2 * 3 * 4  # configs/1t-mini.yaml: 2 MoE layers, 8 experts over expert parallel 2
    assert shard["device_s"] > 0 and shard["host_s"] > 0 and shard["host_matrices_run"] >= 1
    assert shard["device_with_pinned_round_trip_s"] > 0
    step = report["step"]
    assert step["weights"] == "fp32 master weights, fp32 gradients"
    assert all(step[name]["min_ms"] <= step[name]["median_ms"] <= step[name]["max_ms"] for name in ("muon", "adamw"))
    lines = capsys.readouterr().out.splitlines()
    assert [line[:10] for line in lines] == ['{"ns_1t": ', "figure: mu", '{"step": {']
    assert "reference run 41.7 s vs 2.2 s (with copies)" in lines[1] and "s with the pinned host round trip" in lines[1]


@pytest.mark.extended
def test_gpu_compile_dry_run_traces_the_blocks_and_compares_with_eager(capsys):
    results = load_benchmark("gpu_compile").main(["--dry-run"])
    assert set(results) == {"eager", "compiled"}
    assert all(r["tokens_per_s"] > 0 and r["min_s"] <= r["step_s"] <= r["max_s"] for r in results.values())
    lines = capsys.readouterr().out.splitlines()
    assert [json.loads(line)["mode"] for line in (lines[0], lines[2])] == ["eager", "compiled"]
    assert lines[1].startswith("figure: compile | eager ") and lines[1].endswith("| FAIL")  # provisional
    assert lines[3].startswith("figure: compile | compiled blocks ") and "compile " in lines[3]


def test_gpu_compile_prints_eagers_figure_before_compiling(monkeypatch, capsys):
    """Inductor's cold compile may outlast the part's time box: the eager figure (provisional, no verdict) is out
    before ``compile_blocks`` is called, so a time-out there still leaves a figure line."""
    module = load_benchmark("gpu_compile")

    class Compiling(Exception):
        pass

    def compile_blocks(*args, **kwargs):
        raise Compiling
    monkeypatch.setattr(module, "compile_blocks", compile_blocks)
    monkeypatch.setattr(module, "run_mode", lambda *args: {"tokens_per_s": 1234.0, "step_s": 1.0})
    with pytest.raises(Compiling):
        module.main(["--dry-run"])
    lines = capsys.readouterr().out.splitlines()
    assert lines == ['{"mode": "eager", "tokens_per_s": 1234.0, "step_s": 1.0}',
                     "figure: compile | eager 1,234 tokens/s; compiled not measured (provisional: the compile did not "
                     "finish) | compiled >= eager | FAIL"]
