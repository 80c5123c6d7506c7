"""The straggler check's parts without processes: the judge (factor, windows in a row, reset), the window clock
over the heartbeat's waited time, the settings' refusals and the warning's text."""

import time

import pytest
import torch

from moe_lightning.parallel.expert_parallel import _Exchange
from moe_lightning.run import heartbeat
from moe_lightning.run.heartbeat import Heartbeat
from moe_lightning.run.stragglers import StragglerJudge, WindowClock, check_straggler_settings, straggler_message
from moe_lightning.training.callbacks.stall_watchdog import StallWatchdog, mark_blocking_pre_forward


def test_a_rank_slower_than_the_factor_is_named_after_the_stated_windows_in_a_row_and_once():
    judge = StragglerJudge(factor=1.5, windows=3)
    slow = [1.0, 1.0, 1.6, 1.0]  # rank 2 is 1.6x the others' median
    named = [judge.observe(slow).named for _ in range(5)]
    assert named == [{}, {}, {2: pytest.approx(1.6)}, {}, {}]  # on the third window, once


def test_a_normal_window_resets_the_run():
    judge = StragglerJudge(factor=1.5, windows=3)
    windows = [[1, 2.0], [1, 2.0], [1, 1.2], [1, 2.0], [1, 2.0], [1, 2.0]]
    named = [judge.observe(busy).named for busy in windows]
    assert [bool(n) for n in named] == [False, False, False, False, False, True]
    assert named[-1] == {1: pytest.approx(2.0)}


def test_the_factor_is_a_strict_bound_over_the_others_median_and_the_spread_is_max_over_median():
    judge = StragglerJudge(factor=1.5, windows=1)
    at_bound = judge.observe([2.0, 2.0, 3.0])  # 3.0 == 1.5 x 2.0: not slower than the factor
    assert at_bound.slow == {} and at_bound.spread == pytest.approx(1.5)
    two = judge.observe([1.0, 2.0])  # two ranks: each is compared with the other, not with a median holding itself
    assert two.slow == {1: pytest.approx(2.0)} and two.spread == pytest.approx(2.0 / 1.5)


def test_equal_or_idle_ranks_are_never_slow():
    judge = StragglerJudge(factor=1.5, windows=1)
    assert judge.observe([0.5] * 8).named == {} and judge.observe([0.5] * 8).spread == 1.0
    assert judge.observe([0.0, 0.0]).spread == 1.0 and judge.observe([0.0, 0.0]).slow == {}


def test_the_window_clock_subtracts_the_time_waited_in_recorded_collectives():
    beat = Heartbeat()
    heartbeat.activate(beat)
    try:
        clock = WindowClock()
        clock.restart(now=100.0, waited_s=beat.waited_s)
        heartbeat.entered("all_gather", dim="fsdp")
        heartbeat.waited(0.25)  # as if it was blocked 0.25 s waiting for the others
        heartbeat.finished()
        heartbeat.progressed()
    finally:
        heartbeat.activate(None)
    assert beat.waited_s == pytest.approx(0.25, abs=0.01)
    busy, wall, waited = clock.lap(now=101.0, waited_s=beat.waited_s)
    assert wall == 1.0 and waited == pytest.approx(0.25, abs=0.01) and busy == pytest.approx(0.75, abs=0.01)
    assert beat.snapshot()["collective"] == {"op": "all_gather", "dim": "fsdp", "seq": 1, "state": "finished"}
    assert beat.progress == 3  # entered, finished, progressed


@pytest.mark.parametrize("field, value, text", [
    ("straggler_every", -1, r"^StallWatchdog\.straggler_every=-1: steps per straggler window, an integer >= 0"),
    ("straggler_every", 2.5, r"^StallWatchdog\.straggler_every=2\.5: "),
    ("straggler_factor", 1.0, r"^StallWatchdog\.straggler_factor=1\.0: .* a number > 1 \(default 1\.5\)"),
    ("straggler_factor", "x", r"^StallWatchdog\.straggler_factor='x': "),
    ("straggler_windows", 0, r"^StallWatchdog\.straggler_windows=0: .* an integer >= 1 \(default 3\)"),
])
def test_bad_straggler_settings_are_one_line_naming_the_field(field, value, text):
    with pytest.raises(ValueError, match=text):
        StallWatchdog(**{field: value})
    assert check_straggler_settings(0, 2, 1) == (0, 2.0, 1)


