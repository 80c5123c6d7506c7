"""The stall watchdog: a thread on every rank that names a rank which stopped making progress and ends the job.

Each rank's watchdog publishes its ``run.heartbeat.Heartbeat`` (step, phase, last collective, a ``progress`` count
the training thread bumps) with a ``tick`` of its own, within ``publish_s`` of a change and every ``poll_s``, under
``moe_lightning/stall/`` in the rendezvous store, through a client of its own with a short timeout (never the
training process group). A few ranks (``watchers``: the first, the middle and the last) read every rank's record
and judge (``Judge``):

- a rank whose ``tick`` has not changed for ``timeout_s`` does not answer at all (SIGSTOP, a process hung in the
  kernel or the driver): it is stalled;
- otherwise, once every rank's training thread has made no progress for ``timeout_s``, the ranks that stopped
  answering (no tick for 3 polls: stopped a moment after their last progress), else those behind the others (step,
  collectives entered, phase) are stalled and the others wait for them; with none, every rank waits in the same
  place (a collective that never completes, e.g. the network).

A rank that is only slow, stopped for less than ``timeout_s``, is never named. The first watcher to judge a stall
stores the verdict (``compare_set``: one report), prints the report, writes it as ``stall-report.json`` in the run's
log folder and exits; every other rank sees the verdict within ``poll_s`` and exits too, with ``EXIT_STALLED``. The
training thread may be blocked inside a collective the stalled rank never joins, in C++ where no exception reaches
it, so the watchdog ends the process with ``os._exit`` after flushing its output. A checkpoint being written then is
never committed: a sharded save is renamed into place only once complete and ``--ckpt_path last`` skips (and
clean-up removes) an unfinished ``.partial``; a single file is written beside and renamed.

When the process hosting the store stops (rank 0's, unless torchrun's agent hosts it), nothing can be read: a rank
whose store operations have failed for ``timeout_s`` names that rank from the last records it read. When it exits
(its socket closes), it most likely reported: it waited (bounded) for the others to read its verdict, and a rank
that finds the store closed after waiting half ``timeout_s`` itself exits at once. Only store failures count so:
any other exception is a bug here, printed once, and the job goes on.
"""

import datetime
import json
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from moe_lightning.run import flight_recorder
from moe_lightning.run.exits import EXIT_STALLED, say
from moe_lightning.run.heartbeat import PHASES, Heartbeat

DEFAULT_STALL_TIMEOUT_S = 600.0
"""Ten minutes: above a step, a first-step compile and a sharded save's write at the 1T shape (tens of seconds to
minutes), below the 30 minutes after which the process group's own timeout would end the job without a word."""

REPORT_FILE = "stall-report.json"
PREFIX = "moe_lightning/stall"


def check_stall_timeout(value, owner: str = "strategy.stall_timeout") -> float:
    """``value`` as seconds, or a one-line error naming ``owner`` (before any process starts)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0 or value == float("inf"):
        raise ValueError(f"{owner}={value!r}: seconds without progress before a rank counts as stalled, a number "
                         f">= 0 (0 turns the watchdog off; default {DEFAULT_STALL_TIMEOUT_S:g}).")
    return float(value)


def poll_interval(timeout_s: float) -> float:
    """How often a watchdog publishes and reads: a tenth of the timeout, within [0.1, 5] s."""
    return min(5.0, max(0.1, timeout_s / 10))


def watchers(world_size: int) -> list[int]:
    """The ranks that read every record: a few, so that the store serves O(world) reads per poll, not O(world^2)."""
    return sorted({0, world_size // 2, world_size - 1})


def store_host_rank() -> int | None:
    """The rank whose process serves the rendezvous store: rank 0, unless torchrun's agent serves it."""
    return None if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true" else 0


def store_closed(error: BaseException) -> bool:
    """The store's host process has exited (its socket closed: broken pipe, reset, refused), as opposed to one
    that is stopped (a call that never returns: ``TimeoutError``) or a bug here (any other exception)."""
    import torch.distributed as dist

    if isinstance(error, TimeoutError):
        return False
    return isinstance(error, (ConnectionError, dist.DistNetworkError)) and "timed out" not in str(error)


