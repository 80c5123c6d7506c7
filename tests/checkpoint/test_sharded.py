"""The one checkpoint layer (issue 23, defects 1-7; issue 26, items 2 and 4): nothing saved is lost by a rotation,
a link, a kill or a corrupt newest file; the ranks agree on every outcome; one run owns a folder at a time."""

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from moe_lightning.run import locks
from moe_lightning.run import folders as runs
from moe_lightning.training.callbacks import run_folders
from moe_lightning.commands.main import run
from moe_lightning.checkpoint import commit as ckpt
from moe_lightning.checkpoint.discovery import newest_checkpoint
from moe_lightning.checkpoint.safe_load import load_metadata
from moe_lightning.checkpoint.sharded import ShardedCheckpointer
from moe_lightning.training.strategy import MoEFSDPStrategy
from tests.support.distributed import REPO_ROOT, clean_env, run_ranks

TINY = REPO_ROOT / "configs" / "tiny.yaml"


def quick(tmp_path, *extra: str) -> list[str]:
    return ["fit", "--config", str(TINY), f"--trainer.default_root_dir={tmp_path}", "--trainer.logger=false",
            "--data.init_args.max_tokens=30000", "--trainer.enable_progress_bar=false", "--trainer.callbacks=[]",
            "--trainer.enable_model_summary=false", "--trainer.limit_val_batches=0", "--data.init_args.batch_size=2",
            "--model.init_args.config.n_layers=1", *extra]


def python(code: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), *args], env=clean_env(), cwd=REPO_ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def step_of(path: Path) -> int:
    return load_metadata(ckpt.metadata_file(path), mmap=True)["global_step"]


# ---- durable writes ------------------------------------------------------------------------------------------

def test_a_sharded_commit_syncs_the_marker_meta_and_the_folder(tmp_path, durability_log):
    """Before: the marker and ``meta.pt`` were written without fsync and the folder was never synced after the
    rename, so a power loss could leave a committed name over unsynced files (or bring back the old folder)."""
    ShardedCheckpointer().save({"w": torch.ones(4)}, {"global_step": 1}, tmp_path / "last.ckpt", set(), None)
    events = [(kind, what if kind == "replace" else what.name) for kind, what in durability_log]
    synced = [name for kind, name in events if kind == "fsync"]
    assert any(name.startswith(ckpt.MARKER_FILE + ".") for name in synced), events
    assert any(name.startswith(ckpt.METADATA_FILE + ".") for name in synced), events
    commit = events.index(("replace", "last.ckpt"))
    assert ("fsync", "last.ckpt.partial") in events[:commit] and ("fsync", tmp_path.name) in events[commit:], events


# ---- defect 1: a background save with top-k rotation ----------------------------------------------------------

ROTATE_THEN_DIE = """
    import os, signal, sys, time, torch
    from pathlib import Path
    from moe_lightning.training.strategy import MoEFSDPStrategy
    folder = Path(sys.argv[1])
    strategy = MoEFSDPStrategy(async_checkpoint=True)
    saver = strategy.checkpointer
    saver.save({"w": torch.ones(4)}, {"global_step": 1}, folder / "step=1.ckpt", set(), None)
    saver.save({"w": torch.full((4,), 2.0)}, {"global_step": 2}, folder / "step=2.ckpt", set(), None, background=True)
    strategy.remove_checkpoint(folder / "step=1.ckpt")  # Lightning's save_top_k=1 rotation, as the new save starts
    while not (folder / "step=2.ckpt.partial" / ".metadata").exists():  # DCP renames .metadata in last
        time.sleep(0.01)
    time.sleep(0.2)
    os.kill(os.getpid(), signal.SIGKILL)  # before the next batch's poll commits it
"""


