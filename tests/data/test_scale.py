"""The data path at corpus scale: samplers in O(1) memory, and `tokenize` under faults (a killed worker, a bad
record, a second run, SIGTERM), with large and many small files, and spread over tasks."""

import itertools
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from moe_lightning.data import MixtureSampler, MixtureSequences, ResumableSampler, TextDataModule, tokenize_to_folder
from moe_lightning.data.sampling import Shuffle
from moe_lightning.data.tokenize import files, reading
from moe_lightning.data.tokenize import folder as tokenize_folder
from moe_lightning.data.tokenize import plan as planning
from moe_lightning.data.tokenize.command import tokenize_main
from moe_lightning.data.tokenize.errors import TokenizeError
from moe_lightning.data.tokenize.tasks import task_from_environment
from moe_lightning.run import locks
from moe_lightning.data.tokenizer import ByteTokenizer
from tests.data.reference_orders import mixture_order, resumable_order, shuffled

REPO = Path(__file__).resolve().parents[2]


# ---- samplers -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [1, 2, 3, 5, 17, 1000, 4097, 1_000_003])
def test_shuffle_is_a_permutation_of_every_size(n):
    order = Shuffle(n, 7, 0)(np.arange(n))
    np.testing.assert_array_equal(np.sort(order), np.arange(n))
    if n >= 1000:
        assert abs(np.corrcoef(np.arange(n), order)[0, 1]) < 0.1  # no trace of the identity left
        assert not np.array_equal(order, Shuffle(n, 7, 1)(np.arange(n)))  # each epoch its own order
        np.testing.assert_array_equal(order[n // 3::5], Shuffle(n, 7, 0)(np.arange(n)[n // 3::5]))  # per index


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 16, 17, 1000, 4097])
def test_shuffle_is_the_documented_feistel_network(n):
    """Checkpoints record positions in this order ("feistel-v1"): a change to it must show here, not in a resume."""
    for seed in [(7, 0), (7, 1), (0,), (2**64 + 3, 5, 1)]:
        at = shuffled(n, *seed)
        assert Shuffle(n, *seed)(np.arange(n)).tolist() == [at(i) for i in range(n)], seed
    far = 10**11 + 8 * np.arange(5)
    assert Shuffle(10**12, 1, 0)(far).tolist() == [shuffled(10**12, 1, 0)(int(i)) for i in far]


@pytest.mark.parametrize("world, rank, epoch, start", [(1, 0, 0, 0), (3, 2, 1, 0), (3, 1, 1, 1001), (2, 0, 3, 17)])
def test_mixture_order_is_the_documented_rule_across_source_passes(world, rank, epoch, start):
    """Sources of 5000, 300 and 40 sequences at weights 3 : 1 : 0.5 (a pattern of 6667, 2222 and 1111 draws, the
    largest remainder rounding the first up): the small sources run through many passes, each reshuffled, and a
    mixture epoch after the first continues every source's count."""
    lengths = [5000, 300, 40]
    mixture = MixtureSampler(MixtureSequences([range(n) for n in lengths]), [3.0, 1.0, 0.5], ["a", "b", "c"],
                             num_replicas=world, rank=rank, seed=5)
    mixture.set_epoch(epoch)
    mixture.resume_epoch, mixture.resume_samples = epoch, start
    expected = list(mixture_order([6667, 2222, 1111], lengths, 5, epoch, world, rank, start))
    assert list(mixture) == expected and len(expected) > 1000


def test_samplers_start_at_a_trillion_sequences_in_constant_memory_and_resume_exactly():
    """Was: a randperm per epoch (8 TB here) and a permutation per mixture pass, on every rank."""
    n, ranks = 10**12, 8
    tracemalloc.start()
    try:
        samplers = [ResumableSampler(range(n), num_replicas=ranks, rank=r, seed=1) for r in range(ranks)]
        for sampler in samplers:
            sampler.resume_epoch, sampler.resume_samples = 0, 10**11  # resumed deep into the epoch
        per_rank = [list(itertools.islice(iter(sampler), 5)) for sampler in samplers]
        mixture = MixtureSampler(MixtureSequences([range(n), range(10**9)]), [3.0, 1.0], ["a", "b"],
                                 num_replicas=ranks, rank=3, seed=1)
        mixed = list(itertools.islice(iter(mixture), 4000))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20, peak
    # the ranks draw different sequences, all of the corpus, none twice (a bijection, not a formula restated)
    drawn = [i for indices in per_rank for i in indices]
    assert len(set(drawn)) == len(drawn) and all(0 <= i < n for i in drawn)
    assert max(drawn) > n // 2  # spread over the whole corpus, not near the resume position
    first = per_rank[3]
    # the 3:1 mixture over 4,000 draws of one rank: source "a" (flat indices below n) about three in four
    share = np.mean(np.array(mixed) < n)
    assert abs(share - 0.75) < 0.03, share
    assert len(set(mixed)) == len(mixed) and all(0 <= i < n + 10**9 for i in mixed)
    # the documented orders, written independently (tests/data/reference_orders.py)
    assert first == list(itertools.islice(resumable_order(n, 1, 0, ranks, 3, start=10**11), 5))
    assert mixed == list(itertools.islice(mixture_order([7500, 2500], [n, 10**9], 1, 0, ranks, 3), 4000))  # 3:1


# ---- tokenize under faults ------------------------------------------------------------------------------------

def jsonl(path: Path, records: int, bad_at: int | None = None, width: int = 40) -> Path:
    with open(path, "w") as f:
        for i in range(records):
            record = json.dumps({"text": f"record {i} " + "word " * (width + i % 7)})
            f.write("{broken\n" if i == bad_at else record + "\n")
    return path


def clean_env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RANK", "WORLD_SIZE"))}
    return {**env, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}


SLOW_UNITS = """
import os, sys, time
from moe_lightning.data.tokenize import command, plan, workers
plan.MIN_UNIT_BYTES = 20_000
original = workers.unit_segments
def slow(*args):  # every unit takes a while once its worker has it: time to kill a worker or signal the run
    if os.environ.get("STARTED_DIR"):  # says which processes are inside a unit
        open(os.path.join(os.environ["STARTED_DIR"], str(os.getpid())), "w").close()
    time.sleep(float(sys.argv[1]))
    yield from original(*args)
workers.unit_segments = slow
command.tokenize_main(sys.argv[2:])
"""


