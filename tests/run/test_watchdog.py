"""The stall watchdog's parts in one process: the heartbeat, the judge (a fake clock), the report, and the thread
over an in-process store (a frozen peer is a record that stops changing; a lost store is one that raises)."""

import json
import threading

import pytest
import torch.distributed as dist

from moe_lightning.run import heartbeat
from moe_lightning.run.exits import EXIT_MAX_TIME, EXIT_STALLED
from moe_lightning.run.heartbeat import Heartbeat
from moe_lightning.run.watchdog import REPORT_FILE, Judge, RankWatchdog, check_stall_timeout, report_json, \
    report_lines, watchers


def record(rank, tick, progress, step=3, phase="forward", collective=None, **extra):
    return {"rank": rank, "host": f"node{rank}", "pid": 100 + rank, "tick": tick, "progress": progress,
            "step": step, "phase": phase, "collective": collective, "stopped": False,
            "coordinates": {"replicate": 0, "shard": rank, "expert": rank % 2}, **extra}


def a2a(seq, state="entered"):
    return {"op": "all_to_all", "dim": "expert", "seq": seq, "state": state}


def test_the_exit_status_is_its_own():
    assert EXIT_STALLED not in (0, 1, 2, EXIT_MAX_TIME) and EXIT_STALLED < 128


def test_heartbeat_records_phases_and_collectives_only_while_active():
    beat = Heartbeat(name_of={"ep-group": "expert"}.__getitem__)
    heartbeat.entered("all_to_all", "ep-group")  # inactive: nothing recorded anywhere
    heartbeat.activate(beat)
    try:
        beat.enter("forward", step=4)
        with heartbeat.collective("all_to_all", "ep-group"):
            assert beat.snapshot()["collective"] == a2a(1)
        heartbeat.entered("all_gather", "unknown-group")  # a group name_of does not know
    finally:
        heartbeat.activate(None)
    snap = beat.snapshot()
    assert snap["step"] == 4 and snap["phase"] == "forward" and snap["progress"] == 4
    assert snap["collective"] == {"op": "all_gather", "dim": "group", "seq": 2, "state": "entered"}


def test_a_frozen_rank_is_named_after_the_timeout_and_a_slow_one_never():
    judge = Judge(2, timeout_s=30, now=0)
    for t in range(0, 29):  # rank 1 stops ticking at t=0 for 29 s, then resumes: slow, not stalled
        judge.observe(0, record(0, tick=t, progress=1, collective=a2a(7)), now=t)
        judge.observe(1, record(1, tick=0, progress=1), now=t)
        assert judge.verdict(now=t) is None
    judge.observe(1, record(1, tick=1, progress=2), now=29)  # then it stops again, for good
    for t in range(29, 61):
        judge.observe(0, record(0, tick=t, progress=2, collective=a2a(8)), now=t)
        if t < 59:  # less than 30 s since rank 1 answered
            assert judge.verdict(now=t) is None
    verdict = judge.verdict(now=60)
    assert [rank for rank, _ in verdict.stalled] == [1] and verdict.waiting == [0]
    assert verdict.stalled[0][1].startswith("its process has not answered for 31 s")


def test_a_live_rank_stuck_outside_the_collective_the_others_wait_in_is_named_once_all_are_idle():
    judge = Judge(2, timeout_s=30, now=0)
    for t in range(0, 61, 3):  # both tick; rank 1 (data-loader stuck) never progresses after t=0
        judge.observe(0, record(0, tick=t, progress=min(t, 20), collective=a2a(9)), now=t)
        judge.observe(1, record(1, tick=t, progress=1, phase="data", collective=a2a(8, "finished")), now=t)
        if t < 50:  # rank 0 progressed until t=20: not yet every rank idle for 30 s
            assert judge.verdict(now=t) is None
    verdict = judge.verdict(now=60)
    assert [rank for rank, _ in verdict.stalled] == [1] and verdict.waiting == [0]
    assert "training thread made no progress" in verdict.stalled[0][1]
    lines = "\n".join(report_lines(report_json(verdict, 30, detected_by=0)))
    assert "STALLED rank 1 (host node1, pid 101; replicate 0, shard 1, expert 1): step 3, phase data, last " \
           "finished all_to_all(expert) #8" in lines
    assert "never entered all_to_all(expert) #9 that the others wait in" in lines
    assert "waiting rank 0 (host node0, pid 100; replicate 0, shard 0, expert 0): step 3, phase forward, in " \
           "all_to_all(expert) #9" in lines
    assert f"status {EXIT_STALLED}" in lines and "relaunch without node1" in lines
    document = report_json(verdict, 30, detected_by=0)
    assert document["exclude_hosts"] == ["node1"] and document["stalled"][0]["pid"] == 101
    assert document["stalled"][0]["seconds_without_progress"] == 60


def test_every_rank_waiting_in_the_same_collective_is_a_stall_with_nobody_behind():
    judge = Judge(2, timeout_s=10, now=0)
    for t in range(0, 12):
        for rank in (0, 1):
            judge.observe(rank, record(rank, tick=t, progress=5, collective=a2a(4)), now=t)
    verdict = judge.verdict(now=11)
    assert verdict.stalled == [] and verdict.waiting == [0, 1]
    assert any("no rank is behind" in line for line in report_lines(report_json(verdict, 10, 0)))