def store_failed(error: BaseException) -> bool:
    """A store call failed for the store's sake (no answer, a closed or broken connection), not for a bug here."""
    import torch.distributed as dist

    return isinstance(error, (TimeoutError, ConnectionError, dist.DistError))


def side_store(timeout_s: float):
    """A client of the default process group's rendezvous store of its own, whose operations give up after
    ``timeout_s`` (the training thread's client waits as long as the process group's timeout)."""
    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    if isinstance(store, dist.TCPStore):
        return dist.TCPStore(store.host, store.port, is_master=False, wait_for_workers=False,
                             timeout=datetime.timedelta(seconds=timeout_s))
    return store  # a FileStore or HashStore: no peer process serves it


# ---- judging ---------------------------------------------------------------------------------------------------

@dataclass
class Seen:
    """What a watcher knows of one rank: its last record and when (this watcher's clock) it last changed."""

    record: dict | None
    alive_at: float  # the rank's tick last changed
    progress_at: float  # its training thread last made progress


@dataclass
class Verdict:
    stalled: list[tuple[int, str]]  # (rank, why)
    waiting: list[int]
    seen: dict[int, Seen] = field(repr=False)
    at: float = 0.0


def position(record: dict | None) -> tuple[int, int, int]:
    """How far a rank has come: (step, collectives entered, phase); ranks running the same program compare."""
    if record is None:
        return (-1, -1, -1)
    collective = record.get("collective") or {}
    return (record["step"], collective.get("seq", 0), PHASES.index(record["phase"]))


class Judge:
    """Names the stalled ranks from the records a watcher reads (see the module docstring); no I/O, no clock."""

    def __init__(self, world_size: int, timeout_s: float, now: float, tick_s: float | None = None):
        self.timeout_s = timeout_s
        self.tick_s = tick_s if tick_s is not None else poll_interval(timeout_s)  # a live rank ticks this often
        self.seen = {rank: Seen(None, now, now) for rank in range(world_size)}
        self.looked_at = now

    def look(self, now: float) -> None:
        """Called once per poll, before ``observe``: a gap of several polls in this watcher's own loop (the host
        was suspended, or this process was stopped) says nothing of the others, so their clocks restart now."""
        if now - self.looked_at > 3 * self.tick_s:
            for seen in self.seen.values():
                seen.alive_at = seen.progress_at = now
        self.looked_at = now

    def observe(self, rank: int, record: dict, now: float) -> None:
        seen, previous = self.seen[rank], self.seen[rank].record
        if previous is None or record["tick"] != previous["tick"]:
            seen.alive_at = now
        if previous is None or record["progress"] != previous["progress"]:
            seen.progress_at = now
        seen.record = record

    def verdict(self, now: float) -> Verdict | None:
        records = [s.record for s in self.seen.values()]
        if any(r is not None and r.get("stopped") and not r.get("failed") for r in records):
            return None  # a rank has finished its fit: the others are tearing down too
        if not all(r is not None and r.get("trained") for r in records):
            return None  # a rank has not completed its first batch (a compile, the data loader's start-up)
        failed = [rank for rank, s in self.seen.items() if s.record.get("failed")]
        live = {rank: s for rank, s in self.seen.items() if rank not in failed}
        if not live:
            return None
        silent = [rank for rank, s in live.items() if now - s.alive_at >= self.timeout_s]
        if silent:
            stalled = [(rank, self.why(rank, now)) for rank in silent]
            return Verdict(stalled, [r for r in live if r not in silent], self.seen, now)
        if any(now - s.progress_at < self.timeout_s for s in live.values()):
            return None
        if failed:  # the others wait for a rank whose fit raised
            return Verdict([(rank, "its fit raised an exception (see its log)") for rank in failed], list(live),
                           self.seen, now)
        frozen = [rank for rank, s in live.items() if now - s.alive_at > 3 * self.tick_s]
        ahead = max(position(s.record) for s in live.values())
        behind = frozen or [rank for rank, s in live.items() if position(s.record) < ahead]
        return Verdict([(rank, self.why(rank, now)) for rank in behind], [r for r in live if r not in behind],
                       self.seen, now)

    def why(self, rank: int, now: float) -> str:
        seen = self.seen[rank]
        if seen.record is None:
            return "never reported"
        if now - seen.alive_at > 3 * self.tick_s:
            return (f"its process has not answered for {now - seen.alive_at:.0f} s (stopped, or hung in the kernel "
                    f"or driver)")
        return "its process answers but its training thread made no progress"


