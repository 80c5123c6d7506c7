"""``moe-lightning stalls``: the report read back from stall-report.json, flight-recorder dumps (one written here in
torch's documented format, one written by gloo ranks), ``--hosts`` and the SLURM script's requeue on status 69."""

import json
import os
import pickle
import subprocess
from pathlib import Path

import pytest

from moe_lightning.commands.main import run
from moe_lightning.run.exits import EXIT_STALLED
from moe_lightning.run.flight_recorder import flight_recorder_env
from tests.support.distributed import LAUNCHERS, REPO_ROOT, run_ranks

REPORT = {
    "exit_status": EXIT_STALLED, "stall_timeout": 30.0, "detected_by": 0, "time": "2026-12-06T05:00:00+00:00",
    "stalled": [{"rank": 1, "host": "gpu017", "pid": 4321, "coordinates": {"replicate": 0, "shard": 1, "expert": 1},
                 "step": 3, "phase": "backward", "progress": 40, "stopped": False,
                 "collective": {"op": "all_to_all", "dim": "expert", "seq": 17, "state": "finished"},
                 "seconds_without_progress": 31.0, "seconds_silent": 30.5, "why": "its process has not answered"}],
    "waiting": [{"rank": 0, "host": "gpu001", "pid": 1234, "coordinates": {"replicate": 0, "shard": 0, "expert": 0},
                 "step": 3, "phase": "backward", "progress": 43, "stopped": False,
                 "collective": {"op": "all_to_all", "dim": "expert", "seq": 18, "state": "entered"},
                 "seconds_without_progress": 30.0, "seconds_silent": 0.0}],
    "exclude_hosts": ["gpu017"]}


def entry(seq: int, state: str, desc: str = "mesh_expert") -> dict:
    """One flight-recorder entry, with the fields torch's recorder writes (torch/distributed/flight_recorder)."""
    return {"record_id": seq, "pg_id": 1, "process_group": ("1", desc), "collective_seq_id": seq, "p2p_seq_id": 0,
            "op_id": seq, "profiling_name": "nccl:all_to_all", "time_created_ns": seq, "input_sizes": [[8]],
            "output_sizes": [[8]], "state": state, "is_p2p": False, "frames": []}


def run_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "logs" / "tiny" / "version_3"
    (folder / "flight-recorder").mkdir(parents=True)
    (folder / "stall-report.json").write_text(json.dumps(REPORT))
    for rank, entries in ((0, [entry(17, "completed"), entry(18, "started")]), (1, [entry(17, "completed")])):
        dump = {"version": "2.10", "pg_config": {"1": {"name": "1", "desc": "mesh_expert", "ranks": "[0, 1]"}},
                "pg_status": {}, "entries": entries}
        (folder / "flight-recorder" / f"rank_{rank}").write_bytes(pickle.dumps(dump))
    return folder


def test_stalls_prints_the_report_and_the_ranks_behind_in_the_flight_recorder(tmp_path, capsys):
    run_folder(tmp_path)
    run(["stalls", str(tmp_path / "logs")])  # a folder above the run: its newest report
    out = capsys.readouterr().out
    assert "STALLED rank 1 (host gpu017, pid 4321; replicate 0, shard 1, expert 1): step 3, phase backward, last " \
           "finished all_to_all(expert) #17" in out
    assert "never entered all_to_all(expert) #18 that the others wait in" in out
    assert "  mesh_expert: rank 0 (host gpu001, pid 1234; replicate 0, shard 0, expert 0): nccl:all_to_all #18 " \
           "(started, not completed)" in out
    assert "  BEHIND mesh_expert: rank 1 (host gpu017, pid 4321; replicate 0, shard 1, expert 1): nccl:all_to_all " \
           "#17 (completed)" in out


def test_stalls_hosts_prints_what_a_relaunch_leaves_out(tmp_path, capsys):
    run(["stalls", "--hosts", str(run_folder(tmp_path) / "stall-report.json")])
    assert capsys.readouterr().out == "gpu017\n"
    run(["stalls", "--hosts", str(tmp_path / "elsewhere")])
    assert capsys.readouterr().out == "\n"  # nothing to exclude


def test_stalls_without_a_report_or_dumps_is_one_line(tmp_path):
    with pytest.raises(FileNotFoundError, match="no stall-report.json and no flight-recorder"):
        run(["stalls", str(tmp_path)])


