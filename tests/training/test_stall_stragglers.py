"""A straggler in a real 2-process ``fit`` (configs/tiny-fsdp.yaml, gloo): rank 1 sleeps before every forward
(``tests/launchers/stall_helpers.SlowRank``); rank 0 names it, with host, pid and mesh coordinates, once it has been
slow for ``straggler_windows`` windows in a row, and logs ``train/busy_time_spread``. Equal ranks raise nothing
(slow). One short case in the main suite."""

import csv
import re

import pytest

from tests.training.test_preemption import PRINT_STEPS, finish, fit_command, launch

SMALL = ("--data.init_args.seq_len=32", "--data.init_args.batch_size=2", "--model.init_args.config.n_layers=2")
WATCHDOG = "--trainer.callbacks+=moe_lightning.training.callbacks.stall_watchdog.StallWatchdog"
SLOW = "--trainer.callbacks+=tests.launchers.stall_helpers.SlowRank"


def straggler_fit(tmp_path, steps: int, *extra: str) -> str:
    """A fit with the straggler check every 2 steps, factor 1.5, 3 windows; returns its output."""
    out = finish(launch(fit_command("tiny-fsdp.yaml", tmp_path, f"--trainer.max_steps={steps}", *SMALL, PRINT_STEPS,
                                    WATCHDOG, "--trainer.callbacks.straggler_every=2",
                                    "--trainer.callbacks.straggler_factor=1.5",
                                    "--trainer.callbacks.straggler_windows=3", *extra), tmp_path))
    assert "Traceback" not in out, out[-3000:]
    return out


def spreads(tmp_path) -> dict[int, float]:
    """``train/busy_time_spread`` by step, from the CSV logger's file."""
    path = next(tmp_path.glob("tiny-fsdp/version_*/metrics.csv"))
    with path.open() as file:
        return {int(row["step"]): float(row["train/busy_time_spread"]) for row in csv.DictReader(file)
                if row.get("train/busy_time_spread")}


@pytest.mark.slow  # a 2-process fit over three windows
def test_a_rank_that_sleeps_before_every_forward_is_named_after_three_slow_windows(tmp_path):
    """Windows end at steps 2, 4, 6 (the first step is not measured): rank 1, 0.6 s busier per step than rank 0
    (whose wait for it lands in FSDP's first all-gather), is named once, at step 6, as expert 1."""
    out = straggler_fit(tmp_path, 7, SLOW, "--trainer.callbacks.rank=1", "--trainer.callbacks.seconds=0.6")
    warnings = [line for line in out.splitlines() if "straggler: rank" in line]
    assert len(warnings) == 1, out[-3000:]
    host, pid = re.search(r"slow rank 1 is host (\S+) pid (\d+)", out).groups()
    assert re.search(rf"straggler: rank 1 \(host {re.escape(host)}, pid {pid}; .*expert 1.*\) was busy \d+\.\d\dx the "
                     r"other ranks' median \(above 1\.5x\) for 3 windows of 2 steps in a row, up to step 6",
                     warnings[0]), (host, pid, warnings)  # rank 1's own host and pid, not another rank's
    logged = spreads(tmp_path)
    assert sorted(logged) == [2, 4, 6], logged
    assert all(spread > 1.2 for spread in logged.values()), logged  # 2 ranks: max / mean of the two


@pytest.mark.extended
def test_equal_ranks_raise_no_straggler_warning_and_log_a_spread_near_one(tmp_path):
    out = straggler_fit(tmp_path, 13)
    assert "straggler: rank" not in out, out[-3000:]
    logged = spreads(tmp_path)
    assert sorted(logged) == [2, 4, 6, 8, 10, 12], logged


@pytest.mark.extended
def test_on_four_ranks_the_slow_one_is_named_with_its_mesh_coordinates(tmp_path):
    """4 gloo processes, EP 2 inside a shard group of 4: rank 2 (expert rank 0 of expert-shard 1) sleeps; the
    others' median is the bound, and only rank 2 is named."""
    out = straggler_fit(tmp_path, 7, "--trainer.devices=4", SLOW, "--trainer.callbacks.rank=2",
                        "--trainer.callbacks.seconds=0.6")
    warnings = [line for line in out.splitlines() if "straggler: rank" in line]
    assert len(warnings) == 1 and "straggler: rank 2 (host" in warnings[0], out[-3000:]
    assert "; replicate 0, shard 2, " in warnings[0] and ", expert 0, expert_shard 1)" in warnings[0]