# ---- the report ------------------------------------------------------------------------------------------------

def where(entry: dict) -> str:
    coordinates = ", ".join(f"{k} {v}" for k, v in (entry.get("coordinates") or {}).items())
    if "host" not in entry:
        return "no record"
    return f"host {entry['host']}, pid {entry['pid']}" + (f"; {coordinates}" if coordinates else "")


def doing(entry: dict) -> str:
    if "step" not in entry:
        return "never reported"
    text = f"step {entry['step']}, phase {entry['phase']}"
    collective = entry.get("collective")
    if collective:
        name = f"{collective['op']}({collective['dim']}) #{collective['seq']}"
        text += f", in {name}" if collective["state"] == "entered" else f", last finished {name}"
    return text


def report_json(verdict: Verdict, timeout_s: float, detected_by: int) -> dict:
    """The report as ``stall-report.json`` holds it (what ``report_lines`` and ``moe-lightning stalls`` print)."""
    seen, now = verdict.seen, verdict.at

    def entry(rank: int, why: str | None = None) -> dict:
        s = seen[rank]
        out = {"rank": rank, **(s.record or {}), "seconds_without_progress": round(now - s.progress_at, 1),
               "seconds_silent": round(now - s.alive_at, 1)}
        out.pop("tick", None)
        return {**out, "why": why} if why else out

    stalled = [entry(r, why) for r, why in verdict.stalled]
    return {"exit_status": EXIT_STALLED, "stall_timeout": timeout_s, "detected_by": detected_by,
            "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "stalled": stalled,
            "waiting": [entry(r) for r in verdict.waiting],
            "exclude_hosts": sorted({e["host"] for e in stalled if "host" in e})}


def report_lines(report: dict) -> list[str]:
    """The printed report: each stalled rank (where, doing what, why, the collectives it never entered), then
    what the others wait in, then the exit status and the hosts to leave out."""
    lines = [f"stall detected by rank {report['detected_by']}: no progress for {report['stall_timeout']:g} s "
             f"(stall_timeout)"]
    waited = [w["collective"] for w in report["waiting"] if w.get("collective")]
    for entry in report["stalled"]:
        lines.append(f"  STALLED rank {entry['rank']} ({where(entry)}): {doing(entry)}; {entry['why']}; last "
                     f"progress {entry['seconds_without_progress']:.0f} s ago")
        mine = (entry.get("collective") or {}).get("seq", 0)
        missed = sorted({(c["op"], c["dim"], c["seq"]) for c in waited if c["state"] == "entered" and c["seq"] > mine})
        if missed:
            lines.append("    never entered " + ", ".join(f"{op}({dim}) #{seq}" for op, dim, seq in missed) +
                         " that the others wait in")
    if not report["stalled"]:
        lines.append("  no rank is behind: every rank waits at the same point (a collective that never completes: "
                     "network, driver)")
    for entry in report["waiting"]:
        lines.append(f"  waiting rank {entry['rank']} ({where(entry)}): {doing(entry)}")
    hosts = report["exclude_hosts"]
    lines.append(f"every live rank exits with status {report['exit_status']}; --ckpt_path last resumes from the "
                 f"newest complete checkpoint" + (f"; relaunch without {', '.join(hosts)}" if hosts else ""))
    return lines


# ---- the thread ------------------------------------------------------------------------------------------------

def own_children() -> list[int]:
    """The pids of this process's children (Linux; none elsewhere)."""
    try:
        return [int(pid) for task in Path("/proc/self/task").iterdir()
                for pid in (task / "children").read_text().split()]
    except OSError:
        return []