def test_the_warning_names_rank_host_pid_coordinates_factor_and_windows():
    line = straggler_message(3, "gpu017", 4242, {"replicate": 0, "shard": 3, "expert": 1}, 1.87, 1.5, 3, 50, 450)
    assert line == ("straggler: rank 3 (host gpu017, pid 4242; replicate 0, shard 3, expert 1) was busy 1.87x the "
                    "other ranks' median (above 1.5x) for 3 windows of 50 steps in a row, up to step 450; the others "
                    "wait for it in every collective")


def test_ranks_are_compared_within_their_peer_group_only():
    """Pipeline stages differ in work by design: the last stage (ranks 2, 3: the head and the loss) twice as busy
    as the first is not a straggler; rank 3 twice as busy as rank 2, its stage's other rank, is."""
    judge = StragglerJudge(factor=1.5, windows=1)
    stages = [0, 0, 1, 1]
    by_design = judge.observe([1.0, 1.0, 2.0, 2.0], peers=stages)
    assert by_design.slow == {} and by_design.spread == 1.0  # not 2 / 1.5: the spread is within each stage
    assert judge.observe([1.0, 1.0, 2.0, 4.0], peers=stages).named == {3: pytest.approx(2.0)}
    assert judge.observe([1.0, 3.0], peers=[0, 1]).slow == {}  # alone in its group: never compared
    assert judge.observe([1.0, 1.0, 2.0, 4.0], peers=stages).spread == pytest.approx(4.0 / 3.0)  # the largest


class _SlowWork:
    """An all-to-all's work handle whose ``wait`` blocks ``seconds`` (the others are late)."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def wait(self):
        time.sleep(self.seconds)


def _in_flight(wait_s: float) -> _Exchange:
    """An exchange as ``launch`` leaves it: entered on the heartbeat, its work pending."""
    exchange = _Exchange(group=None, send_splits=[], recv_splits=[], grad_scale=1.0)
    heartbeat.entered("all_to_all", dim="expert")
    exchange._work, exchange._buffers = _SlowWork(wait_s), (None, torch.ones(2, 3))
    exchange._layout = exchange._where = None
    return exchange


def test_only_the_blocking_wait_of_an_exchange_is_waited_not_the_compute_it_overlaps():
    beat = Heartbeat()
    heartbeat.activate(beat)
    try:
        exchange = _in_flight(wait_s=0.1)
        time.sleep(0.2)  # the shared experts (forward) or autograd (backward) run between launch and land
        exchange.land()
    finally:
        heartbeat.activate(None)
    assert 0.1 <= beat.waited_s < 0.18  # not 0.3: the 0.2 s of compute is busy time (loose above: a loaded machine)


def test_a_unit_marked_inside_an_exchange_in_flight_loses_neither_wait():
    fsdp_wait_s = 0.05
    unit = torch.nn.Linear(2, 2)
    unit.register_forward_pre_hook(lambda *_: time.sleep(fsdp_wait_s))  # stands for FSDP's all-gather wait
    mark_blocking_pre_forward(unit, "all_gather", "fsdp")
    beat = Heartbeat()
    heartbeat.activate(beat)
    try:
        exchange = _in_flight(wait_s=0.3)  # chunk c+1's exchange in flight while chunk c's experts run
        unit(torch.ones(1, 2))
        time.sleep(0.1)  # compute
        exchange.land()
    finally:
        heartbeat.activate(None)
    assert 0.35 <= beat.waited_s < 0.43  # both waits, not the 0.1 s of compute
    assert beat.collectives == 2  # both are still in the stall record
