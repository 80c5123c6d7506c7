"""The worker pool: each process tokenizes one unit at a time into its own shards, with progress from shared
counters, and the pool stops at the first failure (an error, a worker killed) or stop signal, saying which unit
and why; finished units stay for ``--resume``."""

import ctypes
import itertools
import multiprocessing
import os
import signal
import sys
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

import numpy as np

from moe_lightning.data.tokenize.errors import Stopped, TokenizeError, one_line
from moe_lightning.data.tokenize.files import NpyStream, remove_partials, shard_name, unit_record, write_json
from moe_lightning.data.tokenize.plan import describe_unit
from moe_lightning.data.tokenize.reading import new_tally, token_dtype, tokenized_batches, unit_segments
from moe_lightning.data.tokenizer import load_tokenizer
from moe_lightning.run.durable import atomic_write
from moe_lightning.run.signals import StopSignals

PROGRESS_EVERY_S = 2.0
STOP_WAIT_S = 10.0  # a stopped worker's grace before SIGKILL
SLOTS = 3  # shared counters per unit: bytes read, tokens written, the pid of the worker tokenizing it

_WORKER: dict = {}


def _init_worker(plan: dict, out: str, tokenizer_path: str | None, slots, tick=None) -> None:
    """Load the tokenizer and take the plan once per process (a unit is then sent as its index: the plan of a
    large corpus is megabytes); ``tick`` (a run in one process) runs between batches: progress, and a stop signal
    acted on."""
    if tick is None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the main process decides
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        _die_with_parent()
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # parallel across processes, not threads inside each
    _WORKER.update(plan=plan, out=Path(out), tokenizer=load_tokenizer(tokenizer_path), slots=slots,
                   tick=tick or (lambda: None), heap=HeapCeiling())


def _die_with_parent() -> None:
    """Linux: the kernel kills this worker when the main process dies, however it dies (even SIGKILL), so no
    orphan goes on writing shards a resumed run is about to write."""
    if sys.platform != "linux":
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # the parent died before the request took effect
        os._exit(1)


class HeapCeiling:
    """Keeps a process's resident memory flat over any number of batches. glibc keeps the pages of freed batches
    (text, ids) inside its heap, fragmented, so a worker's memory crept from 44 to 97 MB between a 50 MB and a
    2 GB file. Whenever the resident size grows ``SLACK`` past what the last return left, the free pages go back
    (``malloc_trim``): after most batches, as a batch's own memory is freed, so the next batch faults some pages in
    anew. With 2 MiB that costs byte-level tokenizing ~10 % (4 MiB left a 2 GB file's workers 3 MB above a 50 MB
    file's) and a BPE ~1 % (a batch encodes for 100+ ms, a trim takes 2). (A fixed mmap threshold kept memory flat
    too, but faulted every page of every batch: BPE 20 % and bytes 2x slower.)"""

    SLACK = 2 << 20

    def __init__(self):
        self.trim = getattr(ctypes.CDLL(None), "malloc_trim", None) if sys.platform == "linux" else None  # glibc
        self.page = os.sysconf("SC_PAGE_SIZE") if self.trim else 0
        self.ceiling = self._resident() + self.SLACK if self.trim else 0

    def _resident(self) -> int:
        with open("/proc/self/statm", "rb") as statm:
            return int(statm.read().split()[1]) * self.page

    def check(self) -> None:
        if self.trim is not None and self._resident() > self.ceiling:
            self.trim(0)
            self.ceiling = self._resident() + self.SLACK