def test_a_rotation_during_a_background_save_waits_for_its_commit_and_a_killed_complete_save_is_committed(
        tmp_path, lightning_log):
    """Before: step=1.ckpt was deleted as the step-2 save started, the kill left only step=2.ckpt.partial (fully
    written), and the next start deleted it: no checkpoint at all."""
    proc = python(ROTATE_THEN_DIE, str(tmp_path))
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == -signal.SIGKILL, out
    assert step_of(tmp_path / "step=1.ckpt") == 1  # the removal waits for a commit that never came
    said = []
    assert ckpt.remove_unfinished_saves({tmp_path}, say=said.append) == []
    assert any("committed" in m and "step=2.ckpt" in m for m in said)
    assert newest_checkpoint([tmp_path]) == (tmp_path / "step=2.ckpt", 2)


def test_the_rotated_checkpoint_is_removed_once_the_background_save_is_committed(tmp_path):
    strategy = MoEFSDPStrategy(async_checkpoint=True)
    saver = strategy.checkpointer
    saver.save({"w": torch.ones(4)}, {"global_step": 1}, tmp_path / "step=1.ckpt", set(), None)
    saver.save({"w": torch.ones(4)}, {"global_step": 2}, tmp_path / "step=2.ckpt", set(), None, background=True)
    strategy.remove_checkpoint(tmp_path / "step=1.ckpt")
    saver.wait()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step=2.ckpt"]


# ---- defect 3: save_last="link" -------------------------------------------------------------------------------

def test_a_sharded_save_over_a_last_link_replaces_the_link_and_keeps_its_target(tmp_path):
    """Before: the commit moved the link aside and called rmtree on it: OSError "Cannot call rmtree on a symbolic
    link" after the new save was in place (a traceback exit on rank 0, the others hung)."""
    saver = ShardedCheckpointer()
    saver.save({"w": torch.ones(4)}, {"global_step": 1}, tmp_path / "step=1.ckpt", set(), None)
    (tmp_path / "last.ckpt").symlink_to("step=1.ckpt")  # what ModelCheckpoint(save_last="link") makes
    saver.save({"w": torch.ones(4)}, {"global_step": 2}, tmp_path / "last.ckpt", set(), None)  # a preemption save
    assert not (tmp_path / "last.ckpt").is_symlink() and step_of(tmp_path / "last.ckpt") == 2
    assert step_of(tmp_path / "step=1.ckpt") == 1
    (tmp_path / "link.ckpt").symlink_to("step=1.ckpt")
    MoEFSDPStrategy().remove_checkpoint(tmp_path / "link.ckpt")
    assert not os.path.lexists(tmp_path / "link.ckpt") and step_of(tmp_path / "step=1.ckpt") == 1


# ---- defects 2, 4, 5: two ranks agree ------------------------------------------------------------------------

@pytest.mark.slow  # multi-process or long: .ci/run's slow stage (keeps the main suite under 10 minutes)
def test_two_ranks_agree_on_a_full_disk_in_meta_an_async_failure_and_what_last_means(tmp_path):
    """Before: (2) rank 0 raised a raw ENOSPC while rank 1 waited at a barrier; (5) rank 0 raised at its first poll,
    rank 1 a step later; (4) each rank resolved `last` alone, rank 1 silently skipping the unreadable newest."""
    outputs = run_ranks(REPO_ROOT / "tests" / "launchers" / "checkpoint_ranks_run.py", 2, str(tmp_path), timeout=240)
    lines = {}
    for output in outputs:
        for line in output.splitlines():
            scenario, rank, step, what = (line.split(" ", 3) + [""] * 4)[:4]
            if scenario in ("meta", "async", "last") and rank in ("0", "1"):
                lines[scenario, int(rank)] = (step, what)
    path = tmp_path / "meta" / "last.ckpt"
    assert lines["meta", 0][1].startswith(f"DiskFullError: {path} was not written: the disk is full")
    assert lines["meta", 1][1].startswith(f"CheckpointError: Checkpoint {path} was not saved: rank 0 failed: "
                                          f"{path} was not written: the disk is full")
    assert step_of(path) == 1 and sorted(p.name for p in path.parent.iterdir()) == ["last.ckpt"]
    assert lines["async", 0][0] == lines["async", 1][0] != "never", lines
    assert "rank 1: OSError(5, 'Input/output error')" in lines["async", 0][1]
    for rank in (0, 1):
        assert lines["last", rank][1].startswith("CheckpointError: --ckpt_path last resolved differently on the "
                                                 f"ranks (rank 0 -> {tmp_path / 'last' / 'step=2.ckpt'}, rank 1 -> "
                                                 f"{tmp_path / 'last' / 'step=1.ckpt'})")
    assert f"[rank 1] resume: skipping {tmp_path / 'last' / 'step=2.ckpt'}: its step cannot be read (OSError: " \
           "[Errno 5] Input/output error)" in outputs[1]


