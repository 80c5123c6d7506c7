"""A stalled rank in a real 2-process ``fit`` (configs/tiny-fsdp.yaml, gloo): one rank stops itself with SIGSTOP
(``tests/launchers/stall_helpers.py``); the other names it (pid, host, mesh coordinates, phase, collective), writes
``stall-report.json`` and exits with ``EXIT_STALLED`` within the timeout plus a grace; the newest complete checkpoint
stays the one ``--ckpt_path last`` resumes. One case in the main suite, the others slow."""

import json
import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from moe_lightning.commands.main import run
from moe_lightning.run.exits import EXIT_STALLED
from moe_lightning.run.watchdog import REPORT_FILE
from moe_lightning.training.strategy import MoEFSDPStrategy
from tests.training.test_preemption import PRINT_STEPS, finish, fit_command, launch, losses, step_of, \
    wait_for_line

TIMEOUT = "--trainer.strategy.init_args.stall_timeout="  # MoEFSDPStrategy's: it adds the StallWatchdog callback
STOP = "--trainer.callbacks+=tests.launchers.stall_helpers.StopAtStep"
SMALL = ("--data.init_args.seq_len=32", "--data.init_args.batch_size=2", "--model.init_args.config.n_layers=2")
GRACE_S = 30  # publishing, polling and the exit take seconds; this machine is shared and loaded


def stalled_fit(tmp_path: Path, timeout_s: float, where: str, *extra: str, step: int = 3, rank: int = 1):
    """Run the fit until it ends; returns (exit status, output, seconds from the stop to the end, stopped pid)."""
    proc = launch(fit_command("tiny-fsdp.yaml", tmp_path, "--trainer.max_steps=60", *SMALL, PRINT_STEPS,
                              f"{TIMEOUT}{timeout_s}",
                              STOP, f"--trainer.callbacks.where={where}", f"--trainer.callbacks.step={step}",
                              f"--trainer.callbacks.rank={rank}", *extra), tmp_path)
    lines = wait_for_line(proc, "stopping rank")
    stopped_at = time.monotonic()
    pid = int(re.search(r"pid (\d+)", lines[-1]).group(1))
    rest = []
    reader = threading.Thread(target=lambda: rest.append(proc.stdout.read()))  # the pipe never fills
    reader.start()
    try:
        proc.wait(timeout=400)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
    took = time.monotonic() - stopped_at
    try:
        os.kill(pid, signal.SIGKILL)  # a stopped process nobody killed keeps the pipe open
    except ProcessLookupError:
        pass
    reader.join(60)
    return proc.returncode, "".join(lines) + "".join(rest), took, pid


def report(tmp_path: Path) -> dict:
    return json.loads(next(tmp_path.glob(f"tiny-fsdp/version_*/{REPORT_FILE}")).read_text())


def test_a_bad_stall_timeout_is_refused_at_construction():
    with pytest.raises(ValueError, match=r"^strategy\.stall_timeout=-5: .*0 turns the watchdog off"):
        MoEFSDPStrategy(stall_timeout=-5)


@pytest.mark.extended  # a 2-process fit waiting out its stall timeout
def test_a_rank_stopped_inside_the_expert_all_to_all_is_named_and_the_other_exits_with_the_stall_status(
        tmp_path, monkeypatch, capsys):
    """Rank 1 SIGSTOPs itself right after launching its first expert all-to-all of step 3. Before: rank 0 waited
    in gloo for the process group's 30 minutes, then failed naming nothing. With torch's flight recorder on (gloo
    records in torch 2.13), rank 0 dumps it beside the report, and ``moe-lightning stalls`` reads both."""
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "2000")
    status, out, took, pid = stalled_fit(tmp_path, 15, "all_to_all")
    assert status == EXIT_STALLED, out[-3000:]
    assert took < 15 + GRACE_S, out[-3000:]
    line = next(line for line in out.splitlines() if "STALLED rank 1" in line)
    assert f"pid {pid};" in line and "expert 1" in line and "step 3, phase forward, in all_to_all(" in line
    assert "has not answered for" in line
    assert re.search(r"waiting rank 0 \(host .*\): step 3, phase forward, in all_to_all", out)
    document = report(tmp_path)
    assert [(s["rank"], s["pid"], s["phase"]) for s in document["stalled"]] == [(1, pid, "forward")]
    assert document["stalled"][0]["collective"]["state"] == "entered"
    run(["stalls", str(tmp_path)])
    said = capsys.readouterr().out
    assert f"pid {pid};" in said and "flight recorder (1 rank(s) dumped)" in said  # rank 1 never dumped
    assert re.search(r"  \S+: rank 0 \(host .*\): gloo:all_to_all #\d+", said), said


# ---- slow -------------------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_the_issue_check_stop_after_step_3_timeout_30_and_the_relaunch_resumes_from_the_last_whole_checkpoint(
        tmp_path):
    """Issue 43's check, then ``--ckpt_path last`` resumes from the newest complete checkpoint (every 2 steps)."""
    folder = tmp_path / "ck"
    saves = ("--trainer.callbacks+=ModelCheckpoint", f"--trainer.callbacks.dirpath={folder}",
             "--trainer.callbacks.every_n_train_steps=2", "--trainer.callbacks.save_last=true")
    status, out, took, pid = stalled_fit(tmp_path, 30, "batch_start", *saves, step=4)
    assert status == EXIT_STALLED and took < 120, out[-3000:]
    assert f"pid {pid};" in next(line for line in out.splitlines() if "STALLED rank 1" in line)
    assert step_of(folder / "last.ckpt") == 4
    relaunch = launch(fit_command("tiny-fsdp.yaml", tmp_path, "--trainer.max_steps=6", *SMALL, "--ckpt_path=last",
                                  *saves), tmp_path)
    out = finish(relaunch)
    assert relaunch.returncode == 0, out[-3000:]
    assert f"ckpt_path=last -> {folder / 'last.ckpt'} (step 4)" in out
    assert sorted(losses(tmp_path))[-2:] == [4, 5]


