"""A checkpoint write that goes on for longer than ``stall_timeout`` is progress, not a stall: every write into a
checkpoint file bumps the heartbeat (``durable.ProgressingFile``); a write that stops is still named. Two ranks'
watchdogs over one in-process store, rank 1 saving a sharded checkpoint (DCP's writer, as ``ShardedCheckpointer``
uses it) whose file writes are made slow, rank 0 waiting without progress (as in a collective). The real
SIGSTOP inside a save, on 2 processes, is ``tests/run/test_stalls.py``'s slow case."""

import json
import threading
import time
import types

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystem

from moe_lightning.checkpoint.commit import save_file
from moe_lightning.checkpoint.sharded import _HostCopyWriter
from moe_lightning.run import heartbeat
from moe_lightning.run.exits import EXIT_STALLED
from moe_lightning.run.heartbeat import Heartbeat
from moe_lightning.run.watchdog import REPORT_FILE, RankWatchdog
from tests.run.test_watchdog import Exits

TIMEOUT_S = 1.0
STATE = {f"layer{i}": torch.randn(64, 64) for i in range(4)}  # about 25 writes per tensor (torch.save's records)


class SlowFile:
    """A file whose writes take ``seconds`` each, or, once ``hang_after`` writes are done, never return."""

    def __init__(self, file, seconds: float, hang_after: int | None, released: threading.Event):
        self._file, self.seconds, self.hang_after, self.released, self.writes = file, seconds, hang_after, released, 0

    def write(self, data):
        self.writes += 1
        if self.hang_after is not None and self.writes > self.hang_after:
            self.released.wait()  # a file system that stopped answering
        time.sleep(self.seconds)
        return self._file.write(data)

    def __getattr__(self, name):
        return getattr(self._file, name)


def slow_files(monkeypatch, seconds: float, hang_after: int | None = None) -> threading.Event:
    """Every file DCP opens for writing becomes a ``SlowFile`` (under the package's progress wrapper)."""
    released, create_stream = threading.Event(), FileSystem.create_stream

    def slow_stream(self, path, mode):
        manager = create_stream(self, path, mode)

        class Slow:
            def __enter__(self):
                return SlowFile(manager.__enter__(), seconds, hang_after, released)

            def __exit__(self, *exc):
                return manager.__exit__(*exc)
        return Slow()

    monkeypatch.setattr(FileSystem, "create_stream", slow_stream)
    return released


def two_ranks(tmp_path) -> tuple[list[Heartbeat], list[Exits], list[RankWatchdog]]:
    store = dist.HashStore()
    beats, exits = [Heartbeat(), Heartbeat()], [Exits(), Exits()]
    dogs = [RankWatchdog(beats[r], r, 2, timeout_s=TIMEOUT_S, store=store, exit=exits[r], report_dir=tmp_path)
            for r in range(2)]
    for beat in beats:
        beat.batch_done()
    beats[0].enter("forward", step=5)  # rank 0 went on and waits (no progress) for rank 1
    beats[1].enter("checkpoint", step=5)
    return beats, exits, dogs


def test_a_save_longer_than_the_timeout_that_keeps_writing_is_not_a_stall(tmp_path, monkeypatch):
    """Before: the save's seconds without a phase change were several timeouts, and rank 1 was named in phase
    checkpoint."""
    slow_files(monkeypatch, seconds=0.03)
    beats, exits, dogs = two_ranks(tmp_path)
    heartbeat.activate(beats[1])
    for dog in dogs:
        dog.start()
    try:
        started = time.monotonic()
        dcp.save(STATE, storage_writer=_HostCopyWriter(tmp_path / "sharded"))
        took = time.monotonic() - started
        time.sleep(0.3)  # a poll after the save: its last writes are published
    finally:
        heartbeat.activate(None)
        for dog in dogs:
            dog.stop()
    assert took > 2 * TIMEOUT_S, took
    assert exits[0].codes == exits[1].codes == [] and not (tmp_path / REPORT_FILE).exists()
    assert beats[1].progress > 20  # a bump per write


def test_a_save_whose_writes_stop_is_still_named_in_phase_checkpoint(tmp_path, monkeypatch, capfd):
    released = slow_files(monkeypatch, seconds=0.01, hang_after=5)
    beats, exits, dogs = two_ranks(tmp_path)
    heartbeat.activate(beats[1])
    for dog in dogs:
        dog.start()
    saving = threading.Thread(target=dcp.save, args=(STATE,),
                              kwargs={"storage_writer": _HostCopyWriter(tmp_path / "sharded")}, daemon=True)
    saving.start()
    try:
        assert exits[0].done.wait(30), capfd.readouterr().err[-2000:]
    finally:
        released.set()
        saving.join(30)
        heartbeat.activate(None)
    assert exits[0].codes == [EXIT_STALLED]
    document = json.loads((tmp_path / REPORT_FILE).read_text())
    assert [(s["rank"], s["phase"]) for s in document["stalled"]] == [(1, "checkpoint")]


def test_a_single_file_checkpoint_reports_its_writes_too(tmp_path):
    beat = Heartbeat()
    heartbeat.activate(beat)
    try:
        save_file(STATE, tmp_path / "one.ckpt")
    finally:
        heartbeat.activate(None)
    assert beat.progress > 20
    assert torch.equal(torch.load(tmp_path / "one.ckpt")["layer3"], STATE["layer3"])


class _DeactivatedAfterFirstRead(dict):
    """``heartbeat``'s module globals as a writer thread sees them when the training thread runs
    ``activate(None)`` (``StallWatchdog.on_exception``) right after the writer's first read of ``_active``."""

    def __init__(self, module_globals: dict, beat: Heartbeat):
        super().__init__(module_globals)
        self.reads = iter([beat])

    def __getitem__(self, name):
        return next(self.reads, None) if name == "_active" else super().__getitem__(name)


def test_a_write_racing_the_heartbeats_deactivation_does_not_raise():
    beat = Heartbeat()
    progressed = types.FunctionType(heartbeat.progressed.__code__,
                                    _DeactivatedAfterFirstRead(vars(heartbeat), beat))
    progressed()  # reading `_active` twice (check, then increment) raised AttributeError on None
    assert beat.progress == 1
