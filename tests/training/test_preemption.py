"""Preemption (``training/callbacks/preemption.py``): a signal saves and exits non-zero, a relaunch of the same
command resumes by itself (``--ckpt_path last``), ``max_time`` exits 75; one and two real processes."""

import csv
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

from moe_lightning.commands.main import run
from moe_lightning.checkpoint.commit import METADATA_FILE
from moe_lightning.run.exits import EXIT_MAX_TIME
from moe_lightning.training.callbacks.preemption import Preemption
from tests.support.distributed import REPO_ROOT, clean_env, free_port
from tests.training.test_safety import quick

CONFIGS = REPO_ROOT / "configs"
SIGNAL_AT = "--trainer.callbacks+=tests.support.preemption_helpers.SignalAtStep"
SMALLER = ("--data.init_args.seq_len=32", "--data.init_args.batch_size=2", "--data.init_args.max_tokens=8000",
           "--model.init_args.config.n_layers=2")  # ~4 s of CPU per run instead of ~15


def losses(root: Path, pattern: str = "*/version_*/metrics.csv") -> dict[int, float]:
    """Per-step training loss over every ``version_*`` of a logger folder (a resumed run logs in its own)."""
    found = {}
    for metrics in sorted(root.glob(pattern)):
        for row in csv.DictReader(open(metrics)):
            if row.get("train/loss"):
                found[int(row["step"])] = float(row["train/loss"])
    return found


def step_of(path: Path) -> int:
    file = path / METADATA_FILE if path.is_dir() else path
    return torch.load(file, map_location="cpu", weights_only=True, mmap=True)["global_step"]


# ---- 1 + 2, one process, in the main suite ------------------------------------------------------------------

def test_sigterm_saves_exits_nonzero_and_the_identical_command_resumes_exactly(tmp_path, lightning_log, capfd):
    """Before: "Bypassing SIGTERM", no checkpoint, exit 0; `--ckpt_path last` looked only in the new version_N."""
    steps = ("--trainer.max_steps=5", "--trainer.log_every_n_steps=1", "--trainer.callbacks=[]",  # no monitors
             "--trainer.accumulate_grad_batches=2", *SMALLER)  # the save waits for the step's last micro-batch
    run(quick(tmp_path / "reference", *steps))
    command = quick(tmp_path / "job", *steps, "--ckpt_path=last", SIGNAL_AT, "--trainer.callbacks.step=2",
                    "--trainer.callbacks.times=2")  # delivered twice at once, as `timeout` does: one request
    def users_handler(signum, frame):
        raise AssertionError("the run's handler should have had it")

    previous = signal.signal(signal.SIGTERM, users_handler)
    try:
        with pytest.raises(SystemExit) as stopped:
            run(command)  # SIGTERM (real ones, to this process) when step 2 starts
        assert signal.getsignal(signal.SIGTERM) is users_handler  # restored after the run
    finally:
        signal.signal(signal.SIGTERM, previous)
    checkpoint = tmp_path / "job" / "tiny" / "version_0" / "checkpoints" / "last.ckpt"
    assert stopped.value.code == 128 + signal.SIGTERM
    assert str(stopped.value) == f"preempted at step 3, checkpoint at {checkpoint}"
    assert capfd.readouterr().err.strip().endswith(str(stopped.value))
    assert step_of(checkpoint) == 3  # step 2 was finished, then saved
    assert any("found no complete checkpoint" in m and "starting from scratch" in m for m in lightning_log)

    cli = run(command)  # the identical command, relaunched
    assert cli.trainer.global_step == 5
    assert any(f"ckpt_path=last -> {checkpoint} (step 3)" in m for m in lightning_log)
    resumed, reference = losses(tmp_path / "job"), losses(tmp_path / "reference")
    assert sorted(resumed) == sorted(reference) == list(range(5))
    assert resumed == pytest.approx(reference, abs=1e-6)