@pytest.mark.slow
def test_a_rank_stopped_for_less_than_the_timeout_raises_nothing(tmp_path):
    status, out, _, _ = stalled_fit(tmp_path, 30, "batch_start", "--trainer.callbacks.seconds=12",
                                    "--trainer.max_steps=8")
    assert status == 0, out[-3000:]
    assert "stall" not in out.replace("stall_helpers", "").replace("StallWatchdog", "").lower()


@pytest.mark.extended
def test_a_rank_stopped_inside_a_checkpoint_save_leaves_the_previous_checkpoint_the_resumable_one(tmp_path):
    """Rank 1 stops in its save of step 4 (sharded, into ``.partial``); rank 0 exits; ``last`` still resolves to
    the complete step-2 checkpoint and the unfinished save is never committed."""
    folder = tmp_path / "ck"
    saves = ("--trainer.callbacks+=ModelCheckpoint", f"--trainer.callbacks.dirpath={folder}",
             "--trainer.callbacks.every_n_train_steps=2", "--trainer.callbacks.save_top_k=-1")
    status, out, took, pid = stalled_fit(tmp_path, 15, "save", *saves, step=4)
    assert status == EXIT_STALLED and took < 15 + GRACE_S, out[-3000:]
    assert "phase checkpoint" in next(line for line in out.splitlines() if "STALLED rank 1" in line)
    assert sorted(p.name for p in folder.glob("*.ckpt*")) == ["epoch=0-step=2.ckpt"]  # no step 4, whole or not
    relaunch = launch(fit_command("tiny-fsdp.yaml", tmp_path, "--trainer.max_steps=5", *SMALL, "--ckpt_path=last",
                                  *saves), tmp_path)
    out = finish(relaunch)
    assert relaunch.returncode == 0 and "(step 2)" in out, out[-3000:]
    assert not list(folder.glob("*.partial"))


@pytest.mark.extended
def test_a_stopped_data_loader_worker_names_its_live_rank_in_the_data_phase(tmp_path):
    status, out, took, _ = stalled_fit(tmp_path, 15, "data_worker", "--data.init_args.num_workers=1")
    assert status == EXIT_STALLED and took < 15 + GRACE_S, out[-3000:]
    line = next(line for line in out.splitlines() if "STALLED rank 1" in line)
    assert "phase data" in line and "training thread made no progress" in line


@pytest.mark.extended
def test_a_stopped_main_process_serving_the_store_is_named_by_the_child_which_ends_the_job(tmp_path):
    """Rank 0 serves the rendezvous store and is the job's main process: rank 1 (Lightning's child) names it from
    the last records it read, kills it (nothing else would end the job) and exits."""
    status, out, took, pid = stalled_fit(tmp_path, 15, "batch_start", rank=0)
    assert status == -signal.SIGKILL and took < 15 + GRACE_S + 10, out[-3000:]
    line = next(line for line in out.splitlines() if "STALLED rank 0" in line)
    assert f"pid {pid};" in line and "serves the rendezvous store" in line


@pytest.mark.extended
def test_sigterm_with_the_watchdog_on_saves_and_exits_143_as_without(tmp_path):
    proc = launch(fit_command("tiny-fsdp.yaml", tmp_path, "--trainer.max_steps=40", *SMALL, PRINT_STEPS,
                              f"{TIMEOUT}15"), tmp_path)
    wait_for_line(proc, "trained step 2")
    proc.send_signal(signal.SIGTERM)  # the main process only: rank 1 learns it from the flag all-reduce
    out = finish(proc)
    assert proc.returncode == 128 + signal.SIGTERM, out[-3000:]
    assert "preempted at step" in out and "stall" not in out.lower().replace("stallwatchdog", "")


@pytest.mark.extended
def test_a_rank_stopped_inside_an_fsdp_reduce_scatter_is_named_in_its_backward(tmp_path):
    status, out, took, pid = stalled_fit(tmp_path, 15, "reduce_scatter")
    assert status == EXIT_STALLED and took < 15 + GRACE_S, out[-3000:]
    line = next(line for line in out.splitlines() if "STALLED rank 1" in line)
    assert f"pid {pid};" in line and "step 3, phase backward" in line


@pytest.mark.extended
def test_on_four_ranks_the_stopped_one_is_named_with_its_mesh_coordinates(tmp_path):
    """4 gloo processes, EP 2 inside a shard group of 4: rank 2 is expert rank 0 of expert-shard 1."""
    status, out, took, pid = stalled_fit(tmp_path, 20, "all_to_all", "--trainer.devices=4", rank=2)
    assert status == EXIT_STALLED and took < 20 + GRACE_S, out[-3000:]
    line = next(line for line in out.splitlines() if "STALLED rank 2" in line)
    assert f"pid {pid}; replicate 0, shard 2," in line and ", expert 0, expert_shard 1" in line
    assert out.count("waiting rank") == 3