def start_tokenize(delay: float, *args, started: Path | None = None) -> subprocess.Popen:
    env = {**clean_env(), **({"STARTED_DIR": str(started)} if started else {})}
    return subprocess.Popen([sys.executable, "-c", SLOW_UNITS, str(delay), *map(str, args)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def children(pid: int) -> list[int]:
    found = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in found.read_text().split()] if found.exists() else []


def wait_for(condition, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_a_killed_worker_stops_the_run_with_one_line_and_resume_finishes_it(tmp_path):
    """Was: multiprocessing.Pool waits forever for the killed worker's unit."""
    corpus, out = jsonl(tmp_path / "c.jsonl", 3000), tmp_path / "out"
    started = tmp_path / "started"
    started.mkdir()
    run = start_tokenize(1.0, corpus, "--out", out, "--workers", 2, started=started)
    wait_for(lambda: any(started.iterdir()))  # a worker inside a unit
    killed = int(next(started.iterdir()).name)
    os.kill(killed, signal.SIGKILL)
    _, err = run.communicate(timeout=120)
    lines = [line for line in err.splitlines() if line.startswith("moe-lightning tokenize")]
    assert run.returncode == 1 and len(lines) == 1, err
    assert "--resume" in lines[0] and "tokenize: unit " in lines[0]
    assert f"failed: its worker process (pid {killed}) was killed by SIGKILL" in lines[0]
    assert not list(out.glob("*.partial")) and not (out / "manifest.json").exists()
    tokenize_main([str(corpus), "--out", str(out), "--workers", "2", "--resume"])
    reference = tokenize_to_folder([str(corpus)], str(tmp_path / "ref"), workers=1)
    assert json.loads((out / "manifest.json").read_text())["tokens"] == reference["tokens"]


SIGNAL_UNIT_1 = """
import os, signal, sys, time
from moe_lightning.data.tokenize import command, plan, workers
plan.MIN_UNIT_BYTES = 20_000
original, real_wait = workers.unit_segments, workers.wait
def segments(unit, *args):  # unit 1's worker gets the signal a second after the others finished
    if unit["index"] == 1:
        time.sleep(1)
        os.kill(os.getpid(), getattr(signal, sys.argv[1]))
    yield from original(unit, *args)
def wait(*args, **kwargs):  # so the pool breaks after a wait returned and before the next submit
    done, pending = real_wait(*args, **kwargs)
    time.sleep(2)
    return done, pending
workers.unit_segments, workers.wait = segments, wait
command.tokenize_main(sys.argv[2:])
"""


def signal_unit_1(signal_name: str, corpus: Path, out: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", SIGNAL_UNIT_1, signal_name, str(corpus), "--out", str(out),
                           "--workers", "2"], env=clean_env(), capture_output=True, text=True, timeout=300)


def test_a_worker_killed_between_two_submissions_is_one_line_naming_its_unit(tmp_path):
    """Was: ``executor.submit`` on the broken pool raised a traceback; and the line named the lowest unit in
    flight, or the one being submitted, not the dead worker's."""
    corpus, out = jsonl(tmp_path / "c.jsonl", 3000), tmp_path / "out"
    run = signal_unit_1("SIGKILL", corpus, out)
    assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("moe-lightning tokenize: error: tokenize: unit 1 (") and "bytes 20,000-" in last, last
    assert "its worker process (pid " in last and ") was killed by SIGKILL" in last
    assert not list(out.glob("*.partial")) and (out / "part-00000.done.json").exists()


def test_fit_on_a_token_folder_a_live_tokenize_writes_waits_for_it_and_a_dead_ones_folder_is_one_line(tmp_path,
                                                                                                     capfd):
    """Issue 33, item 3. Before: while ``tokenize`` was still writing the folder, ``fit`` refused with "the tokenize
    run that wrote it did not finish ... rerun with --resume" (and before its first shard, read the folder's
    bookkeeping files as text); the docs say fit waits, as it does for text it tokenizes itself."""
    corpus, out = jsonl(tmp_path / "c.jsonl", 300), tmp_path / "out"
    run = start_tokenize(0.5, corpus, "--out", out, "--workers", 1)  # 4 units of 20 kB, each half a second
    wait_for(lambda: (out / planning.PLAN).exists())  # planned and locked: the units are under way
    data = TextDataModule(str(out), seq_len=16, batch_size=2)  # waits for the tokenize to finish
    assert run.wait(timeout=120) == 0 and (out / "manifest.json").exists()
    said = capfd.readouterr().err
    assert f"data.source={str(out)!r}: a tokenize is still writing it (host {socket.gethostname()}, pid {run.pid}); " \
           "waiting for it to finish." in said
    data.setup()
    assert len(data.train_set) > 0

    dead, stopped = tmp_path / "dead", start_tokenize(60, corpus, "--out", tmp_path / "dead", "--workers", 1)
    wait_for(lambda: (dead / planning.PLAN).exists())
    for pid in [*children(stopped.pid), stopped.pid]:
        os.kill(pid, signal.SIGKILL)  # killed: its partial folder has a plan, no manifest, no live holder
    stopped.wait(timeout=60)
    with pytest.raises(FileNotFoundError) as refused:
        TextDataModule(str(dead), seq_len=16)
    message = str(refused.value)
    assert message.startswith(f"data.source={str(dead)!r} is a token folder with no manifest.json: the tokenize "
                              "run that wrote it did not finish and no process is writing it now") and "\n" not in message


WORKERS_CANNOT_START = """
import os, sys
from moe_lightning.data.tokenize import command, plan, workers
plan.MIN_UNIT_BYTES = 20_000
main, original = os.getpid(), workers.load_tokenizer
def load(path):  # fine in the main process, fails in every worker's initializer
    if os.getpid() != main:
        raise OSError("the tokenizer file went away")
    return original(path)
workers.load_tokenizer = load
command.tokenize_main(sys.argv[1:])
"""


def test_workers_that_cannot_start_are_a_failure_not_a_stop(tmp_path):
    """A failing initializer ends its worker with status 0, the pool then ends the others with SIGTERM. Was:
    "stopped by SIGTERM", exit 143 (and in fit a preemption, rerun forever)."""
    corpus, out = jsonl(tmp_path / "c.jsonl", 3000), tmp_path / "out"
    run = subprocess.run([sys.executable, "-c", WORKERS_CANNOT_START, str(corpus), "--out", str(out), "--workers",
                          "2"], env=clean_env(), capture_output=True, text=True, timeout=300)
    assert run.returncode == 1, run.stderr
    last = run.stderr.strip().splitlines()[-1]
    assert "could not start (the error is printed above)" in last and "stopped" not in last
    assert "the tokenizer file went away" in run.stderr


def test_sigterm_that_reaches_a_worker_first_is_a_stop_not_a_worker_failure(tmp_path):
    """SLURM signals every process of a step: a worker may end by SIGTERM before the main process hears it.
    Was: "unit 0 failed: a worker process died", exit 1 (and fit then did not requeue)."""
    corpus, out = jsonl(tmp_path / "c.jsonl", 3000), tmp_path / "out"
    run = signal_unit_1("SIGTERM", corpus, out)
    assert run.returncode == 128 + signal.SIGTERM, run.stderr
    assert "stopped by SIGTERM" in run.stderr.strip().splitlines()[-1] and "failed" not in run.stderr
    assert (out / "part-00000.done.json").exists() and not list(out.glob("*.partial"))


def test_a_bad_record_on_a_worker_stops_the_pool_at_its_unit_in_one_line(tmp_path, monkeypatch):
    """The pool path of the next test: the worker's error comes back pickled and every other worker stops."""
    monkeypatch.setattr(planning, "MIN_UNIT_BYTES", 20_000)
    corpus = jsonl(tmp_path / "c.jsonl", 4000, bad_at=900)
    with pytest.raises(TokenizeError) as raised:
        tokenize_to_folder([str(corpus)], str(tmp_path / "out"), workers=2, num_tasks=1, task_index=0)
    message = str(raised.value)
    assert message.startswith("tokenize: unit ") and "failed:" in message and "not valid JSON" in message
    unit = int(message.removeprefix("tokenize: unit ").split()[0])
    records = sorted(int(p.name[5:10]) for p in (tmp_path / "out").glob("part-*.done.json"))
    assert unit not in records and len(records) < 20 and not list((tmp_path / "out").glob("*.partial"))


def test_a_bad_record_stops_at_its_unit_keeping_what_finished(tmp_path, monkeypatch):
    """Was: reported only after every other unit had been tokenized."""
    monkeypatch.setattr(planning, "MIN_UNIT_BYTES", 20_000)
    corpus = jsonl(tmp_path / "c.jsonl", 4000, bad_at=900)
    with pytest.raises(TokenizeError) as raised:
        tokenize_to_folder([str(corpus)], str(tmp_path / "out"), workers=1)
    message = str(raised.value)
    assert "failed:" in message and "c.jsonl:byte" in message and "not valid JSON" in message
    plan = json.loads((tmp_path / "out" / "tokenize-plan.json").read_text())
    done = sorted(int(p.name[5:10]) for p in (tmp_path / "out").glob("part-*.done.json"))
    failed = int(message.split("unit ")[1].split(" ")[0])
    assert done == list(range(failed)) and failed < len(plan["units"]) - 3  # stopped there, earlier units kept
    assert f"{failed} of {len(plan['units'])} units are finished and kept" in message


def test_a_second_tokenize_into_the_folder_is_refused_naming_the_holder_and_sigterm_stops_the_workers(tmp_path):
    corpus, out = jsonl(tmp_path / "c.jsonl", 3000), tmp_path / "out"
    run = start_tokenize(1.0, corpus, "--out", out, "--workers", 2)
    wait_for(lambda: len(children(run.pid)) >= 2)
    second = subprocess.run([sys.executable, "-m", "moe_lightning", "tokenize", str(corpus), "--out", str(out),
                             "--resume"], env=clean_env(), capture_output=True, text=True, timeout=120)
    assert second.returncode == 1 and f"pid {run.pid}" in second.stderr and "another tokenize" in second.stderr
    workers = children(run.pid)
    run.send_signal(signal.SIGTERM)
    _, err = run.communicate(timeout=60)
    assert run.returncode == 128 + signal.SIGTERM and "stopped by SIGTERM" in err and "--resume" in err
    assert not any(Path(f"/proc/{w}").exists() for w in workers)  # no worker goes on writing
    assert not list(out.glob("*.partial"))
    finished = {p.name: p.stat().st_mtime_ns for p in out.glob("part-*.npy")}
    tokenize_main([str(corpus), "--out", str(out), "--workers", "1", "--resume"])  # the stopped run's lock is gone
    assert all(out.joinpath(name).stat().st_mtime_ns == t for name, t in finished.items())


HOLD_TASK = """
import sys
from pathlib import Path
from moe_lightning.run.locks import lock_folder
lock_folder(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
print("holding", flush=True)
sys.stdin.read()
"""


def test_the_tasks_of_an_array_share_the_folder_and_a_plain_run_or_a_task_run_twice_is_refused_naming_it(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    task = subprocess.Popen([sys.executable, "-c", HOLD_TASK, str(out), "1", "2"], env=clean_env(),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert task.stdout.readline().strip() == "holding"
        held = locks.lock_folder(out, 0, 2)  # another task of the array: admitted
        named = f"(task 1 of 2, host {socket.gethostname()}, pid {task.pid}; lock "
        with pytest.raises(locks.FolderInUseError, match=re.escape(f"{out} is in use by another run {named}")):
            locks.lock_folder(out, 1, 2)  # the same task index again
        held.release()
        with pytest.raises(locks.FolderInUseError, match=re.escape(named)):
            locks.lock_folder(out, 0, 1)  # a plain run while a task writes
    finally:
        task.kill()  # SIGKILL: its locks go with it, its record stays
        task.communicate()
    locks.lock_folder(out, 0, 1).release()  # the killed task's lock is no one's now


def test_sigterm_in_the_one_process_path_is_a_stop_not_a_unit_failure(tmp_path):
    """Was: Stopped caught as the unit's failure: "unit N failed", exit 1."""
    corpus, out = jsonl(tmp_path / "c.jsonl", 3000), tmp_path / "out"
    run = start_tokenize(1.0, corpus, "--out", out, "--workers", 1)
    wait_for(lambda: (out / "tokenize-plan.json").exists())
    run.send_signal(signal.SIGTERM)
    _, err = run.communicate(timeout=60)
    assert run.returncode == 128 + signal.SIGTERM and "stopped by SIGTERM" in err and "failed" not in err, err
    assert not list(out.glob("*.partial"))


def test_two_tasks_run_concurrently_write_the_same_stream_as_one(tmp_path):
    corpus = jsonl(tmp_path / "c.jsonl", 3000)
    text = tmp_path / "t.txt"
    text.write_text("a long text document " * 5000)
    one = tokenize_to_folder([str(corpus), str(text)], str(tmp_path / "one"), workers=1, num_tasks=1, task_index=0)
    tasks = [subprocess.Popen([sys.executable, "-c", SLOW_UNITS, "0.05", str(corpus), str(text), "--out",
                               str(tmp_path / "two"),
                               "--workers", "1"], env={**clean_env(), "SLURM_ARRAY_TASK_ID": str(i),
                                                       "SLURM_ARRAY_TASK_COUNT": "2"},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    outputs = [t.communicate(timeout=300) for t in tasks]
    assert [t.returncode for t in tasks] == [0, 0], outputs
    manifest = json.loads((tmp_path / "two" / "manifest.json").read_text())
    assert len(manifest["shards"]) > 2
    done = [int(p.name[5:10]) for p in (tmp_path / "two").glob("part-*.done.json")]
    assert len(done) == len(manifest["shards"])
    streams = [TextDataModule(str(tmp_path / name), seq_len=8) for name in ("one", "two")]
    for dm in streams:
        dm.setup()
    np.testing.assert_array_equal(streams[0].train_set.tokens[:], streams[1].train_set.tokens[:])
    assert manifest["tokens"] == one["tokens"]


PLAN_SLOWLY = """
import sys, time
from moe_lightning.data.tokenize import command, folder
original = folder.new_plan
def slow(*args):  # planning a large corpus takes a while: time for the other task to arrive
    print("planned", flush=True)
    time.sleep(1)
    return original(*args)
folder.new_plan = slow
command.tokenize_main(sys.argv[1:])
"""


def test_the_tasks_of_an_array_plan_once_and_check_only_their_own_files(tmp_path):
    """Was: every task that started before the plan existed listed, read and planned the whole corpus, and every
    task listed and stat'ed every input file again to check the plan."""
    folder = tmp_path / "in"
    folder.mkdir()
    for i in range(4):
        jsonl(folder / f"f{i}.jsonl", 5000)  # about 1.2 MB each: units of about 1 MiB, both tasks have some
    out = tmp_path / "out"
    tasks = [subprocess.Popen([sys.executable, "-c", PLAN_SLOWLY, str(folder), "--out", str(out), "--workers", "1",
                               "--task-index", str(i), "--num-tasks", "2", "--resume"], env=clean_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    outputs = [t.communicate(timeout=300) for t in tasks]
    assert [t.returncode for t in tasks] == [0, 0], outputs
    assert sum(o.count("planned") for o, _ in outputs) == 1, outputs
    assert (out / "manifest.json").exists()
    # a file added to the folder: a task of the array is not the one to notice; the plain run that finishes is
    jsonl(folder / "f9.jsonl", 10)
    assert tokenize_to_folder([str(folder)], str(out), workers=1, resume=True, task_index=1, num_tasks=2) is not None
    with pytest.raises(TokenizeError, match="added 1 file"):
        tokenize_to_folder([str(folder)], str(out), workers=1, resume=True, task_index=0, num_tasks=1)
    # a file of a task's own units changed: that task refuses
    plan = json.loads((out / "tokenize-plan.json").read_text())
    own = plan["inputs"][plan["units"][3]["start"][0]][0]  # unit 3 is task 1's
    Path(own).write_text(Path(own).read_text() + "\n")
    with pytest.raises(TokenizeError, match="changed 1 file"):
        tokenize_to_folder([str(folder)], str(out), workers=1, resume=True, task_index=1, num_tasks=2)


def slurm(monkeypatch, **variables):
    for key in [k for k in os.environ if k.startswith(("SLURM_", "RANK", "WORLD_SIZE"))]:
        monkeypatch.delenv(key)
    for key, value in variables.items():
        monkeypatch.setenv(f"SLURM_ARRAY_TASK_{key}", str(value))


def test_task_selection_reads_index_and_count_separately_and_names_what_is_wrong(monkeypatch):
    """Was: a resubmitted index ran as a whole run, an explicit --task-index was overwritten by the environment,
    --num-tasks alone became task 0, and a stepped array failed naming flags never given."""
    task = task_from_environment
    slurm(monkeypatch, ID=17, MIN=17, MAX=17, COUNT=1)  # sbatch --array=17, resubmitting task 17 of 0-63
    assert task(None, None, {"tasks": 64, "first_task_id": 0})[:2] == (17, 64)
    slurm(monkeypatch, ID=5, MIN=0, MAX=63, COUNT=64)
    assert task(3, None)[:2] == (3, 64) and task(None, 8)[:2] == (5, 8) and task(None, None)[:2] == (5, 64)
    slurm(monkeypatch, ID=12, MIN=2, MAX=62, COUNT=31, STEP=2)  # --array=2-62:2
    assert task(None, None)[:2] == (5, 31)
    slurm(monkeypatch, ID=9, MIN=1, MAX=9, COUNT=3)  # --array=1,5,9: no grid to count on
    with pytest.raises(TokenizeError, match="SLURM_ARRAY_TASK_ID.*--array=1,5,9"):
        task(None, None)
    slurm(monkeypatch)
    with pytest.raises(TokenizeError, match="--num-tasks=64 needs --task-index"):
        task(None, 64)
    with pytest.raises(TokenizeError, match="--task-index=3 needs --num-tasks"):
        task(3, None)
    with pytest.raises(TokenizeError, match="--task-index=4 must be in 0..3 .--num-tasks=4"):
        task(4, 4)
    assert task(None, None)[:2] == (0, 1)


def test_a_task_counting_other_tasks_than_the_plan_is_refused(tmp_path, monkeypatch):
    corpus = jsonl(tmp_path / "c.jsonl", 300)
    slurm(monkeypatch)
    monkeypatch.setattr(planning, "MIN_UNIT_BYTES", 2000)
    tokenize_to_folder([str(corpus)], str(tmp_path / "out"), workers=1, num_tasks=4, task_index=0)
    assert json.loads((tmp_path / "out" / "tokenize-plan.json").read_text())["tasks"] == 4
    with pytest.raises(TokenizeError, match="array of 4 tasks, this task counts 2; rerun it with --num-tasks 4"):
        tokenize_to_folder([str(corpus)], str(tmp_path / "out"), workers=1, num_tasks=2, task_index=1)
    for i in (1, 2):
        assert tokenize_to_folder([str(corpus)], str(tmp_path / "out"), workers=1, num_tasks=4, task_index=i) is None
    # the explicit final step: one plain run finishes what is left (task 3's units) and writes the manifest
    manifest = tokenize_to_folder([str(corpus)], str(tmp_path / "out"), workers=1, resume=True, num_tasks=1)
    assert manifest["tokens"] == tokenize_to_folder([str(corpus)], str(tmp_path / "ref"), workers=1)["tokens"]


@pytest.mark.parametrize("code", ["ENOSYS", "ENOLCK"])
def test_a_file_system_without_flock_is_one_line_naming_the_folder_and_the_mount_option(tmp_path, monkeypatch, code):
    """Was: a raw OSError (Lustre without -o flock, NFS without lockd)."""
    import errno
    import fcntl

    def no_locks(fd, operation):
        raise OSError(getattr(errno, code), os.strerror(getattr(errno, code)))
    monkeypatch.setattr(fcntl, "flock", no_locks)
    with pytest.raises(TokenizeError, match=f"cannot lock .*{tmp_path / 'out'}.*-o flock.*lockd"):
        tokenize_to_folder([str(jsonl(tmp_path / "c.jsonl", 10))], str(tmp_path / "out"), workers=1)


def test_a_text_file_is_cut_in_the_same_places_for_any_number_of_tasks(tmp_path, monkeypatch):
    """Was: the unit size divided by the task count, so cuts (and a Metaspace tokenizer's ids) moved with it."""
    slurm(monkeypatch)
    monkeypatch.setattr(planning, "MIN_UNIT_BYTES", 2000)
    text = tmp_path / "t.txt"
    text.write_text("a long text document " * 20_000)
    units = []
    for tasks in (1, 2, 8):
        tokenize_to_folder([str(text)], str(tmp_path / f"out{tasks}"), workers=1, num_tasks=tasks, task_index=0)
        units.append(json.loads((tmp_path / f"out{tasks}" / "tokenize-plan.json").read_text())["units"])
    assert len(units[0]) > 8 and units[0] == units[1] == units[2]


def test_a_task_reports_progress_over_its_units_and_removes_its_partial_records(tmp_path, monkeypatch, capsys):
    """Was: progress over every task's units (never reaching 100%), and a killed unit record's partial left."""
    slurm(monkeypatch)
    monkeypatch.setattr(planning, "MIN_UNIT_BYTES", 20_000)
    corpus, out = jsonl(tmp_path / "c.jsonl", 3000), tmp_path / "out"
    tokenize_to_folder([str(corpus)], str(out), workers=1, num_tasks=2, task_index=0)
    plan = json.loads((out / "tokenize-plan.json").read_text())
    mine = sum(u["bytes"] for u in plan["units"] if u["index"] % 2 == 0)
    assert f"of {mine / 1e6:,.3f} MB read" in capsys.readouterr().err
    stale = out / "part-00002.done.json.x1y2.partial"  # a unit record whose writer was killed
    stale.write_text("{")
    tokenize_to_folder([str(corpus)], str(out), workers=1, num_tasks=2, task_index=0)
    assert not stale.exists()


def test_resume_checks_arguments_and_inputs_even_when_the_folder_is_complete(tmp_path, capsys):
    """Was: "nothing to do" and exit 0 for a complete folder of another corpus; added files silently left out."""
    (tmp_path / "in").mkdir()
    for i in range(3):
        (tmp_path / "in" / f"{i}.txt").write_text(f"document {i} " * 50)
    out = str(tmp_path / "out")
    tokenize_to_folder([str(tmp_path / "in")], out, workers=1)
    other = jsonl(tmp_path / "other.jsonl", 10)
    with pytest.raises(SystemExit):
        tokenize_main([str(other), "--out", out, "--resume"])
    assert "other sources" in capsys.readouterr().err
    (tmp_path / "in" / "3.txt").write_text("a file added later")
    with pytest.raises(TokenizeError, match=r"added 1 file\(s\), e.g. .*3.txt"):
        tokenize_to_folder([str(tmp_path / "in")], out, resume=True)


# ---- large and many files ---------------------------------------------------------------------------------

def test_a_large_text_file_is_cut_into_units_between_words_with_the_ids_of_one_encode(tmp_path, monkeypatch):
    """A .txt is one document: cut by byte range (between a word and the space after it), encoded in bounded
    batches, its pieces give the byte-level BPE's ids of encoding it whole, one end-of-document at the end."""
    from tests.data.test_tokenize import bpe_tokenizer
    from moe_lightning.data.tokenizer import load_tokenizer
    words = [f"w{i % 97}ord{'é' * (i % 3)}" for i in range(20000)]
    text = "".join(w + (" " if i % 11 else "\n  ") for i, w in enumerate(words))
    (tmp_path / "big.txt").write_text(text)
    tok = bpe_tokenizer(tmp_path / "bpe.json", text[:20000])
    monkeypatch.setattr(planning, "MIN_UNIT_BYTES", 10_000)
    monkeypatch.setattr(reading, "BATCH_CHARS", 3000)
    monkeypatch.setattr(reading.sources, "SEGMENT_CHARS", 3000)  # read and cut a few KB at a time
    manifest = tokenize_to_folder([str(tmp_path / "big.txt")], str(tmp_path / "out"), tok, workers=2)
    plan = json.loads((tmp_path / "out" / "tokenize-plan.json").read_text())
    assert len(plan["units"]) > 5 and manifest["documents"] == 1
    dm = TextDataModule(str(tmp_path / "out"), seq_len=8, tokenizer=tok)
    dm.setup()
    tokenizer = load_tokenizer(tok)
    np.testing.assert_array_equal(dm.train_set.tokens[:], np.append(tokenizer.encode(text), tokenizer.eos_id))


def test_an_oversized_document_is_encoded_in_pieces_whatever_it_holds(tmp_path, monkeypatch):
    """Was: a 200 MB document aborted the process inside the tokenizer library. A document is now handed to the
    tokenizer in pieces cut between words (the same ids) or, in a run without whitespace, at a length limit."""
    from moe_lightning.data import sources
    monkeypatch.setattr(sources, "SEGMENT_CHARS", 500)
    monkeypatch.setattr(sources, "MAX_SEGMENT_CHARS", 2000)
    calls = []
    encode_batch = ByteTokenizer.encode_batch
    monkeypatch.setattr(ByteTokenizer, "encode_batch", lambda self, texts: calls.append(max(map(len, texts)))
                        or encode_batch(self, texts))
    prose, blob = " ".join(f"token{i}" for i in range(2000)), "y" * 5000
    for kind in ("jsonl", "txt"):
        path = tmp_path / f"doc.{kind}"
        path.write_text("".join(json.dumps({"text": t}) + "\n" for t in (prose, blob)) if kind == "jsonl" else
                        prose + "\n" + blob)
        manifest = tokenize_to_folder([str(path)], str(tmp_path / kind), workers=1)
        dm = TextDataModule(str(tmp_path / kind), seq_len=8)
        dm.setup()
        texts = [prose, blob] if kind == "jsonl" else [prose + "\n" + blob]
        expected = np.concatenate([np.append(np.frombuffer(t.encode(), np.uint8), 256) for t in texts])
        np.testing.assert_array_equal(dm.train_set.tokens[:], expected)
        assert manifest["documents"] == len(texts) and max(calls) <= 2000
        calls.clear()


def test_many_small_files_are_grouped_and_the_manifest_does_not_list_them(tmp_path):
    (tmp_path / "in").mkdir()
    for i in range(400):
        (tmp_path / "in" / f"{i:04d}.txt").write_text(f"small file {i}")
    manifest = tokenize_to_folder([str(tmp_path / "in")], str(tmp_path / "out"), workers=2)
    assert len((tmp_path / "out" / "manifest.json").read_text()) < 2000  # was: every input file listed
    assert manifest["shard_count"] == 1 and manifest["documents"] == 400 and manifest["input_files"] == 400


def test_parquet_rows_with_null_text_are_counted_in_the_summary(tmp_path, capsys):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"text": ["a row", None, "another", None, None]}), tmp_path / "t.parquet")
    tokenize_main([str(tmp_path / "t.parquet"), "--out", str(tmp_path / "out"), "--workers", "1"])
    assert "(2 documents; 3 rows with null text skipped)" in capsys.readouterr().out


def test_validation_order_is_torchs_distributed_one_computed_per_index():
    """Was: Lightning put a ``DistributedSampler`` in the validation loaders, a list of every index on every rank
    at every validation (0.5 GB a rank at 12M held-out sequences)."""
    from torch.utils.data import DistributedSampler

    from moe_lightning.data.sampling import InOrderSampler
    for size, ranks in [(10, 3), (7, 4), (3, 8), (12, 4)]:
        for rank in range(ranks):
            reference = DistributedSampler(range(size), num_replicas=ranks, rank=rank, shuffle=False)
            assert list(InOrderSampler(range(size), num_replicas=ranks, rank=rank)) == list(reference)
    tracemalloc.start()
    try:
        first = list(itertools.islice(iter(InOrderSampler(range(10**12), num_replicas=8, rank=5)), 3))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert first == [5, 13, 21] and peak < 1 << 20, peak


def test_max_tokens_stops_tokenizing_at_the_batch_that_reaches_it(tmp_path):
    """Was: the whole file was tokenized (and held twice) before ``max_tokens`` was looked at."""
    from moe_lightning.data.tokenize.reading import BATCH_CHARS, tokenize_in_memory
    text = tmp_path / "big.txt"
    text.write_text("word " * (2 * BATCH_CHARS))  # 10 batches of bytes
    tokens, files = tokenize_in_memory([text], ByteTokenizer(), "text", max_tokens=1000)
    assert files == 1 and 1000 <= len(tokens) <= BATCH_CHARS + 1
    whole, _ = tokenize_in_memory([text], ByteTokenizer(), "text", max_tokens=None)
    np.testing.assert_array_equal(tokens, whole[:len(tokens)])  # the same prefix


def test_a_stream_arrow_file_is_read_no_further_than_the_wanted_batches(tmp_path):
    """Was: every unit of a stream-format file (what ``datasets`` writes) read it to its end."""
    import pyarrow as pa

    from moe_lightning.data.sources import _arrow_batches
    path = tmp_path / "stream.arrow"
    schema = pa.schema([("text", pa.string())])
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
        for i in range(6):
            writer.write_batch(pa.record_batch([pa.array([f"batch {i}"])], schema=schema))
    read = []

    def counted():
        for batch in pa.ipc.open_stream(pa.OSFile(str(path))):
            read.append(batch)
            yield batch
    got = [b.column(0)[0].as_py() for b in _arrow_batches(counted(), [1, 2])]
    assert got == ["batch 1", "batch 2"] and len(read) == 3


@pytest.mark.skipif(sys.platform != "linux", reason="glibc's malloc_trim")
def test_heap_ceiling_returns_freed_heap_pages_once_memory_grows_past_it():
    """The mechanism that keeps a tokenize worker's memory flat: freed heap memory, pinned by small blocks between
    (the fragmentation batches leave), goes back to the system when the resident size passes the ceiling."""
    script = """
import sys
from moe_lightning.data.tokenize.workers import HeapCeiling
heap = HeapCeiling()
big, pins = [], []
for i in range(1500):  # 150 MB of 100 KB blocks (below the mmap threshold: from the heap), each pinned in place
    big.append(bytes(100_000) + bytes([i % 256]))
    pins.append(bytes(2000) + bytes([i % 256]))
before = heap._resident()
del big
freed = heap._resident()
heap.check()
print(before >> 20, freed >> 20, heap._resident() >> 20, heap.ceiling >> 20)
"""
    out = subprocess.run([sys.executable, "-c", script], env=clean_env(), capture_output=True, text=True, timeout=120)
    before, freed, after, ceiling = map(int, out.stdout.split())
    assert before - freed < 20, (before, freed)  # free() alone keeps the pages: the creep the ceiling is for
    assert freed - after > 100 and ceiling <= after + 5, (freed, after, ceiling)


def test_plans_and_manifests_are_written_an_item_a_line_from_lists_or_iterators(tmp_path):
    """A manifest's shards stream from the unit records (an iterator) and a plan's units from a list: the JSON
    reads back as the record, each item on a line of its own (the file is read by fit and by people), and a
    failure part-way leaves the file that was there."""
    units = [{"index": i, "start": [0, i], "end": [0, i + 1], "bytes": 1} for i in range(1000)]
    record = {"format": "v", "nested": {"a": [1, 2]}, "empty": [], "units": units, "none": None, "naïve ✓": "東京",
              "shards": ({"file": f"part-{i:05d}-000.npy", "tokens": i} for i in range(3)), "no shards": iter(())}
    files.write_json(tmp_path / "r.json", record)
    text = (tmp_path / "r.json").read_text()
    assert json.loads(text) == {**record, "shards": [{"file": f"part-{i:05d}-000.npy", "tokens": i} for i in range(3)],
                                "no shards": []}
    assert sum(line.startswith('  {"index": ') for line in text.splitlines()) == 1000
    files.write_json(tmp_path / "e.json", {})
    assert json.loads((tmp_path / "e.json").read_text()) == {}

    def failing():
        yield {"file": "part-00000-000.npy"}
        raise TokenizeError("a record changed")
    with pytest.raises(TokenizeError):
        files.write_json(tmp_path / "r.json", {"format": "v", "shards": failing()})
    assert (tmp_path / "r.json").read_text() == text  # the old file, and no partial file beside it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e.json", "r.json"]
    with pytest.raises(TypeError, match="key 1 is not a string"):
        files.write_json(tmp_path / "k.json", {1: "one"})


def test_a_manifest_whose_unit_records_change_between_its_two_readings_is_not_written(tmp_path, monkeypatch):
    """The manifest's totals come from a first reading of the unit records and its shards from a second: if they
    disagree (a record rewritten in between) the manifest would describe other shards, so none is written."""
    corpus = jsonl(tmp_path / "c.jsonl", 50)
    tokenize_to_folder([str(corpus)], str(tmp_path / "out"), workers=1)
    (tmp_path / "out" / "manifest.json").unlink()
    readings, read = [], files.unit_records

    def changing(folder, plan):
        readings.append(1)
        for record in read(folder, plan):
            yield {**record, "shards": record["shards"] * len(readings)}  # the second reading lists more shards
    monkeypatch.setattr(files, "unit_records", changing)
    with pytest.raises(TokenizeError, match="changed while the manifest was written"):
        tokenize_to_folder([str(corpus)], str(tmp_path / "out"), workers=1, resume=True)
    assert not any(p.name.startswith("manifest.json") for p in (tmp_path / "out").iterdir())


def test_partial_plans_and_manifests_of_a_killed_task_are_removed_by_the_next_writer_and_nothing_else(tmp_path,
                                                                                                     monkeypatch):
    """A task killed while writing the plan or the manifest leaves ``atomic_write``'s partial copy; the next task
    to write that file (under the lock that makes it the only writer) removes it, and files merely named alike."""
    corpus, out = jsonl(tmp_path / "c.jsonl", 50), tmp_path / "out"
    out.mkdir()
    (out / "tokenize-plan.json.k1ll3d_x.partial").write_text("{")
    tokenize_to_folder([str(corpus)], str(out), workers=1)
    assert not (out / "tokenize-plan.json.k1ll3d_x.partial").exists()
    (out / "manifest.json").unlink()
    left = ["manifest.json.ab_12xyz.partial", "manifest.json.backup", "manifest.json.mine.partial",
            "notes-manifest.json.ab_12xyz.partial"]
    for name in left:
        (out / name).write_text("{")
    assert tokenize_to_folder([str(corpus)], str(out), workers=1, resume=True)["documents"] == 50
    assert [name for name in left if (out / name).exists()] == left[1:]
    # where flock is local to each node, a writer on another node may be live: its copy stays
    monkeypatch.setattr(locks, "local_only_flock", lambda folder: "lustre at /x is mounted localflock")
    (out / "manifest.json").unlink()
    (out / left[0]).write_text("{")
    tokenize_to_folder([str(corpus)], str(out), workers=1, resume=True)
    assert (out / left[0]).exists() and (out / "manifest.json").exists()


@pytest.mark.parametrize("first_chunk, chunk", [(1 << 10, 1 << 16), (2, 7)])
def test_a_ranks_order_does_not_depend_on_the_chunks_its_indices_are_computed_in(monkeypatch, first_chunk, chunk):
    """The sampler computes an epoch's indices in chunks that grow (a small first one: a quick first batch); the
    order is the documented one (tests/data/reference_orders.py) whatever the chunks."""
    from moe_lightning.data import sampling
    monkeypatch.setattr(sampling, "FIRST_CHUNK", first_chunk)
    monkeypatch.setattr(sampling, "CHUNK", chunk)
    for rank in range(3):
        sampler = ResumableSampler(range(5000), num_replicas=3, rank=rank, seed=11)
        sampler.set_epoch(2)
        expected = list(resumable_order(5000, 11, 2, 3, rank))
        assert list(sampler) == expected and len(expected) == 1666
        sampler.resume_epoch, sampler.resume_samples = 2, 1001  # resumed part-way through the epoch
        assert list(sampler) == list(resumable_order(5000, 11, 2, 3, rank, start=1001))
    sizes = [len(piece) for piece in sampling.dealt(5, 3 * 300_000 + 5, 3)]
    assert sizes[:3] == [first_chunk, min(2 * first_chunk, chunk), min(4 * first_chunk, chunk)]
    assert sum(sizes) == 300_000 and max(sizes) == chunk


def test_progress_counts_bytes_of_input_not_characters_of_text(tmp_path):
    """Was: progress added characters of text to a total of bytes ("50.0 of 52.0 MB ... done"). Every reader now
    counts the bytes it reads, as it reads them: a whole file's count is its planned size, with multi-byte UTF-8
    and JSON escapes (6 bytes a character), and a table's its groups' sizes (Parquet's as encoded)."""
    text = "naïve café — 東京 🙂 " * 3000
    (tmp_path / "t.txt").write_text(text * 40)  # 3.8 MB: several reads
    (tmp_path / "t.jsonl").write_text("".join(json.dumps({"text": text[:i * 997]}) + "\n\n" for i in range(1, 40)))
    paths = [tmp_path / "t.txt", tmp_path / "t.jsonl"]
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
        table = pa.table({"text": [text[:i % 50 * 7] for i in range(5000)] + [None], "n": list(range(5001))})
        pq.write_table(table, tmp_path / "t.parquet", row_group_size=700)
        with pa.ipc.new_stream(str(tmp_path / "t.arrow"), table.schema) as writer:
            for batch in table.to_batches(max_chunksize=900):
                writer.write_batch(batch)
        paths += [tmp_path / "t.parquet", tmp_path / "t.arrow"]
    except ImportError:
        pass
    for path in paths:
        plan = reading.reading_plan([path], "text")
        groups = plan["groups"].get("0")
        whole = {"index": 0, "start": [0, 0], "end": [1, 0], "bytes": sum(groups) if groups else plan["inputs"][0][1]}
        tally, seen = reading.new_tally(), []
        for _ in reading.unit_segments(whole, plan, tally):
            seen.append(tally["bytes_read"])
        assert tally["bytes_read"] == whole["bytes"] and seen == sorted(seen), path.name
        assert len(set(seen)) > 3, path.name  # counted as the file is read, not at its end
        if groups is None:  # what was counted before: fewer characters than bytes
            assert sum(len(t) for t, _ in reading.unit_segments(whole, plan, reading.new_tally())) \
                < whole["bytes"]


def test_a_finished_corpus_on_a_read_only_mount_is_read_without_taking_its_locks(tmp_path):
    """Was: fit on a finished shard folder mounted read-only stopped at creating tokenize.lock (a raw
    "Read-only file system"). Nothing writes a finished folder, so it is checked and read without locks; an
    unfinished one that cannot be written is one line."""
    corpus, out, mounted = jsonl(tmp_path / "c.jsonl", 50), tmp_path / "out", tmp_path / "ro"
    first = tokenize_to_folder([str(corpus)], str(out), workers=1)
    mounted.mkdir()
    try:
        if subprocess.run(["mount", "--bind", str(out), str(mounted)], capture_output=True).returncode != 0:
            pytest.skip("bind mounts need root (CAP_SYS_ADMIN)")
    except FileNotFoundError:
        pytest.skip("no mount command")
    try:
        if subprocess.run(["mount", "-o", "remount,ro,bind", str(mounted)], capture_output=True).returncode != 0:
            pytest.skip("cannot remount read-only")
        before = sorted(p.name for p in out.iterdir())
        assert tokenize_to_folder([str(corpus)], str(mounted), workers=1, resume=True, wait=True) == first
        with pytest.raises(FileExistsError, match="pass --resume"):  # the same checks as a writable folder
            tokenize_to_folder([str(corpus)], str(mounted), workers=1)
        with pytest.raises(TokenizeError, match="other text_field"):
            tokenize_to_folder([str(corpus)], str(mounted), text_field="body", workers=1, resume=True)
        assert sorted(p.name for p in out.iterdir()) == before
        (out / "manifest.json").unlink()  # now unfinished, seen through the read-only mount
        said = r"cannot write .*ro/\.moe-lightning\.lock \(Read-only file system\), .*no manifest.json"
        with pytest.raises(TokenizeError, match=said):
            tokenize_to_folder([str(corpus)], str(mounted), workers=1, resume=True)
    finally:
        if subprocess.run(["umount", str(mounted)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mounted)], check=True)


def test_a_task_waiting_to_write_the_plan_says_for_whom_and_a_manifest_written_meanwhile_is_kept(tmp_path):
    """Tasks of an array take turns writing the plan and the manifest: one that must wait says which task holds
    the turn (a suspended holder would otherwise look like a hang); the last to finish finds the manifest written."""
    corpus, out = jsonl(tmp_path / "c.jsonl", 50), tmp_path / "out"
    out.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", f"""
import sys
from pathlib import Path
from moe_lightning.run import locks
held = locks.acquire(Path({str(out / locks.TURN_FILE)!r}), about={{"task": 3, "tasks": 8}})
print("held", flush=True)
sys.stdin.readline()  # held until the test has seen the waiting task say so
held.release()
"""], env=clean_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    waiter = None
    try:
        assert holder.stdout.readline().strip() == "held"
        waiter = subprocess.Popen([sys.executable, "-m", "moe_lightning", "tokenize", str(corpus), "--out", str(out),
                                   "--workers", "1"], env=clean_env(), stderr=subprocess.PIPE, text=True)
        said = waiter.stderr.readline()
        assert re.fullmatch(r"tokenize: waiting for task 3 of 8, host .*, pid %d to write .*tokenize-plan\.json\.\n"
                            % holder.pid, said), said
        holder.stdin.write("go\n")
        holder.stdin.flush()
        assert waiter.wait(timeout=300) == 0 and holder.wait(timeout=300) == 0
    finally:
        for process in (holder, waiter):
            if process is not None:
                process.kill()
                process.wait()
                for stream in (process.stdin, process.stdout, process.stderr):
                    if stream is not None:
                        stream.close()
    plan = json.loads((out / "tokenize-plan.json").read_text())
    written = files.summary(out)
    assert tokenize_folder._finish(out, plan, ByteTokenizer(), None, 0, 1) == written and written["documents"] == 50


def test_a_tokenizers_special_tokens_go_around_each_document_once_however_it_is_cut(tmp_path, monkeypatch):
    """Was: a Llama-style post-processor put its BOS at the start of every piece of a long document, and an
    empty document became BOS then end-of-document. Each document now gets what ``Tokenizer.encode`` gives for it
    whole, then the end-of-document id: in a JSONL cut into segments and a .txt cut into units over workers."""
    from tokenizers import Tokenizer, processors
    from tests.data.test_tokenize import bpe_tokenizer
    from moe_lightning.data.tokenizer import HFTokenizer
    words = [f"w{i % 97}ord{'é' * (i % 3)}" for i in range(8000)]
    long_text = "".join(w + (" " if i % 11 else "\n  ") for i, w in enumerate(words))
    documents = ["a short one", "", long_text, "another  short"]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in documents))
    (tmp_path / "long.txt").write_text(long_text)
    reference = Tokenizer.from_file(bpe_tokenizer(tmp_path / "bpe.json", long_text[:20000]))
    reference.add_special_tokens(["<s>"])
    reference.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[
        ("<s>", reference.token_to_id("<s>"))])
    reference.save(str(tmp_path / "bos.json"))
    monkeypatch.setattr(planning, "MIN_UNIT_BYTES", 10_000)
    monkeypatch.setattr(reading, "BATCH_CHARS", 3000)
    monkeypatch.setattr(reading.sources, "SEGMENT_CHARS", 3000)  # the long document in many pieces
    tok = str(tmp_path / "bos.json")
    manifest = tokenize_to_folder([str(tmp_path / "docs.jsonl"), str(tmp_path / "long.txt")], str(tmp_path / "out"),
                                  tok, workers=2)
    eos = HFTokenizer(tok).eos_id
    expected = [i for d in documents + [long_text] if d for i in [*reference.encode(d).ids, eos]]
    dm = TextDataModule(str(tmp_path / "out"), seq_len=8, tokenizer=tok)
    dm.setup()
    np.testing.assert_array_equal(dm.train_set.tokens[:], expected)
    assert manifest["documents"] == 4 and expected.count(reference.token_to_id("<s>")) == 4
    # a folder a version that put them around every piece finished is read as written (a run trained on it
    # resumes on the same data); one it half-wrote is not continued in this form
    plan_path, manifest_path = tmp_path / "out" / "tokenize-plan.json", tmp_path / "out" / "manifest.json"
    plan = json.loads(plan_path.read_text())
    assert plan["document_tokens"] == [[reference.token_to_id("<s>")], []]
    del plan["document_tokens"]
    plan_path.write_text(json.dumps(plan))
    assert tokenize_to_folder([str(tmp_path / "docs.jsonl"), str(tmp_path / "long.txt")], str(tmp_path / "out"), tok,
                              workers=2, resume=True)["documents"] == 4
    manifest_path.unlink()
    with pytest.raises(TokenizeError, match="written with other document_tokens"):
        tokenize_to_folder([str(tmp_path / "docs.jsonl"), str(tmp_path / "long.txt")], str(tmp_path / "out"), tok,
                           workers=2, resume=True)