def tokenize_unit(index: int) -> dict:
    """Tokenize unit ``index`` of the plan into ``part-<unit>-<n>.npy`` shards, then record it as done."""
    plan, out, tokenizer, slots = _WORKER["plan"], _WORKER["out"], _WORKER["tokenizer"], _WORKER["slots"]
    unit = plan["units"][index]
    slots[SLOTS * index + 2] = os.getpid()  # whose unit this is, should this process die
    dtype, shards, tally = token_dtype(tokenizer.vocab_size), [], new_tally()
    batches = tokenized_batches(unit_segments(unit, plan, tally), tokenizer, dtype)

    def reported(stream):
        for tokens, documents in stream:
            slots[SLOTS * index] = min(tally["bytes_read"], unit["bytes"])
            slots[SLOTS * index + 1] += len(tokens)
            _WORKER["tick"]()
            _WORKER["heap"].check()
            if len(tokens):
                yield tokens, documents

    stream = reported(batches)
    pending = next(stream, None)
    while pending is not None:
        name = shard_name(index, len(shards))
        with atomic_write(out / name) as file:
            shard = NpyStream(file, dtype)
            shard.write(*pending)
            pending = None
            for tokens, documents in stream:
                if shard.tokens >= plan["shard_tokens"]:
                    pending = (tokens, documents)
                    break
                shard.write(tokens, documents)
            shards.append(shard.finish(name))
    record = {"index": index, "bytes": unit["bytes"], "shards": shards, "null_rows": tally["null_rows"]}
    write_json(unit_record(out, index), record)
    slots[SLOTS * index] = unit["bytes"]
    return record