def _hard_exit(code: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class RankWatchdog:
    """The watchdog of one rank (see the module docstring). ``start`` once the default process group exists.

    Args:
        heartbeat: What this rank's training thread updates.
        rank, world_size: This rank and the job's size.
        timeout_s: Seconds without progress before a rank counts as stalled.
        identity: What the report says of this rank besides host and pid (``coordinates``: its mesh coordinates).
        report_dir: Where this rank would write ``stall-report.json`` (rank 0's ``publish_report_dir`` wins).
        spawned_child: A rank that Lightning's own launcher started from the main process: it exits 0 (the main
            process's status is the job's, and its launcher kills the job on a child's non-zero exit), unless the
            main process is the stalled one, which it then kills (nothing else would end the job).
        store: A store client (tests); default: ``side_store``.
        exit: Ends the process (tests replace it).
        generation: Which fit of this process it watches (each fit's keys apart from an earlier one's).
    """

    def __init__(self, heartbeat: Heartbeat, rank: int, world_size: int, timeout_s: float,
                 identity: dict | None = None, report_dir: Path | None = None, spawned_child: bool = False,
                 store=None, exit: Callable[[int], None] = _hard_exit, generation: int = 0):
        self.heartbeat, self.rank, self.world_size, self.timeout_s = heartbeat, rank, world_size, timeout_s
        self.poll_s = poll_interval(timeout_s)
        self.publish_s = min(1.0, self.poll_s / 4)  # a stalled rank's last record is at most this old
        self.io_timeout_s = max(1.0, 2 * self.poll_s)  # a store call taking longer counts as no answer
        self._stuck: threading.Thread | None = None  # a store call that never returned
        self.identity = {"host": socket.gethostname(), "pid": os.getpid(), **(identity or {})}
        self.report_dir, self.spawned_child, self.exit = report_dir, spawned_child, exit
        self.store, self.prefix = store, f"{PREFIX}/{generation}"
        self.tick = 0
        self.started_at = time.time()  # a report written since then is this fit's and is never overwritten
        self._bug_logged = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.judge: Judge | None = None

    def key(self, name: str) -> str:
        return f"{self.prefix}/{name}"

    def record(self, stopped: bool = False, failed: bool = False) -> bytes:
        return json.dumps({"rank": self.rank, **self.identity, **self.heartbeat.snapshot(), "tick": self.tick,
                           "stopped": stopped, "failed": failed}).encode()

    def start(self) -> "RankWatchdog":
        if self.store is None:
            self.store = side_store(60.0)  # generous for connecting; each call is bounded by ``_io`` instead
        self.store.set(self.key(f"rank/{self.rank}"), self.record())
        if self.rank in watchers(self.world_size):
            self.judge = Judge(self.world_size, self.timeout_s, time.monotonic(), tick_s=self.poll_s)
        self._thread = threading.Thread(target=self._run, name="stall-watchdog", daemon=True)
        self._thread.start()
        return self

    def stop(self, failed: bool = False) -> None:
        """This rank's fit has ended: the others stop judging (a rank that has finished is not stalled), or, when
        it ``failed`` (raised), judge the others on. A rank that fails because a verdict ended another (a collective
        broken by a rank that exited) exits with ``EXIT_STALLED`` here: under srun its status is the job's."""
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread = None
        try:
            self._io(lambda: self.store.set(self.key(f"rank/{self.rank}"), self.record(stopped=True, failed=failed)))
            summary = self._io(self._stored_verdict)
        except Exception:  # the store's host has gone: nobody is left to judge
            return
        if summary is not None:
            self._follow(summary)

    def _stored_verdict(self) -> dict | None:
        if self.store.check([self.key("verdict")]):
            return json.loads(self.store.get(self.key("verdict")))
        return None

    def publish_report_dir(self, folder: Path) -> None:
        self._io(lambda: self.store.set(self.key("report_dir"), str(folder)))

    def _io(self, call: Callable[[], object]):
        """``call()`` (store operations) within ``io_timeout_s``, else ``TimeoutError``: a TCPStore client waits
        without end for a server whose process is stopped (measured: ``check`` still blocked after 100 s with a
        3 s client timeout), so every call runs in a thread of its own that this one stops waiting for."""
        if self._stuck is not None and self._stuck.is_alive():
            raise TimeoutError("an earlier store call has not returned")
        result: dict = {}

        def run() -> None:
            try:
                result["value"] = call()
            except Exception as error:
                result["error"] = error

        thread = threading.Thread(target=run, name="stall-watchdog-store", daemon=True)
        thread.start()
        thread.join(self.io_timeout_s)
        if thread.is_alive():
            self._stuck = thread
            raise TimeoutError(f"the store did not answer within {self.io_timeout_s:g} s")
        if "error" in result:
            raise result["error"]
        return result.get("value")

    def _run(self) -> None:
        """Publish as soon as the training thread has progressed (at most every ``publish_s``) and every
        ``poll_s`` regardless (the tick); every ``poll_s`` look for a verdict and, on a watcher, judge."""
        unreachable_since, published, next_poll = None, None, time.monotonic() + self.poll_s
        progress_seen, progressed_at = None, time.monotonic()
        while not self._stop.wait(self.publish_s):
            now, progress = time.monotonic(), self.heartbeat.progress
            if progress != progress_seen:
                progress_seen, progressed_at = progress, now
            polling = now >= next_poll
            if progress == published and not polling:
                continue
            if polling:
                next_poll = now + self.poll_s
            try:
                self.tick += 1
                summary, verdict = self._io(lambda: self._exchange(polling, now))
                published, unreachable_since = progress, None
                if summary is not None:
                    return self._follow(summary)
            except Exception as error:
                if not store_failed(error):  # a bug here, not the store's failure: printed once, the job goes on
                    self._log_bug(error)
                    continue
                if store_closed(error) and self.heartbeat.trained and now - progressed_at >= self.timeout_s / 2:
                    return self._reporter_exited(error)
                unreachable_since = unreachable_since or now  # the store does not answer (its host stopped)
                if now - unreachable_since >= self.timeout_s:
                    return self._store_lost(error, now)
                continue
            if verdict is not None:
                return self._report(verdict)

    def _log_bug(self, error: Exception) -> None:
        if not self._bug_logged:
            say(f"[rank {self.rank}] stall watchdog: unexpected {type(error).__name__}: {error} (a bug, not a stall: "
                f"training goes on; this rank keeps publishing)")
            self._bug_logged = True

    def _reporter_exited(self, error: Exception) -> None:
        """The store closed while this rank has waited long enough for a verdict to be possible: the rank that
        hosts it reported a stall and exited before this one read the verdict (a healthy store host that exits
        has finished its fit, which a rank still idle inside its fit cannot have seen)."""
        say(f"[rank {self.rank}] stall: the rendezvous store ({self._store_address()}) closed ({error}) while this "
            f"rank waited: its host exited (it reported a stall, or its fit failed); exiting with status "
            f"{EXIT_STALLED}")
        self._end([])

    def _exchange(self, polling: bool, now: float) -> tuple[dict | None, Verdict | None]:
        """Publish this rank's record; when polling, the verdict stored by another rank, or this watcher's own."""
        self.store.set(self.key(f"rank/{self.rank}"), self.record())
        if not polling:
            return None, None
        summary = self._stored_verdict()
        if summary is not None:
            return summary, None
        return None, self._read_and_judge(now)

    def _read_and_judge(self, now: float) -> Verdict | None:
        if self.judge is None:
            return None
        self.judge.look(now)
        keys = [self.key(f"rank/{rank}") for rank in range(self.world_size)]
        multi_get = getattr(self.store, "multi_get", None)
        if multi_get is not None and all(s.record is not None for s in self.judge.seen.values()):
            values = dict(enumerate(multi_get(keys)))  # one round trip; every key exists (a get waits for one)
        else:
            values = {rank: self.store.get(key) for rank, key in enumerate(keys)
                      if self.judge.seen[rank].record is not None or self.store.check([key])}
        for rank, value in values.items():
            self.judge.observe(rank, json.loads(bytes(value)), now)
        return self.judge.verdict(now)

    def _report(self, verdict: Verdict) -> None:
        summary = json.dumps({"by": self.rank, "stalled": [r for r, _ in verdict.stalled]}).encode()
        try:
            current = self._io(lambda: self.store.compare_set(self.key("verdict"), b"", summary))
        except Exception:  # the store failed just now: report from what was read
            current = summary
        if bytes(current) != summary:  # another watcher's report came first
            return self._follow(json.loads(current))
        self._say_and_exit(verdict, self._report_dir(), acks=len([r for r in verdict.waiting if r != self.rank]))

    def _report_dir(self) -> Path | None:
        try:
            if self._io(lambda: self.store.check([self.key("report_dir")])):
                return Path(self._io(lambda: self.store.get(self.key("report_dir"))).decode())
        except Exception:
            pass
        return self.report_dir

    def _store_lost(self, error: Exception, now: float) -> None:
        host = store_host_rank()
        if self.judge is None or host is None:
            say(f"[rank {self.rank}] stall: the rendezvous store ({self._store_address()}) has not answered for "
                f"{self.timeout_s:g} s ({type(error).__name__}); exiting with status {EXIT_STALLED}")
            return self._end([])
        seen = self.judge.seen
        why = f"its process, which serves the rendezvous store ({self._store_address()}), does not answer"
        verdict = Verdict([(host, why)], [r for r in seen if r != host], seen, now)
        self._say_and_exit(verdict, self.report_dir)

    def _store_address(self) -> str:
        return f"{getattr(self.store, 'host', '?')}:{getattr(self.store, 'port', '?')}"

    def _wait_for_acks(self, expected: int) -> None:
        """Until ``expected`` other ranks have read the verdict, or ``2 * poll_s`` and a store call: the store's
        host must outlive their reads, else they wait a whole timeout and name it (bounded: some may be stopped)."""
        deadline = time.monotonic() + 2 * self.poll_s + self.io_timeout_s
        while expected > 0 and time.monotonic() < deadline:
            try:
                if self._io(lambda: self.store.add(self.key("acks"), 0)) >= expected:
                    return
            except Exception:
                return
            time.sleep(min(0.1, self.poll_s / 4))

    def _say_and_exit(self, verdict: Verdict, folder: Path | None, acks: int = 0) -> None:
        report = report_json(verdict, self.timeout_s, self.rank)
        lines = report_lines(report)
        path = Path(folder) / REPORT_FILE if folder is not None else None
        if path is not None and path.exists() and path.stat().st_mtime >= self.started_at:
            lines.append(f"kept the report already written in this fit: {path}")  # the first verdict is the true one
        elif path is not None:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.with_suffix(".tmp").write_text(json.dumps(report, indent=1))
                os.replace(path.with_suffix(".tmp"), path)
                lines.append(f"report: {path}")
            except OSError as error:
                lines.append(f"could not write {path}: {error}")
        say("\n".join(lines))
        self._wait_for_acks(acks)
        self._end([verdict.seen[r].record for r, _ in verdict.stalled])

    def _follow(self, summary: dict) -> None:
        try:  # the reporter waits (bounded) for these before it exits and takes the store with it
            self._io(lambda: self.store.add(self.key("acks"), 1))
        except Exception:
            pass
        say(f"[rank {self.rank}] stall: rank(s) {', '.join(map(str, summary['stalled'])) or 'none behind'} "
            f"named by rank {summary['by']}'s report; exiting with status {EXIT_STALLED}")
        self._end([])

    def _kill_own_children(self, stalled_records: list[dict | None]) -> None:
        """Kill the stalled ranks that this process started (Lightning's launcher, one node): stopped, they would
        outlive the job holding their memory; Lightning's launcher kills its children when one fails, likewise."""
        mine = set(own_children())
        for r in stalled_records:
            if r and r["host"] == self.identity["host"] and r["pid"] in mine:
                say(f"[rank {self.rank}] killing stalled rank {r['rank']} (pid {r['pid']}), started by this process")
                os.kill(r["pid"], signal.SIGKILL)

    def _end(self, stalled_records: list[dict | None]) -> None:
        """Exit with ``EXIT_STALLED``; a Lightning-spawned child exits 0, after killing the main process if that
        is the stalled one (see ``spawned_child``)."""
        try:  # the last collectives every live rank saw, for `moe-lightning stalls` (when torch records them)
            flight_recorder.dump(self.rank, self._report_dir() or Path("."))
        except Exception as error:
            say(f"[rank {self.rank}] no flight-recorder dump: {type(error).__name__}: {error}")
        if not self.spawned_child:
            self._kill_own_children(stalled_records)
            return self.exit(EXIT_STALLED)
        parent = os.getppid()
        if any(r and r["host"] == self.identity["host"] and r["pid"] == parent for r in stalled_records):
            say(f"[rank {self.rank}] the stalled main process (pid {parent}) is killed: the job ends with it")
            os.kill(parent, signal.SIGKILL)
            return self.exit(EXIT_STALLED)
        self.exit(0)