@pytest.mark.parametrize("save_last", [True, False])
def test_a_relaunch_after_a_preemption_before_the_first_periodic_save_leaves_last_ckpt_newest(tmp_path, save_last):
    """Issue 33, item 2. A ``ModelCheckpoint`` with a fixed ``dirpath``, preempted at step 3 before its first
    periodic save (every 100 steps); the relaunch resumes and ends at step 5. Before, with ``save_last``: the
    relaunch wrote ``last-v1.ckpt`` (step 5) and left ``last.ckpt`` at step 3, which generate/export then read
    silently (the preemption save had not told the callback that ``last.ckpt`` was its own). Without ``save_last``
    nothing rewrites ``last.ckpt``: the run says which file is newest."""
    folder = tmp_path / "ck"
    command = quick(tmp_path / "job", *SMALLER, "--trainer.max_steps=5", "--ckpt_path=last",
                    "--trainer.callbacks=[]", "--trainer.callbacks+=ModelCheckpoint",
                    f"--trainer.callbacks.dirpath={folder}", "--trainer.callbacks.every_n_train_steps=100",
                    f"--trainer.callbacks.save_last={str(save_last).lower()}", SIGNAL_AT, "--trainer.callbacks.step=2")
    with pytest.raises(SystemExit) as stopped:
        run(command)
    assert stopped.value.code == 128 + signal.SIGTERM and step_of(folder / "last.ckpt") == 3
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        cli = run(command)  # the identical command, relaunched: resumes from last.ckpt and finishes
    assert cli.trainer.global_step == 5
    assert sorted(p.name for p in folder.glob("*.ckpt")) == ["epoch=0-step=5.ckpt", "last.ckpt"]
    newest = folder / "epoch=0-step=5.ckpt"
    note = (f"{folder / 'last.ckpt'} holds step 3 (saved when an earlier run was stopped); the newest weights are "
            f"{newest} (step 5): pass that file to generate or export.")
    assert (note in [str(w.message) for w in said]) != save_last
    if save_last:
        assert step_of(folder / "last.ckpt") == 5
        final = torch.load(newest, map_location="cpu", weights_only=True)["state_dict"]
        last = torch.load(folder / "last.ckpt", map_location="cpu", weights_only=True)["state_dict"]
        assert final.keys() == last.keys() and all(torch.equal(final[k], last[k]) for k in final)


def test_sigterm_while_the_model_is_built_says_there_is_nothing_to_save_and_exits_143(tmp_path, capfd,
                                                                                     lightning_log):
    """Issue 26, item 7. Before: the default action (exit 143 with no word): Lightning installs its handler only
    after the checkpoint is restored (here the test's own handler stands in for the default action). The run
    folder, holding only its config, is removed."""
    def default_action(signum, frame):
        raise AssertionError("no handler of the run's was installed")

    previous = signal.signal(signal.SIGTERM, default_action)
    try:
        with pytest.raises(SystemExit) as stopped:
            run(quick(tmp_path, *SMALLER, "--trainer.max_steps=3",
                      "--trainer.callbacks+=tests.support.preemption_helpers.SignalAtFitStart"))
    finally:
        signal.signal(signal.SIGTERM, previous)
    folder = tmp_path / "tiny" / "version_0"
    assert stopped.value.code == 128 + signal.SIGTERM
    assert capfd.readouterr().err.strip().splitlines()[-1] == "preempted before the first step: nothing to save"
    assert f"removed {folder}: the run stopped before writing anything but its config" in lightning_log
    assert not folder.exists()


SIGNAL_WHILE_LOCKING = """
import os, signal, sys, time
from moe_lightning.commands.main import main
from moe_lightning.run import durable, locks

def write_text(path, text):  # the folder lock's holder record, with the signal arriving halfway through its write
    locks.write_text = durable.write_text
    with durable.atomic_write(path) as file:
        file.write(text.encode())
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(5)

locks.write_text = write_text
main()
"""