def test_nothing_is_judged_before_training_starts_or_after_a_rank_finished():
    judge = Judge(2, timeout_s=5, now=0)
    judge.observe(0, record(0, tick=0, progress=0, phase="start"), now=0)
    assert judge.verdict(now=100) is None  # the model is being built: no rank trains yet
    judge.observe(0, record(0, tick=1, progress=1, stopped=True), now=100)
    assert judge.verdict(now=200) is None  # rank 0's fit ended; rank 1 never reported
    judge = Judge(2, timeout_s=5, now=0)
    judge.observe(0, record(0, tick=1, progress=1), now=1)
    for t in range(2, 7):
        judge.observe(0, record(0, tick=t, progress=1), now=t)
    verdict = judge.verdict(now=6)
    assert verdict.stalled == [(1, "never reported")]


def test_watchers_are_few():
    assert watchers(1) == [0] and watchers(2) == [0, 1] and watchers(1536) == [0, 768, 1535]


@pytest.mark.parametrize("value", [-1, "30", True, float("nan"), float("inf")])
def test_a_bad_timeout_is_one_line_naming_the_field(value):
    with pytest.raises(ValueError, match=r"^strategy\.stall_timeout=.*0 turns the watchdog off"):
        check_stall_timeout(value)


class Exits:
    def __init__(self):
        self.codes, self.done = [], threading.Event()

    def __call__(self, code):
        self.codes.append(code)
        self.done.set()


def test_the_thread_reports_a_frozen_peer_writes_json_and_every_live_rank_exits(tmp_path, capfd):
    """Ranks 0 and 1 run their watchdogs over one store; rank 2 published one record and froze. Rank 0 (a
    watcher) reports once; rank 1 (the middle watcher, which may judge at the same moment) either reports first or
    follows; both exit with EXIT_STALLED."""
    store = dist.HashStore()
    beats = [Heartbeat() for _ in range(3)]
    exits = [Exits() for _ in range(3)]
    dogs = [RankWatchdog(beats[r], r, 3, timeout_s=1.0, identity={"coordinates": {"shard": r}}, store=store,
                          exit=exits[r], report_dir=tmp_path) for r in range(3)]
    for beat in beats:
        beat.enter("forward", step=3)
    frozen = dogs[2]
    frozen.start()
    frozen._stop.set()  # its thread ends: its record never changes again, as under SIGSTOP
    frozen._thread.join()
    dogs[0].start(), dogs[1].start()
    assert exits[0].done.wait(20) and exits[1].done.wait(20)
    assert exits[0].codes == exits[1].codes == [EXIT_STALLED]
    err = capfd.readouterr().err
    assert err.count("stall detected by rank") == 1 and "STALLED rank 2 (host" in err
    document = json.loads((tmp_path / REPORT_FILE).read_text())
    assert [s["rank"] for s in document["stalled"]] == [2] and document["stalled"][0]["coordinates"] == {"shard": 2}


class LostStore:
    """The store of a SIGSTOPped rank 0 as a TCPStore client meets it: every call waits without end (measured:
    ``check`` still blocked after 100 s with a 3 s client timeout)."""

    def __getattr__(self, name):
        def wait_forever(*args, **kwargs):
            threading.Event().wait()
        return wait_forever


def test_a_lost_store_names_the_rank_that_serves_it_from_the_last_records(tmp_path, capfd):
    """Before: the watchdog thread itself blocked in the store call, and the job never ended."""
    beat, exits = Heartbeat(), Exits()
    dog = RankWatchdog(beat, 1, 2, timeout_s=0.5, store=dist.HashStore(), exit=exits, report_dir=tmp_path)
    dog.store.set(dog.key("rank/0"), json.dumps(record(0, tick=1, progress=1)).encode())
    beat.enter("forward", step=3)
    dog.start()
    dog.judge.observe(0, record(0, tick=1, progress=1), now=0)
    dog.store = LostStore()
    assert exits.done.wait(20) and exits.codes == [EXIT_STALLED]
    err = capfd.readouterr().err
    assert "STALLED rank 0 (host node0, pid 100" in err and "serves the rendezvous store" in err


def test_once_all_are_idle_a_rank_that_stopped_answering_is_named_though_at_the_same_point():
    """Rank 1 froze 2 s after its last progress, at the start of its forward; rank 0 waits in a collective the
    heartbeat does not record (an FSDP all-gather): both at one position. Before: "no rank is behind"."""
    judge = Judge(2, timeout_s=30, now=0, tick_s=3)
    for t in range(0, 31):
        judge.observe(0, record(0, tick=t, progress=5, collective=a2a(20, "finished")), now=t)
        judge.observe(1, record(1, tick=min(t, 2), progress=5, collective=a2a(20, "finished")), now=t)
    verdict = judge.verdict(now=30)
    assert [rank for rank, _ in verdict.stalled] == [1] and verdict.waiting == [0]
    assert verdict.stalled[0][1].startswith("its process has not answered for 28 s")


def test_a_rank_still_saving_is_behind_one_that_saved_and_went_on():
    """A save at a step boundary belongs to the next step, before its forward: the rank whose process answers but
    whose save hangs (a filesystem) is the one named, not the rank waiting in the next forward."""
    judge = Judge(2, timeout_s=10, now=0, tick_s=1)
    for t in range(0, 12):
        judge.observe(0, record(0, tick=t, progress=9, step=5, phase="forward"), now=t)
        judge.observe(1, record(1, tick=t, progress=7, step=5, phase="checkpoint"), now=t)
    verdict = judge.verdict(now=11)
    assert [rank for rank, _ in verdict.stalled] == [1] and verdict.waiting == [0]