class Progress:
    """Input read, tokens written, tokens/s and ETA on stderr, every few seconds, from the per-unit counters the
    workers keep in shared memory (no queue a killed worker could leave locked)."""

    def __init__(self, units: list[dict], slots, already_done: int):
        self.slots, self.total, self.before = slots, sum(u["bytes"] for u in units), already_done
        self.start = self.last = time.monotonic()

    def maybe_show(self) -> None:
        if time.monotonic() - self.last >= PROGRESS_EVERY_S:
            self.show()

    def show(self, final: bool = False) -> None:
        self.last = now = time.monotonic()
        counts = np.frombuffer(self.slots, dtype=np.int64).reshape(-1, SLOTS)[:, :2].sum(0)
        done, tokens = self.before + int(counts[0]), int(counts[1])
        elapsed = max(now - self.start, 1e-9)
        rate = (done - self.before) / elapsed
        eta = "done" if final else (f"ETA {_duration((self.total - done) / rate)}" if rate > 0 else "ETA ?")
        digits = 1 if self.total >= 1e8 else 3
        print(f"tokenize: {done / 1e6:,.{digits}f} of {self.total / 1e6:,.{digits}f} MB read, {tokens:,} tokens, "
              f"{tokens / elapsed:,.0f} tokens/s, {eta}", file=sys.stderr, flush=True)


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}h{seconds // 60 % 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"


def _check(signals: StopSignals) -> None:
    """A step boundary (between batches, between units, each turn of the pool's loop): act on a recorded signal."""
    if signals.signum is not None:
        raise signals.stop(signals.signum)


def run_units(pending: list[dict], mine: list[dict], plan: dict, folder: Path, tokenizer_path, workers: int,
              signals: StopSignals) -> None:
    """Tokenize ``pending`` on ``workers`` processes; at the first failure (an error, a worker killed, a signal)
    stop every worker and say which unit failed and why; finished units stay for ``--resume``. While units run a
    stop signal is recorded (``signals``) and acted on at the next boundary; a repeat stops at once."""
    slots = multiprocessing.RawArray("q", SLOTS * len(plan["units"]))
    already = sum(u["bytes"] for u in mine if unit_record(folder, u["index"]).exists())
    progress = Progress(mine, slots, already)  # this task's share
    failure = None  # (unit or None, cause)

    def tick():
        progress.maybe_show()
        _check(signals)

    signals.started = True
    try:
        if workers == 1 or len(pending) <= 1:
            _init_worker(plan, str(folder), tokenizer_path, slots, tick=tick)
            for unit in pending:
                _check(signals)
                try:
                    tokenize_unit(unit["index"])
                except Stopped:  # a signal, not this unit's failure
                    raise
                except Exception as error:
                    failure = (unit, one_line(error).rstrip("."))
                    break
        else:
            context = multiprocessing.get_context("fork" if sys.platform == "linux" else "spawn")
            processes = min(workers, len(pending))
            executor = ProcessPoolExecutor(processes, mp_context=context, initializer=_init_worker,
                                           initargs=(plan, str(folder), tokenizer_path, slots))
            broken = False
            try:
                queued, futures = iter(pending), {}  # a few units in flight: memory flat over thousands of units
                while failure is None and not broken:
                    _check(signals)
                    try:
                        for unit in itertools.islice(queued, 2 * processes - len(futures)):
                            futures[executor.submit(tokenize_unit, unit["index"])] = unit
                    except BrokenProcessPool:  # a worker died since the last wait
                        broken = True
                        break
                    if not futures:
                        break
                    done, _ = wait(futures, timeout=0.5, return_when=FIRST_COMPLETED)
                    for future in sorted(done, key=lambda f: futures[f]["index"]):
                        error = future.exception()
                        if isinstance(error, BrokenProcessPool):
                            broken = True
                        elif error is not None and failure is None:
                            failure = (futures[future], one_line(error).rstrip("."))
                        del futures[future]
                    progress.maybe_show()
            finally:
                exits = _stop(executor)
            if broken:
                failure = _lost_unit(exits, pending, slots, folder)
        if failure is None:
            _check(signals)  # came after the last unit's last batch
    except Stopped as stop:
        remove_partials(folder, pending)
        kept = sum(unit_record(folder, u["index"]).exists() for u in plan["units"])
        name = signal.Signals(stop.exit_code - 128).name
        raise Stopped(f"tokenize: stopped by {name}; {kept} of {len(plan['units'])} units are finished and kept: "
                      "rerun the same command with --resume to finish.", stop.exit_code - 128) from None
    finally:
        signals.started = False  # from here (the manifest's turn) a signal stops at once again
    if failure is not None:
        remove_partials(folder, pending)
        unit, cause = failure
        kept = sum(unit_record(folder, u["index"]).exists() for u in plan["units"])
        where = describe_unit(unit, plan) if unit is not None else "a worker outside any unit"
        raise TokenizeError(f"tokenize: {where} failed: {cause}. {kept} of {len(plan['units'])} units are finished "
                            "and kept: fix the cause and rerun the same command with --resume.")
    progress.show(final=True)


def _lost_unit(exits: dict[int, int | None], pending: list[dict], slots, folder: Path) -> tuple[dict | None, str]:
    """Which unit a broken pool lost, and why, from its workers' exit codes. The pool ends the survivors with
    SIGTERM, so the worker that broke it is one with another code: killed by a signal, or exited (status 0 when
    it could not start: its initializer failed, the error printed above). When every worker ended by SIGTERM, a
    scheduler's stop (SLURM signals every process of a step) reached them before this process: a stop, not a
    failure."""
    died = {pid: code for pid, code in exits.items() if code is not None and code != -signal.SIGTERM}
    if not died:
        raise Stopped("tokenize: stopped by SIGTERM.", signal.SIGTERM)
    pid, code = min(died.items(), key=lambda item: item[1] == 0)  # a killed worker before one that could not start
    if code == 0:
        return None, f"a worker process (pid {pid}) could not start (the error is printed above)"
    try:
        how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with status {code}"
    except ValueError:
        how = f"was killed by signal {-code}"
    unit = next((u for u in pending if slots[SLOTS * u["index"] + 2] == pid
                 and not unit_record(folder, u["index"]).exists()), None)
    return unit, f"its worker process (pid {pid}) {how} (the out-of-memory killer sends SIGKILL)"


def _stop(executor: ProcessPoolExecutor) -> dict[int, int | None]:
    """Stop the pool now: queued units cancelled, running workers terminated (their partial shards are removed
    by the caller), so nothing goes on writing after we return. Returns each worker's exit code; a worker that
    ignores SIGTERM (stuck in the kernel, e.g. on a hung NFS mount) gets SIGKILL, and none is waited for forever."""
    processes = list((getattr(executor, "_processes", None) or {}).values())  # 3.14 has terminate_workers()
    executor.shutdown(wait=False, cancel_futures=True)
    for process in processes:
        if process.is_alive():
            process.terminate()
    for process in processes:
        process.join(STOP_WAIT_S)
        if process.is_alive():
            process.kill()
            process.join(STOP_WAIT_S)
    return {process.pid: process.exitcode for process in processes}