@pytest.mark.slow  # a fit signalled mid-lock
def test_sigusr1_while_the_folder_lock_is_recorded_says_why_the_run_stopped_and_leaves_nothing(tmp_path):
    """Issue 33, item 5. SLURM's requeue signal (SIGUSR1) while ``fit`` writes its folder lock's holder record,
    before any handler of the run exists. Before: killed by the signal's default action, no word, and a
    ``.moe-lightning.lock.holder.*.partial`` left that no later run removed."""
    result = subprocess.run([sys.executable, "-c", SIGNAL_WHILE_LOCKING,
                             *quick(tmp_path, *SMALLER, "--trainer.max_steps=3")],
                            cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=400)
    assert result.returncode == 128 + signal.SIGUSR1, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1] == "preempted (SIGUSR1) before the first step: nothing to save"
    assert "Traceback" not in result.stderr
    assert [p for p in tmp_path.rglob("*") if p.name.endswith(".partial")] == []


def test_a_max_time_stop_saves_and_exits_75_unlike_a_finished_run(tmp_path, lightning_log, capfd):
    """Issue 26, item 15. Before: exit 0, as a finished run; a requeue script could not tell them apart."""
    with pytest.raises(SystemExit) as stopped:
        run(quick(tmp_path, *SMALLER, "--trainer.max_steps=100000", "--trainer.max_time={'seconds': 1}"))
    assert stopped.value.code == EXIT_MAX_TIME == 75
    [saved] = (tmp_path / "tiny" / "version_0" / "checkpoints").glob("*.ckpt")
    step = step_of(saved)
    assert 0 < step < 100000
    assert any(f"trainer.max_time reached at step {step}; final weights: {saved}" in m for m in lightning_log)
    assert capfd.readouterr().err.strip().splitlines()[-1] == (
        f"trainer.max_time reached at step {step} of 100000: exit status 75, the run is not finished (the same "
        "command with --ckpt_path last continues it)")


def test_preemption_argument_is_validated():
    with pytest.raises(ValueError, match=r"Preemption.repeat_grace_s=-1 must be >= 0"):
        Preemption(repeat_grace_s=-1)




# ---- real processes, 1 and 2 ranks (slow) -------------------------------------------------------------------

def fit_command(config: str, root: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "moe_lightning", "fit", "--config", str(CONFIGS / config),
            "--trainer.log_every_n_steps=1", "--trainer.limit_val_batches=0", "--data.init_args.max_tokens=30000",
            "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
            f"--trainer.logger.init_args.save_dir={root}", f"--trainer.default_root_dir={root}", *extra]


