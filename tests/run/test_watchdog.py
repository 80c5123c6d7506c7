"""The stall watchdog's parts in one process: the heartbeat, the judge (a fake clock), the report, and the thread
over an in-process store (a frozen peer is a record that stops changing; a lost store is one that raises)."""

import json
import threading

import pytest
import torch
import torch.distributed as dist

from moe_lightning.run import heartbeat
from moe_lightning.run.exits import EXIT_MAX_TIME, EXIT_STALLED
from moe_lightning.run.heartbeat import Heartbeat
from moe_lightning.run.watchdog import REPORT_FILE, Judge, RankWatchdog, check_stall_timeout, report_json, \
    report_lines, watchers


def record(rank, tick, progress, step=3, phase="forward", collective=None, **extra):
    return {"rank": rank, "host": f"node{rank}", "pid": 100 + rank, "tick": tick, "progress": progress,
            "step": step, "phase": phase, "collective": collective, "stopped": False, "trained": True,
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


def test_nothing_is_judged_before_every_rank_completed_a_batch_or_after_a_rank_finished():
    """Before: judging began at on_train_start, so a first step's compile longer than the timeout was a stall."""
    judge = Judge(2, timeout_s=5, now=0)
    judge.observe(0, record(0, tick=0, progress=0, phase="start", trained=False), now=0)
    assert judge.verdict(now=100) is None  # the model is being built: no rank trains yet
    for t in range(0, 100):  # rank 1 compiles its first step for 100 s, ticking; rank 0 waits in a collective
        judge.observe(0, record(0, tick=t, progress=3, phase="forward", trained=False), now=t)
        judge.observe(1, record(1, tick=t, progress=2, phase="forward", trained=False), now=t)
    assert judge.verdict(now=99) is None
    judge.observe(0, record(0, tick=100, progress=9), now=100)
    judge.observe(1, record(1, tick=100, progress=9, stopped=True), now=100)
    assert judge.verdict(now=200) is None  # rank 1's fit ended: the other one tears down too


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
        beat.batch_done()
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
    beat.batch_done()
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


def test_a_watcher_that_was_suspended_restarts_its_clocks_rather_than_naming_everyone():
    """The watcher's own loop stopped for 70 s (the host suspended); the first records it reads after are the old
    ones. Before: every rank was silent for 70 s, so all were named."""
    judge = Judge(2, timeout_s=30, now=0, tick_s=3)
    for t in range(0, 10, 3):
        judge.look(t)
        for rank in (0, 1):
            judge.observe(rank, record(rank, tick=t, progress=t), now=t)
    judge.look(80)
    for rank in (0, 1):
        judge.observe(rank, record(rank, tick=9, progress=9), now=80)
    assert judge.verdict(now=80) is None
    judge.look(83)
    judge.observe(0, record(0, tick=83, progress=83), now=83)  # rank 1 really is frozen: named a timeout later
    judge.observe(1, record(1, tick=9, progress=9), now=83)
    assert judge.verdict(now=109) is None
    for t in range(86, 111, 3):
        judge.look(t)
        judge.observe(0, record(0, tick=t, progress=t), now=t)
    assert [rank for rank, _ in judge.verdict(now=110).stalled] == [1]


def test_a_rank_whose_fit_raised_is_named_once_the_others_wait_and_does_not_stop_judging():
    """Before: a raising rank published stopped=True, which stopped every judgement (the others then hung)."""
    judge = Judge(3, timeout_s=10, now=0, tick_s=1)
    judge.observe(2, record(2, tick=1, progress=4, stopped=True, failed=True), now=0)
    for t in range(0, 12):
        judge.observe(0, record(0, tick=t, progress=min(t, 5)), now=t)
        judge.observe(1, record(1, tick=t, progress=7 if t < 5 else 8), now=t)
        assert judge.verdict(now=t) is None  # rank 1 progressed at t=5: not yet idle for 10 s
    for t in range(12, 16):
        judge.observe(0, record(0, tick=t, progress=5), now=t)
        judge.observe(1, record(1, tick=t, progress=8), now=t)
    verdict = judge.verdict(now=15)
    assert verdict.stalled == [(2, "its fit raised an exception (see its log)")] and verdict.waiting == [0, 1]
    judge.observe(0, record(0, tick=16, progress=5, stopped=True, failed=True), now=16)
    judge.observe(1, record(1, tick=16, progress=8, stopped=True, failed=True), now=16)
    assert judge.verdict(now=30) is None  # every rank raised: nobody is left to wait


class BuggyStore(dist.HashStore):
    """A store whose reads hit a bug of the watchdog's own (not the store's failure)."""

    def get(self, key):
        raise KeyError(key)

    def multi_get(self, keys):
        raise KeyError(keys[0])


def test_a_bug_in_the_watchdog_is_logged_once_and_never_ends_a_healthy_job(capfd):
    """Before: every exception counted as a lost store: after the timeout, rank 0 was named and the job ended."""
    beat, exits = Heartbeat(), Exits()
    dog = RankWatchdog(beat, 0, 2, timeout_s=0.3, store=BuggyStore(), exit=exits)
    beat.batch_done()
    dog.start()
    assert not exits.done.wait(3)  # ten timeouts
    dog.stop()
    assert exits.codes == []
    assert capfd.readouterr().err.count("stall watchdog: unexpected KeyError") == 1


class ClosedStore:
    """The store after its host (rank 0, the reporter) exited: every call fails at once, as a TCPStore client's
    does on a closed socket (measured here: ``DistNetworkError('Broken pipe')``)."""

    host, port = "node0", 29500

    def __getattr__(self, name):
        def closed(*args, **kwargs):
            raise dist.DistNetworkError("Broken pipe")
        return closed


def test_a_follower_that_finds_the_store_closed_exits_at_once_and_keeps_the_true_report(tmp_path, capfd):
    """Rank 0 reported rank 2 and exited with the store before rank 1 read the verdict. Before: rank 1 waited a
    whole timeout, then named the healthy rank 0 and overwrote rank 0's report."""
    (tmp_path / REPORT_FILE).write_text(json.dumps({"stalled": [{"rank": 2}]}))
    beat, exits = Heartbeat(), Exits()
    dog = RankWatchdog(beat, 1, 3, timeout_s=2.0, store=dist.HashStore(), exit=exits, report_dir=tmp_path)
    dog.started_at -= 10  # the report above was written during this fit
    beat.batch_done()
    dog.start()
    dog.store = ClosedStore()
    assert exits.done.wait(10) and exits.codes == [EXIT_STALLED]
    err = capfd.readouterr().err
    assert "closed (Broken pipe) while this rank waited: its host exited (it reported a stall" in err
    assert "STALLED rank 0" not in err
    assert json.loads((tmp_path / REPORT_FILE).read_text())["stalled"] == [{"rank": 2}]


def test_a_second_report_in_one_fit_keeps_the_first(tmp_path, capfd):
    judge = Judge(2, timeout_s=5, now=0)
    for t in range(0, 7):
        judge.observe(0, record(0, tick=t, progress=1), now=t)
        judge.observe(1, record(1, tick=0, progress=1), now=t)
    dog = RankWatchdog(Heartbeat(), 0, 2, timeout_s=5, store=dist.HashStore(), exit=Exits(), report_dir=tmp_path)
    (tmp_path / REPORT_FILE).write_text("{}")  # another rank's, written during this fit
    dog._say_and_exit(judge.verdict(now=6), tmp_path)
    assert (tmp_path / REPORT_FILE).read_text() == "{}"
    assert f"kept the report already written in this fit: {tmp_path / REPORT_FILE}" in capfd.readouterr().err


def test_a_rank_whose_fit_ends_after_a_stored_verdict_exits_stalled():
    """Under srun the live ranks' fits often raise (a collective broken by a rank that exited) before their
    watchdog reads the verdict; the callback's stop path then reads it. Before: such a rank exited 1."""
    store, exits = dist.HashStore(), Exits()
    dog = RankWatchdog(Heartbeat(), 1, 2, timeout_s=30, store=store, exit=exits).start()
    store.set(dog.key("verdict"), json.dumps({"by": 0, "stalled": [3]}).encode())
    dog.stop(failed=True)
    assert exits.codes == [EXIT_STALLED]
    assert json.loads(store.get(dog.key("rank/1")))["failed"] is True
    quiet = RankWatchdog(Heartbeat(), 0, 2, timeout_s=30, store=dist.HashStore(), exit=exits).start()
    quiet.stop()
    assert exits.codes == [EXIT_STALLED]  # no verdict: a normal end exits nothing


class CountingStore(dist.HashStore):
    def __init__(self):
        super().__init__()
        self.calls = {"get": 0, "multi_get": 0}

    def get(self, key):
        self.calls["get"] += 1
        return super().get(key)

    def multi_get(self, keys):
        self.calls["multi_get"] += 1
        return super().multi_get(keys)


def test_a_watcher_reads_every_record_with_one_multi_get_once_all_have_published():
    store = CountingStore()
    dog = RankWatchdog(Heartbeat(), 0, 4, timeout_s=30, store=store, exit=Exits())
    dog.judge = Judge(4, 30, now=0)
    for rank in range(4):
        store.set(dog.key(f"rank/{rank}"), json.dumps(record(rank, tick=1, progress=1)).encode())
    dog._read_and_judge(now=0)  # the first read: each key checked and read alone (a missing key would block)
    store.calls.update(get=0, multi_get=0)
    dog._read_and_judge(now=1)
    assert store.calls == {"get": 0, "multi_get": 1}
    assert dog.judge.seen[3].record["rank"] == 3


def test_a_collective_whose_wait_returned_is_finished_only_once_the_device_completed_it():
    """On NCCL, wait() returns at once (it orders the stream): before, the record said "finished" while the device
    still waited in the collective. A fake device completion stands in for the CUDA event."""
    beat, device = Heartbeat(), {"done": False}
    beat.entered("all_to_all", None)
    beat.finished(lambda: device["done"])
    assert beat.snapshot()["collective"]["state"] == "entered"
    device["done"] = True
    assert beat.snapshot()["collective"]["state"] == "finished"
    beat.entered("all_to_all", None)  # the next collective forgets the last one's completion
    assert beat.device_done is None and beat.snapshot()["collective"]["seq"] == 2
    heartbeat.activate(beat)
    try:
        heartbeat.finished(torch.zeros(2))  # a CPU output (gloo): its wait did complete it
    finally:
        heartbeat.activate(None)
    assert beat.device_done is None and beat.snapshot()["collective"]["state"] == "finished"


def test_the_reporter_waits_for_the_others_to_read_its_verdict_but_not_for_ever():
    """The reporter (rank 0) hosts the store: before, it exited at once and the others could not read the verdict."""
    store = dist.HashStore()
    reporter = RankWatchdog(Heartbeat(), 0, 2, timeout_s=30, store=store, exit=Exits())  # waits up to 12 s
    follower = RankWatchdog(Heartbeat(), 1, 2, timeout_s=30, store=store, exit=Exits())
    waiting = threading.Thread(target=reporter._wait_for_acks, args=(1,))
    waiting.start()
    waiting.join(0.5)
    assert waiting.is_alive()
    follower._follow({"by": 0, "stalled": [2]})
    waiting.join(5)
    assert not waiting.is_alive() and follower.exit.codes == [EXIT_STALLED]
    alone = RankWatchdog(Heartbeat(), 0, 2, timeout_s=0.3, store=dist.HashStore(), exit=Exits())  # up to 1.2 s
    waiting = threading.Thread(target=alone._wait_for_acks, args=(1,))
    waiting.start()
    waiting.join(10)
    assert not waiting.is_alive()  # nobody read it (the others may be stopped): it exits anyway