def test_the_flight_recorder_is_switched_on_under_the_run_folder_unless_the_user_set_it(tmp_path):
    env = flight_recorder_env(tmp_path, environ={})
    assert env["TORCH_FR_BUFFER_SIZE"] == env["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "2000"
    assert env["TORCH_FR_DUMP_TEMP_FILE"] == str(tmp_path / "flight-recorder" / "rank_")
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert flight_recorder_env(tmp_path, environ={"TORCH_NCCL_TRACE_BUFFER_SIZE": "0"}) == {}


@pytest.mark.slow
def test_stalls_reads_real_gloo_dumps(tmp_path, capsys):
    """torch 2.13 records gloo: rank 0 launched a third all-reduce that rank 1 never joined."""
    run_ranks(LAUNCHERS / "flight_recorder_run.py", 2, str(tmp_path), timeout=300)
    run(["stalls", str(tmp_path)])
    out = capsys.readouterr().out
    assert "  mesh_shard: rank 0: gloo:all_reduce #3" in out and "  BEHIND mesh_shard: rank 1: gloo:all_reduce #2" in out


def run_sbatch(tmp_path: Path, srun: str, **env_extra: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    """configs/slurm.sbatch with stand-ins for ``srun`` (its body ``srun``) and ``scontrol`` (records its arguments)
    and the real ``moe-lightning stalls``; returns the result and scontrol's calls."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    stand_ins = {"srun": srun, "scontrol": f'echo "$@" >> {tmp_path / "scontrol.args"}',
                 "moe-lightning": f'[ "$1" = plan ] && exit 0; exec python -m moe_lightning "$@"'}
    for name, body in stand_ins.items():
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHONPATH": str(REPO_ROOT),
           "LOGS": str(tmp_path / "logs"), "SLURM_JOB_ID": "4242", "SLURM_JOB_NUM_NODES": "2",
           "SLURM_NTASKS_PER_NODE": "4", "SLURM_CPUS_PER_TASK": "1", **env_extra}
    result = subprocess.run(["bash", str(REPO_ROOT / "configs" / "slurm.sbatch")], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=120)
    calls = tmp_path / "scontrol.args"
    return result, calls.read_text().splitlines() if calls.exists() else []


def test_the_slurm_script_requeues_a_stalled_job_without_the_named_host(tmp_path):
    """The stalled task died by a signal (137), so srun's status is not 69: the report written during the job
    decides. Before: only status 69 requeued."""
    report = run_folder(tmp_path) / "stall-report.json"
    result, calls = run_sbatch(tmp_path, f"sleep 1; touch {report}; exit 137")
    assert result.returncode == EXIT_STALLED, result.stderr
    assert calls == ["update JobId=4242 ExcNodeList=gpu017", "requeue 4242"]


def test_the_slurm_script_ignores_an_old_report_and_one_that_names_no_host(tmp_path):
    """Before: status 69 with an empty exclude list requeued onto the same hosts, without end."""
    report = run_folder(tmp_path) / "stall-report.json"
    os.utime(report, (1, 1))  # an earlier job's report
    result, calls = run_sbatch(tmp_path, "exit 1")
    assert result.returncode == 1 and calls == []
    report.write_text(json.dumps({**REPORT, "stalled": [], "exclude_hosts": []}))
    result, calls = run_sbatch(tmp_path, "exit 69")
    assert result.returncode == EXIT_STALLED and calls == []


def test_the_slurm_script_stops_requeueing_after_max_stall_requeues(tmp_path):
    report = run_folder(tmp_path) / "stall-report.json"
    result, calls = run_sbatch(tmp_path, f"sleep 1; touch {report}; exit 69", SLURM_RESTART_COUNT="3")
    assert result.returncode == EXIT_STALLED and calls == []
    assert "requeued 3 times already (MAX_STALL_REQUEUES): not again" in result.stderr


def test_stalls_since_reads_only_a_report_written_after_it(tmp_path, capsys):
    report = run_folder(tmp_path) / "stall-report.json"
    os.utime(report, (1000, 1000))
    run(["stalls", "--hosts", "--since", "1001", str(tmp_path / "logs")])
    run(["stalls", "--hosts", "--since", "1000", str(tmp_path / "logs")])
    assert capsys.readouterr().out == "\ngpu017\n"


def test_the_dump_merges_nccls_recorder_with_gloos(tmp_path, monkeypatch):
    """Before: only ``_dump_fr_trace`` (gloo's recorder) was written; an NCCL job's collectives were missing."""
    from torch._C import _distributed_c10d

    from moe_lightning.run import flight_recorder

    def recorder(*entries):
        return pickle.dumps({"version": "2.10", "pg_config": {"1": {"desc": entries[0]["process_group"][1]}},
                             "pg_status": {}, "entries": list(entries)})

    nccl = entry(18, "started")
    gloo = {**entry(3, "completed", "preemption"), "profiling_name": "gloo:all_reduce"}
    earlier = entry(17, "completed")
    monkeypatch.setattr(_distributed_c10d, "_dump_nccl_trace", lambda: recorder(earlier, nccl), raising=False)
    monkeypatch.setattr(_distributed_c10d, "_dump_fr_trace", lambda: recorder(gloo, nccl), raising=False)
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "2000")
    path = flight_recorder.dump(1, tmp_path)
    written = pickle.loads(path.read_bytes())
    assert path == tmp_path / "flight-recorder" / "rank_1"
    assert sorted((e["profiling_name"], e["collective_seq_id"]) for e in written["entries"]) == \
        [("gloo:all_reduce", 3), ("nccl:all_to_all", 17), ("nccl:all_to_all", 18)]  # one entry both hold: once