def launch(command: list[str], cwd: Path) -> subprocess.Popen:
    cwd.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(command, cwd=cwd, env=clean_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def wait_for_line(proc: subprocess.Popen, text: str, timeout: float = 400) -> list[str]:
    """Read ``proc``'s output until a line contains ``text``; return the lines read."""
    lines, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if text in line:
            return lines
    os.killpg(proc.pid, signal.SIGKILL)
    raise AssertionError(f"never printed {text!r}:\n" + "".join(lines[-60:]))


def finish(proc: subprocess.Popen, timeout: float = 400) -> str:
    try:
        return proc.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError("a rank hung: " + (proc.communicate()[0] or "")[-3000:])


PRINT_STEPS = "--trainer.callbacks+=tests.support.preemption_helpers.PrintSteps"


@pytest.mark.slow
def test_timeout_sigterm_on_two_processes_saves_sharded_and_the_relaunch_resumes_exactly(tmp_path):
    """`timeout -s TERM 40 moe-lightning fit --config configs/tiny-fsdp.yaml` used to hang forever. `timeout`
    signals the main process and then its process group (so rank 0 sees SIGTERM twice, at once): here it is
    asked to forward SIGTERM as it does at expiry, once training is under way, so the test does not depend on
    this machine's speed."""
    common = ("--trainer.max_steps=6", PRINT_STEPS, "--ckpt_path=last")  # its ModelCheckpoint: every 50, last
    reference = launch(fit_command("tiny-fsdp.yaml", tmp_path / "ref", *common), tmp_path / "ref")
    out = finish(reference)
    assert reference.returncode == 0, out[-3000:]
    job = ["timeout", "-s", "TERM", "3000", *fit_command("tiny-fsdp.yaml", tmp_path / "job", *common)]
    first = launch(job, tmp_path / "job")
    wait_for_line(first, "trained step 2")
    os.kill(first.pid, signal.SIGTERM)  # to `timeout`, which forwards it to fit and fit's process group
    out = finish(first)
    assert first.returncode == 128 + signal.SIGTERM, out[-3000:]
    final = [line for line in out.splitlines() if line.startswith("preempted at step")]
    assert len(final) == 1, out[-3000:]
    step, path = int(final[0].split()[3].rstrip(",")), Path(final[0].split("checkpoint at ")[1])
    assert path.is_dir() and (path / ".metadata").is_file() and step_of(path) == step >= 3
    assert "Bypassing SIGTERM" not in out and not list(path.parent.glob("*.partial"))
    second = launch(job, tmp_path / "job")  # the identical command
    out = finish(second)
    assert second.returncode == 0, out[-3000:]
    assert f"ckpt_path=last -> {path} (step {step})" in out
    resumed, expected = losses(tmp_path / "job"), losses(tmp_path / "ref")
    assert sorted(resumed) == sorted(expected) == list(range(6))
    assert resumed == pytest.approx(expected, abs=1e-6)


@pytest.mark.extended
def test_ctrl_c_on_two_processes_saves_and_stops_both_ranks_at_one_step_as_sigterm_does(tmp_path):
    """Ctrl-C in a terminal signals the whole process group: both ranks. Before: each rank raised
    KeyboardInterrupt wherever it was, no checkpoint, exit 1 (FinalCheckpoint handled Ctrl-C in one process only)."""
    proc = launch(fit_command("tiny-fsdp.yaml", tmp_path, "--trainer.max_steps=40", "--trainer.callbacks=[]",
                              PRINT_STEPS, *SMALLER), tmp_path)
    wait_for_line(proc, "trained step 2")
    os.killpg(proc.pid, signal.SIGINT)
    out = finish(proc)
    assert proc.returncode == 128 + signal.SIGINT, out[-3000:]
    line = next(line for line in out.splitlines() if line.startswith("interrupted at step"))
    step, path = int(line.split()[3].rstrip(",")), Path(line.split("checkpoint at ")[1])
    assert path.is_dir() and (path / ".metadata").is_file() and step_of(path) == step < 40
    assert out.count("SIGINT received") == 2 and "KeyboardInterrupt" not in out


@pytest.mark.extended
def test_sigterm_to_the_main_process_alone_stops_both_ranks_at_one_step_with_a_single_file(tmp_path):
    """The child rank never sees the signal: the flag all-reduce tells it. Single-file checkpoint (rank 0)."""
    proc = launch(fit_command("tiny-fsdp.yaml", tmp_path, "--trainer.max_steps=40", "--trainer.callbacks=[]",
                              PRINT_STEPS, "--trainer.strategy.init_args.save_distributed_checkpoint=false",
                              "--trainer.strategy.init_args.expert_parallel_size=1"), tmp_path)
    wait_for_line(proc, "trained step 2")
    os.kill(proc.pid, signal.SIGTERM)  # the main process only (rank 0)
    out = finish(proc)
    assert proc.returncode == 128 + signal.SIGTERM, out[-3000:]
    line = next(line for line in out.splitlines() if line.startswith("preempted at step"))
    step, path = int(line.split()[3].rstrip(",")), Path(line.split("checkpoint at ")[1])
    assert path.is_file() and step_of(path) == step < 40
    assert out.count("SIGTERM received") == 1  # rank 1 stopped on the agreed flag, not on a signal of its own


@pytest.mark.extended
def test_a_second_sigterm_during_the_save_exits_at_once_keeping_the_previous_checkpoint(tmp_path):
    folder = tmp_path / "ck"
    proc = launch(fit_command("tiny.yaml", tmp_path, "--trainer.max_steps=40", "--data.init_args.batch_size=4",
                              "--trainer.callbacks=[]", "--trainer.callbacks+=ModelCheckpoint",
                              f"--trainer.callbacks.dirpath={folder}", "--trainer.callbacks.every_n_train_steps=2",
                              "--trainer.callbacks.save_top_k=-1", "--trainer.callbacks.save_last=true",
                              SIGNAL_AT, "--trainer.callbacks.step=3",
                              "--trainer.callbacks+=tests.support.preemption_helpers.SignalDuringSave"), tmp_path)
    out = finish(proc)
    assert proc.returncode == -signal.SIGTERM, out[-3000:]  # killed by the repeat, not by a failed save
    assert "preempted at step" not in out
    assert step_of(folder / "last.ckpt") == 2  # the periodic save before the signal, intact
    assert not [p for p in folder.iterdir() if "partial" in p.name or "tmp" in p.name]


@pytest.mark.slow
@pytest.mark.parametrize("signame", ["SIGUSR1", "SIGTERM"])
def test_under_slurm_the_requeue_signal_saves_and_requeues_and_sigterm_saves_without(tmp_path, signame):
    """Under SLURM with auto-requeue, SIGUSR1 (`#SBATCH --signal=SIGUSR1@120`) saves and asks SLURM to requeue
    the job (here a stand-in `scontrol` on PATH records its arguments); SIGTERM (scancel, preemption) saves and
    exits without requeueing. Before: "Bypassing SIGTERM", no checkpoint, exit 0."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(f"#!/bin/sh\necho \"$@\" > {tmp_path / 'scontrol.args'}\n")
    (bin_dir / "scontrol").chmod(0o755)
    command = fit_command("tiny.yaml", tmp_path, "--trainer.max_steps=40", "--data.init_args.batch_size=4",
                          SIGNAL_AT, "--trainer.callbacks.step=2", f"--trainer.callbacks.signal={signame}")
    slurm = dict(SLURM_NTASKS="1", SLURM_NTASKS_PER_NODE="1", SLURM_NNODES="1", SLURM_PROCID="0",
                 SLURM_LOCALID="0", SLURM_NODEID="0", SLURM_NODELIST="localhost", SLURM_JOB_ID="4242",
                 SLURM_JOB_NAME="moe", PATH=f"{bin_dir}:{os.environ['PATH']}")
    result = subprocess.run(command, cwd=tmp_path, env=clean_env(**slurm), capture_output=True, text=True,
                            timeout=400)
    assert result.returncode == 128 + getattr(signal, signame), result.stderr[-3000:]
    last_line = result.stderr.strip().splitlines()[-1]
    assert last_line.startswith("preempted at step 3, checkpoint at ") and "Bypassing" not in result.stderr
    if signame == "SIGUSR1":
        assert (tmp_path / "scontrol.args").read_text().split() == ["requeue", "4242"]
        assert last_line.endswith("; SLURM job 4242 requeued")
    else:
        assert not (tmp_path / "scontrol.args").exists()
    assert step_of(tmp_path / "tiny" / "version_0" / "checkpoints" / "last.ckpt") == 3




def test_slurm_script_relaunches_the_identical_command_with_ckpt_path_last():
    """The requeued job reruns the script: its fit must resume by itself, and SLURM must signal before the end."""
    script = (REPO_ROOT / "configs" / "slurm.sbatch").read_text()
    fit = next(line for line in script.splitlines() if "moe-lightning fit" in line)
    assert "--ckpt_path last" in fit
    assert "#SBATCH --signal=SIGUSR1@" in script and "#SBATCH --requeue" in script
    assert "#SBATCH --open-mode=append" in script  # the requeued job's output goes on after the first's