# ---- issue 26 item 2: a corrupt newest checkpoint falls back ------------------------------------------------

def test_last_skips_a_corrupt_newest_file_and_a_sharded_one_with_a_shard_missing_or_truncated(tmp_path):
    """Before: the newest was chosen whatever its state, and the resume died in a long traceback (or, with the
    zeroed bytes in tensor data, loaded wrong weights without a word)."""
    ckpt.save_file({"global_step": 1, "w": torch.randn(2**18)}, tmp_path / "step=1.ckpt")
    ckpt.save_file({"global_step": 2, "w": torch.randn(2**18)}, tmp_path / "step=2.ckpt")
    data = bytearray((tmp_path / "step=2.ckpt").read_bytes())
    data[len(data) // 2:len(data) // 2 + 2**16] = bytes(2**16)  # zeroed in the middle
    (tmp_path / "step=2.ckpt").write_bytes(data)
    with pytest.warns(UserWarning, match=r"skipping .*step=2.ckpt \(step 2\): it is incomplete or damaged "
                                         r"\(CheckpointError: .* fails its CRC-32 check"):
        assert newest_checkpoint([tmp_path]) == (tmp_path / "step=1.ckpt", 1)
    saver = ShardedCheckpointer()
    for step in (3, 4):
        saver.save({"w": torch.randn(2**16)}, {"global_step": step}, tmp_path / f"step={step}.ckpt", set(), None)
    shard = next((tmp_path / "step=4.ckpt").glob("*.distcp"))
    os.truncate(shard, shard.stat().st_size // 2)
    with pytest.warns(UserWarning, match=r"step=4.ckpt \(step 4\): .* holds [\d,]+ bytes; its DCP metadata needs"):
        assert newest_checkpoint([tmp_path]) == (tmp_path / "step=3.ckpt", 3)
    shard.unlink()
    with pytest.warns(UserWarning, match=r"distcp is missing: its DCP metadata lists it"):
        assert newest_checkpoint([tmp_path]) == (tmp_path / "step=3.ckpt", 3)


# ---- defect 6: the final save never replaces a ranked checkpoint ---------------------------------------------

def test_the_final_checkpoint_never_overwrites_the_ranked_one_of_the_same_name(tmp_path):
    """Before: with ``filename: model`` the final save at step 3 replaced the ranked ``model.ckpt`` of step 2."""
    folder = tmp_path / "ck"
    run(quick(tmp_path, "--trainer.max_steps=3", "--trainer.callbacks+=ModelCheckpoint",
              f"--trainer.callbacks.dirpath={folder}", "--trainer.callbacks.filename=model",
              "--trainer.callbacks.monitor=train/loss", "--trainer.callbacks.every_n_train_steps=2",
              "--trainer.callbacks.save_top_k=1", "--trainer.callbacks.enable_version_counter=false"))
    assert step_of(folder / "model.ckpt") == 2
    assert step_of(folder / "model-v1.ckpt") == 3


# ---- defect 7: reading a model reads only the model ---------------------------------------------------------

READ_RSS = """
    import re, sys
    from pathlib import Path
    from moe_lightning.commands.loading import read_checkpoint

    def peak() -> int:
        return int(re.search(r"VmHWM:\\s+(\\d+) kB", Path("/proc/self/status").read_text()).group(1)) * 1024

    Path("/proc/self/clear_refs").write_text("5")  # the peak so far (imports) is forgotten
    before = peak()
    checkpoint = read_checkpoint(sys.argv[1])
    sum(t.float().sum().item() for t in checkpoint.state_dict.values())  # the weights are read
    print(peak() - before)
"""


def test_reading_a_checkpoints_model_does_not_read_its_optimizer_state(tmp_path):
    """Before: the whole file was read (+ the optimizer state's size in peak RSS)."""
    path = tmp_path / "big.ckpt"
    ckpt.save_file({"global_step": 1, "hyper_parameters": {"config": {"dim": 64, "n_layers": 1, "vocab_size": 256}},
                    "state_dict": {},
                    "optimizer_states": [{"state": {0: {"exp_avg": torch.ones(2**24)}}}]}, path)  # 64 MiB
    proc = python(READ_RSS, str(path))
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 0, out
    assert int(out.split()[-1]) < 16 * 2**20, out  # the 64 MiB optimizer tensor was never read


# ---- issue 26 item 4: one run per folder (the package's one lock, moe_lightning/run/locks.py) ----------------------

HOLD_LOCK = """
    import os, socket, sys, time
    from pathlib import Path
    from moe_lightning.run import locks
    if len(sys.argv) > 3:
        socket.gethostname = lambda: sys.argv[3]  # the record of a holder on another node
    go = Path(sys.argv[2])
    (go.parent / f"ready-{os.getpid()}").touch()
    while not go.exists():
        time.sleep(0.005)
    try:
        locks.acquire(Path(sys.argv[1]))
        print("won", flush=True)
    except locks.FolderLockedError as error:
        print("refused", error, flush=True)
        sys.exit(0)
    sys.stdin.read()  # holds the lock until the test closes stdin or kills the process
"""


def holder(tmp_path: Path, folder: Path, *host: str, start: bool = True) -> subprocess.Popen:
    """A process that takes ``folder``'s run lock (through ``locks``, without importing torch) and holds it."""
    folder.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(HOLD_LOCK), str(folder / locks.LOCK_FILE),
                             str(tmp_path / "go"), *host], env=clean_env(), cwd=REPO_ROOT, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if start:
        wait_ready(tmp_path, [proc])
        (tmp_path / "go").touch()
        assert proc.stdout.readline().strip() == "won"
    return proc


def wait_ready(folder: Path, procs: list[subprocess.Popen]) -> None:
    while not all((folder / f"ready-{p.pid}").exists() for p in procs):
        assert all(p.poll() is None for p in procs), [p.communicate()[0] for p in procs]
        time.sleep(0.05)


def takes(tmp_path: Path, folder: Path) -> bool:
    """Whether a new process can take ``folder``'s lock now (it lets it go at once); a crash is neither."""
    proc = holder(tmp_path, folder, start=False)
    wait_ready(tmp_path, [proc])
    (tmp_path / "go").touch()
    line = proc.stdout.readline().strip()
    proc.kill()
    proc.communicate()
    assert line == "won" or line.startswith("refused "), line
    return line == "won"


def test_a_live_holder_refuses_a_second_owner_naming_its_host_and_pid(tmp_path):
    folder = tmp_path / "ck"
    proc = holder(tmp_path, folder)
    try:
        with pytest.raises(locks.FolderInUseError) as refused:
            locks.lock_folder(folder)
        line = str(refused.value)
        assert "\n" not in line and "Wait for it to end, or choose another folder" in line
        assert line.startswith(f"{folder} is in use by another run (host {socket.gethostname()}, pid {proc.pid}; ")
    finally:
        proc.kill()
        proc.communicate()


def test_a_holder_killed_with_sigkill_frees_the_folder_without_any_takeover(tmp_path, lightning_log):
    """Before: a pid file; one left by another node's run (here a holder recording host ``node-b``) could never be
    judged, and the folder stayed refused until someone deleted the file. The kernel drops a dead holder's flock."""
    folder = tmp_path / "ck"
    proc = holder(tmp_path, folder, "node-b")
    with pytest.raises(locks.FolderInUseError, match=f"host node-b, pid {proc.pid};"):
        locks.lock_folder(folder)
    proc.kill()  # SIGKILL: nothing of the holder's runs, its record stays
    proc.communicate()
    lock = locks.lock_folder(folder)
    try:
        record = json.loads((folder / (locks.LOCK_FILE + ".holder")).read_text())
        assert record == {"host": socket.gethostname(), "pid": os.getpid()}
        assert not [m for m in lightning_log if "took over" in m]
    finally:
        lock.release()


def test_two_processes_racing_for_one_folder_exactly_one_wins(tmp_path):
    folder = tmp_path / "ck"
    procs = [holder(tmp_path, folder, start=False) for _ in range(2)]
    try:
        wait_ready(tmp_path, procs)  # both imported and waiting at the gate
        (tmp_path / "go").touch()
        lines = [p.stdout.readline().strip() for p in procs]
        winners = [p.pid for p, line in zip(procs, lines) if line == "won"]
        assert len(winners) == 1 and sum(line.startswith("refused ") for line in lines) == 1, lines
        refusal = next(line for line in lines if line.startswith("refused "))
        # the loser names the winner, or (refused in the instant before the winner wrote its record) says so
        assert f"host {socket.gethostname()}, pid {winners[0]}" in refusal or "not recorded itself yet" in refusal
    finally:
        for proc in procs:
            proc.kill()
            proc.communicate()
    assert takes(tmp_path, folder)  # the winner is gone: so is its lock


def test_one_process_takes_its_own_folder_again_and_holds_it_until_its_last_release(tmp_path):
    """A second ``fit`` in one Python process asks again for a folder it holds: a second open + flock of the lock
    file would conflict with the first (flock locks belong to the open file) and refuse the process itself."""
    folder = tmp_path / "ck"
    first = locks.lock_folder(folder)
    second = locks.lock_folder(folder)
    first.release()
    first.release()  # ReleaseLocks may run twice (on_exception, then the CLI's own call): one release
    assert not takes(tmp_path, folder)
    record = folder / (locks.LOCK_FILE + ".holder")
    assert json.loads(record.read_text())["pid"] == os.getpid()
    second.release()
    assert not record.exists() and (folder / locks.LOCK_FILE).exists()  # the lock file stays (see locks.py)
    assert takes(tmp_path, folder)


def test_release_removes_the_holder_record_only_while_it_is_this_process_s(tmp_path):
    folder = tmp_path / "ck"
    record = folder / (locks.LOCK_FILE + ".holder")
    lock = locks.lock_folder(folder)
    record.write_text("replaced by hand")
    lock.release()
    assert record.read_text() == "replaced by hand"


def test_a_file_system_without_flock_refuses_fit_s_folder_with_one_line_naming_the_mount_options(tmp_path,
                                                                                                   monkeypatch):
    """Before: a pid file, which excludes nobody on another node; now the one lock, which needs flock."""
    import errno
    import fcntl

    def no_locks(fd, operation):
        raise OSError(errno.ENOSYS, os.strerror(errno.ENOSYS))
    monkeypatch.setattr(fcntl, "flock", no_locks)
    folder = tmp_path / "ck"
    with pytest.raises(locks.NoFlockError) as refused:
        locks.lock_folder(folder)
    line = str(refused.value)
    assert line.startswith(f"cannot lock {folder / locks.LOCK_FILE} (") and "\n" not in line
    assert "Lustre: mount with -o flock; NFS: run lockd" in line
    monkeypatch.undo()
    locks.lock_folder(folder).release()  # the refused attempt kept nothing open


def test_a_failed_run_s_new_folder_is_removed_with_its_lock_file(tmp_path):
    """The lock file stays after release, in a fixed ``version_N`` folder too: it is not something the run wrote."""
    folder = tmp_path / "version_7"
    folder.mkdir()
    (folder / "config.yaml").write_text("model: {}")
    locks.lock_folder(folder).release()
    assert runs.remove_empty_run_folder(folder) and not folder.exists()


@pytest.mark.slow  # a CLI fit: .ci/run's slow stage (keeps the main suite under 10 minutes)
def test_a_live_holder_refuses_fit_before_it_reads_cleans_or_writes_the_folder(tmp_path):
    folder = tmp_path / "ck"
    proc = holder(tmp_path, folder)
    try:
        with pytest.raises(locks.FolderInUseError) as refused:
            run(quick(tmp_path, "--trainer.max_steps=1", "--trainer.callbacks+=ModelCheckpoint",
                      f"--trainer.callbacks.dirpath={folder}"))
        assert f"(host {socket.gethostname()}, pid {proc.pid};" in str(refused.value)
        assert sorted(p.name for p in folder.iterdir()) == [locks.LOCK_FILE, locks.LOCK_FILE + ".holder"]
    finally:
        proc.kill()
        proc.communicate()


RUN_HOLDS_ITS_FOLDERS = """
import sys
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from moe_lightning.training.callbacks import run_folders
trainer = Trainer(logger=CSVLogger(sys.argv[1], name="tiny", version=0), callbacks=[ModelCheckpoint()],
                  enable_progress_bar=False, enable_model_summary=False)
run_folders.lock_run_folders(trainer)
print("held", flush=True)
sys.stdin.read()
"""


def test_a_relaunch_continuing_a_run_that_still_writes_takes_the_lock_that_run_holds(tmp_path):
    """The default layout (a ModelCheckpoint without dirpath, as configs/1t.yaml): the running job locked only
    version_0, the relaunch with --ckpt_path last locked version_0/checkpoints; both trained and the relaunch
    cleaned the running job's partial save."""
    run_ = subprocess.Popen([sys.executable, "-c", RUN_HOLDS_ITS_FOLDERS, str(tmp_path)], env=clean_env(),
                            cwd=REPO_ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert run_.stdout.readline().strip() == "held"
        checkpoints = tmp_path / "tiny" / "version_0" / "checkpoints"
        with pytest.raises(locks.FolderInUseError, match=f"pid {run_.pid}"):
            locks.lock_folder(checkpoints)  # what the relaunch locks: the folder of the last.ckpt it continues
    finally:
        run_.kill()
        run_.communicate()


def test_locks_taken_before_a_refusal_are_given_back(tmp_path):
    """Was: refused on the second folder, the first stayed locked (and its version_N could not be removed)."""
    from types import SimpleNamespace

    from lightning.pytorch.callbacks import ModelCheckpoint
    busy = tmp_path / "busy"
    proc = holder(tmp_path, busy)
    try:
        trainer = SimpleNamespace(checkpoint_callbacks=[ModelCheckpoint(dirpath=tmp_path / "mine")], logger=None,
                                  loggers=[], default_root_dir=str(tmp_path), callbacks=[])
        with pytest.raises(locks.FolderInUseError):
            run_folders.lock_run_folders(trainer, resumed=str(busy / "last.ckpt"))
        assert not locks._HELD and trainer.callbacks == []
    finally:
        proc.kill()
        proc.communicate()


REMOVE_WHILE_HELD = """
import sys, time
from pathlib import Path
from moe_lightning.run import locks
lock = locks.acquire(Path(sys.argv[1]))
print("held", flush=True)
time.sleep(1)
Path(sys.argv[1]).unlink()  # a failed run removing the folder it created, while it holds the lock
"""


def test_a_lock_file_removed_while_waited_for_is_not_a_lock_on_nothing(tmp_path):
    """Was: the waiter locked the removed file's inode, which no later process can open: two owners."""
    path = tmp_path / "f" / locks.LOCK_FILE
    path.parent.mkdir()
    proc = subprocess.Popen([sys.executable, "-c", REMOVE_WHILE_HELD, str(path)], env=clean_env(), cwd=REPO_ROOT,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    lock = locks.acquire(path, wait=True)  # free once the holder removed the file and exited
    try:
        proc.communicate(timeout=60)
        assert locks._names(path, locks._HELD[lock.key].fd)  # the file that is there now
    finally:
        lock.release()


def test_a_mount_whose_flock_is_local_to_each_node_is_named():
    mountinfo = "\n".join([
        "22 1 0:21 / / rw,relatime - ext4 /dev/vda rw",
        "40 22 0:35 / /lustre rw,relatime - lustre 10.0.0.1@o2ib:/fs rw,localflock,lazystatfs",
        "41 22 0:36 / /lustre/ok rw,relatime - lustre 10.0.0.1@o2ib:/fs2 rw,flock",
        "42 22 0:37 / /home rw,relatime - nfs4 srv:/home rw,vers=4.2,local_lock=flock",
        "43 22 0:38 / /scratch rw - nfs srv:/scratch rw,vers=3,nolock",
        "44 22 0:39 / /shared rw - nfs4 srv:/shared rw,vers=4.2,local_lock=none"])
    said = {folder: locks.local_only_flock(Path(folder), mountinfo) for folder in
            ["/lustre/run", "/lustre/ok/run", "/home/u/run", "/scratch/x", "/shared/x", "/tmp/x", "/lustreX/y"]}
    assert said == {"/lustre/run": "lustre at /lustre is mounted localflock", "/lustre/ok/run": None,
                    "/home/u/run": "nfs4 at /home is mounted local_lock=flock", "/scratch/x": "nfs at /scratch is "
                    "mounted nolock", "/shared/x": None, "/tmp/x": None, "/lustreX/y": None}
    over = "45 22 0:40 / /scratch rw - ext4 /dev/vdb rw"  # a local disk mounted over the NFS one hides it
    assert locks.local_only_flock(Path("/scratch/x"), mountinfo + "\n" + over) is None
    spaced = "46 22 0:41 / /my\\040runs rw - nfs srv:/r rw,nolock"
    assert locks.local_only_flock(Path("/my runs/x"), mountinfo + "\n" + spaced) == "nfs at /my runs is mounted nolock"


def test_a_relative_or_symlinked_folder_is_named_by_the_mount_it_lands_on(tmp_path, monkeypatch):
    """Was: ``tokenize --out shards`` run from inside a localflock Lustre mount matched no mount point."""
    real = os.path.realpath(tmp_path)
    mountinfo = f"22 1 0:21 / / rw - ext4 /dev/vda rw\n40 22 0:35 / {real} rw - lustre fs rw,localflock"
    (tmp_path / "shards").mkdir()
    (tmp_path.parent / f"{tmp_path.name}-link").symlink_to(tmp_path)
    monkeypatch.chdir(tmp_path)
    for folder in [Path("shards"), Path("shards/new"), tmp_path.parent / f"{tmp_path.name}-link" / "shards"]:
        assert locks.local_only_flock(folder, mountinfo) == f"lustre at {real} is mounted localflock", folder


def test_the_lock_in_a_checkpoint_folder_is_not_taken_for_a_stale_checkpoint(tmp_path):
    """Lightning warns when a checkpoint folder is not empty; the lock it now holds made every fit say so."""
    import warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run(quick(tmp_path, "--trainer.max_steps=1"))
    assert (tmp_path / "checkpoints" / locks.LOCK_FILE).exists()  # logger off: where Lightning writes, locked
    assert not [w for w in caught if "exists and is not empty" in str(w.message)]
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "old.ckpt").write_bytes(b"")  # a real leftover is still said
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run(quick(tmp_path / "other", "--trainer.max_steps=1", f"--trainer.default_root_dir={tmp_path}",
                  "--trainer.callbacks+=ModelCheckpoint", f"--trainer.callbacks.dirpath={tmp_path / 'other'}"))
    assert [w for w in caught if "exists and is not empty" in str(w.message)]


FORK_THEN_DIE = """
import os, sys, time
from pathlib import Path
from moe_lightning.run import locks
locks.acquire(Path(sys.argv[1]))
child = os.fork()
if child == 0:  # a DataLoader worker, say, still running when its parent is killed
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 1), os.dup2(null, 2)  # not the test's pipes
    time.sleep(60)
    os._exit(0)
print(child, flush=True)
os._exit(0)  # the run dies; its worker lingers
"""


def test_a_dead_runs_lingering_worker_does_not_keep_its_folder_locked(tmp_path):
    """Was: a forked child shared the lock's open file, so a killed run's folder stayed locked until its last
    worker noticed, and the requeued job was refused."""
    folder = tmp_path / "ck"
    folder.mkdir()
    out = subprocess.run([sys.executable, "-c", FORK_THEN_DIE, str(folder / locks.LOCK_FILE)], env=clean_env(),
                         cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    worker = int(out.stdout.strip())
    try:
        assert takes(tmp_path, folder)
    finally:
        os.kill(worker, signal.SIGKILL)
