"""Which rank is slower than the rest, judged once per window of steps from each rank's *busy* time.

Ranks that train in lockstep take the same host wall-clock time per step: a fast rank waits inside a collective for
the slow one. So the measure is each rank's busy time over a window: its wall time minus the time it spent blocked
in the waits of the collectives its heartbeat records (``Heartbeat.waited_s``). The slow rank waits least and is
busiest.

Every ``every`` steps the ranks exchange ``[busy_s, wall_s, waited_s]`` once (one small gather over a gloo side
channel); ``StragglerJudge`` then says the spread (max / median busy time within each peer group, the largest of
them) and names a rank whose busy time exceeds ``factor`` times the median of its peers for ``windows`` windows in a
row. Peers are the other ranks that run the same program: under pipeline parallelism, those of the same stage
(stages differ in work by design, and a stage waits for the next in sends and receives no heartbeat records).
Nothing here does I/O or reads a clock: ``WindowClock`` is handed the times, so both are tested without processes.
"""

import statistics
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

DEFAULT_STRAGGLER_EVERY = 50
"""Steps per window: one gather of three floats per rank every 50 steps (none per step)."""
DEFAULT_STRAGGLER_FACTOR = 1.5
"""A rank busier than 1.5 times the median of the others is slow in that window."""
DEFAULT_STRAGGLER_WINDOWS = 3
"""Windows in a row a rank must be slow before it is named: one slow window (a save, a compile) is not a straggler."""


def check_straggler_settings(every, factor, windows, owner: str = "StallWatchdog") -> tuple[int, float, int]:
    """The three settings, or a one-line error naming the field and what it accepts (before any process starts)."""
    if isinstance(every, bool) or not isinstance(every, int) or every < 0:
        raise ValueError(f"{owner}.straggler_every={every!r}: steps per straggler window, an integer >= 0 (0 turns "
                         f"the check off; default {DEFAULT_STRAGGLER_EVERY}).")
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 1 < factor < float("inf"):
        raise ValueError(f"{owner}.straggler_factor={factor!r}: how many times the others' median busy time makes a "
                         f"rank slow, a number > 1 (default {DEFAULT_STRAGGLER_FACTOR:g}).")
    if isinstance(windows, bool) or not isinstance(windows, int) or windows < 1:
        raise ValueError(f"{owner}.straggler_windows={windows!r}: windows in a row a rank must be slow before it is "
                         f"named, an integer >= 1 (default {DEFAULT_STRAGGLER_WINDOWS}).")
    return every, float(factor), windows


@dataclass
class WindowClock:
    """One rank's window: wall seconds since it started, minus the seconds waited in collectives since then."""

    started_at: float = 0.0
    waited_at_start: float = 0.0

    def restart(self, now: float, waited_s: float) -> None:
        self.started_at, self.waited_at_start = now, waited_s

    def lap(self, now: float, waited_s: float) -> tuple[float, float, float]:
        """``(busy_s, wall_s, waited_s)`` of the window so far (busy never below 0)."""
        wall_s, waited = now - self.started_at, waited_s - self.waited_at_start
        return max(0.0, wall_s - waited), wall_s, waited


@dataclass
class Window:
    """What one window says: the spread (the largest over peer groups of max / median busy time; 1 when every
    group's ranks are equally busy, so stages that differ in work by design do not raise it), the ranks slow in it with
    their factor over the others' median, and those named now (slow for ``windows`` windows in a row)."""

    spread: float
    slow: dict[int, float]
    named: dict[int, float]


@dataclass
class StragglerJudge:
    """Keeps each rank's run of slow windows; a normal window ends the run. A rank is named once per run, when the
    run reaches ``windows``."""

    factor: float = DEFAULT_STRAGGLER_FACTOR
    windows: int = DEFAULT_STRAGGLER_WINDOWS
    runs: dict[int, int] = field(default_factory=dict)

    def observe(self, busy_s: Sequence[float], peers: Sequence[Hashable] | None = None) -> Window:
        """``busy_s``: each rank's busy seconds in the window; ``peers``: each rank's peer group (default: one), a
        rank is compared with the median of the other ranks of its group (a group of one is never slow)."""
        peers = peers if peers is not None else [0] * len(busy_s)
        groups: dict[Hashable, list[float]] = {}
        for rank, busy in enumerate(busy_s):
            groups.setdefault(peers[rank], []).append(busy)
        spread = max(_spread(group) for group in groups.values())
        slow = {}
        for rank, busy in enumerate(busy_s):
            others = [b for r, b in enumerate(busy_s) if r != rank and peers[r] == peers[rank]]
            bound = statistics.median(others) if others else 0.0
            if bound > 0 and busy > self.factor * bound:
                slow[rank] = busy / bound
        self.runs = {rank: self.runs.get(rank, 0) + 1 for rank in slow}
        named = {rank: ratio for rank, ratio in slow.items() if self.runs[rank] == self.windows}
        return Window(spread, slow, named)


def _spread(busy_s: list[float]) -> float:
    median = statistics.median(busy_s)
    return max(busy_s) / median if median > 0 else 1.0


def straggler_message(rank: int, host: str, pid: int, coordinates: dict[str, int], ratio: float, factor: float,
                      windows: int, every: int, step: int) -> str:
    """The warning's one line: who, where in the mesh, by how much, for how long."""
    where = ", ".join(f"{name} {value}" for name, value in coordinates.items())
    return (f"straggler: rank {rank} (host {host}, pid {pid}" + (f"; {where}" if where else "") + f") was busy "
            f"{ratio:.2f}x the other ranks' median (above {factor:g}x) for {windows} windows of {every} steps in a "
            f"row, up to step {step}; the others wait for it in every collective")
