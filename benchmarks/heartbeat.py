"""What the stall watchdog's heartbeat costs the training thread per step, on CPU (one process, gloo world of 1).

    python benchmarks/heartbeat.py [--config configs/tiny-fsdp.yaml] [--calls 1000000]

Counts the heartbeat's updates in one real training step of the config's model with its MoE layers under the
expert-parallel dispatcher (the package's recorded collectives: every expert all-to-all, forward and backward),
plus the 4 phase changes the ``StallWatchdog`` callback makes per optimizer step; times one update (the mean over
``--calls`` of ``enter`` and of an ``entered`` + ``finished`` pair) and prints one JSON line: updates per step,
nanoseconds per update, microseconds per step, and that as a share of the step measured here. Also the bytes of one
published record (the watchdog thread, not the training thread, sends it: at most every ``publish_s``).

The straggler check's price: ``fsdp_units`` (FSDP units of the config: each unit's pre-forward is one more
``entered`` + ``finished`` pair per forward, the two hooks around FSDP's costing ``hook_pair_ns``), the callback's
bookkeeping on a step that ends no window (``straggler_bookkeeping_ns``: ``StallWatchdog.on_train_batch_end`` with
the check on minus off), and, with ``--gather-ranks N`` (default 2), one window's gather of three float64 per rank
over a gloo group of N local processes (``window_gather_us``: the median of ``--gathers``, ranks already in step).
The times come from whatever machine runs it: on a shared machine they are upper bounds.
"""

import argparse
import json
import os
import socket
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from moe_lightning.model.transformer import MoETransformer
from moe_lightning.parallel.expert_parallel import apply_expert_parallel
from moe_lightning.parallel.units import fsdp_units
from moe_lightning.planner.run_config import load_model_config
from moe_lightning.run import heartbeat
from moe_lightning.run.heartbeat import Heartbeat
from moe_lightning.run.stragglers import StragglerJudge, WindowClock
from moe_lightning.run.watchdog import RankWatchdog
from moe_lightning.training.callbacks.stall_watchdog import StallWatchdog

REPO_ROOT = Path(__file__).resolve().parents[1]
PHASES_PER_STEP = 4  # forward, backward, optimizer, data (StallWatchdog's hooks)


def per_update_ns(calls: int) -> dict[str, float]:
    beat = Heartbeat()
    heartbeat.activate(beat)
    try:
        start = time.perf_counter_ns()
        for _ in range(calls):
            beat.enter("forward")
        enter = (time.perf_counter_ns() - start) / calls
        start = time.perf_counter_ns()
        for _ in range(calls):
            heartbeat.entered("all_to_all", None)
            heartbeat.finished()
        pair = (time.perf_counter_ns() - start) / calls
    finally:
        heartbeat.activate(None)
    return {"enter_ns": round(enter, 1), "entered_finished_pair_ns": round(pair, 1)}


def hook_pair_ns(calls: int) -> float:
    """The two pre-forward hooks' cost per module call (a module with them minus one without)."""
    plain, hooked = torch.nn.Identity(), torch.nn.Identity()
    hooked.register_forward_pre_hook(lambda *_: heartbeat.entered("all_gather", dim="fsdp"), prepend=True)
    hooked.register_forward_pre_hook(lambda *_: heartbeat.finished())
    x, beat, times = torch.zeros(1), Heartbeat(), {}
    heartbeat.activate(beat)
    try:
        for name, module in (("plain", plain), ("hooked", hooked)):
            start = time.perf_counter_ns()
            for _ in range(calls):
                module(x)
            times[name] = (time.perf_counter_ns() - start) / calls
    finally:
        heartbeat.activate(None)
    return round(times["hooked"] - times["plain"], 1)


def straggler_bookkeeping_ns(calls: int) -> float:
    """``on_train_batch_end`` per optimizer step that ends no window, with the straggler check on minus off."""
    costs = {}
    for every in (0, 10**12):
        callback = StallWatchdog(timeout_s=0, straggler_every=every)
        callback.heartbeat = Heartbeat()
        if every:
            callback._stragglers, callback._clock = StragglerJudge(), WindowClock()
        trainer = SimpleNamespace(global_step=1)
        start = time.perf_counter_ns()
        for step in range(calls):
            trainer.global_step = step + 1
            callback.on_train_batch_end(trainer, None, None, None, 0)
        costs[every] = (time.perf_counter_ns() - start) / calls
    return round(costs[10**12] - costs[0], 1)


def _gather_rank(rank: int, world: int, port: int, gathers: int, out) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    local = torch.tensor([0.5, 0.6, 0.1], dtype=torch.float64)
    times = []
    for _ in range(gathers + 10):
        dist.barrier()
        start = time.perf_counter()
        windows_R_3 = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(windows_R_3, local)
        times.append(time.perf_counter() - start)
    if rank == 0:
        out.put(statistics.median(times[10:]) * 1e6)
    dist.destroy_process_group()


def window_gather_us(world: int, gathers: int) -> float:
    """Median microseconds of one window's gather over ``world`` local gloo processes that are already in step."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    out = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(_gather_rank, args=(world, port, gathers, out), nprocs=world, start_method="spawn")
    return round(out.get(), 1)


def one_step(config_path: Path, batch: int, seq: int) -> tuple[int, float]:
    """Heartbeat updates and seconds of one forward + backward + AdamW step (after one warm-up step)."""
    config = load_model_config(config_path)
    torch.manual_seed(0)
    model = MoETransformer(config)
    apply_expert_parallel(model.moe_layers(), dist.group.WORLD)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, config.vocab_size, (batch, seq + 1))
    beat = Heartbeat()
    for warm in (True, False):
        heartbeat.activate(None if warm else beat)
        start = time.perf_counter()
        logits = model(tokens[:, :-1])
        F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten()).backward()
        optimizer.step()
        optimizer.zero_grad()
        seconds = time.perf_counter() - start
    heartbeat.activate(None)
    return beat.progress + PHASES_PER_STEP, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=REPO_ROOT / "configs" / "tiny-fsdp.yaml")
    parser.add_argument("--calls", type=int, default=1_000_000)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--gather-ranks", type=int, default=2)
    parser.add_argument("--gathers", type=int, default=200)
    args = parser.parse_args()
    gather_us = window_gather_us(args.gather_ranks, args.gathers) if args.gather_ranks > 1 else None
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29561")
    dist.init_process_group("gloo", rank=0, world_size=1)
    updates, step_s = one_step(args.config, args.batch, args.seq)
    costs = per_update_ns(args.calls)
    per_update = max(costs["enter_ns"], costs["entered_finished_pair_ns"] / 2)
    beat = Heartbeat()
    beat.entered("all_to_all", None)
    record = RankWatchdog(beat, 0, 1, 600.0, identity={"coordinates": {"replicate": 0, "shard": 0, "context": 0,
                                                                          "expert": 0, "expert_shard": 0}}).record()
    units = len(fsdp_units(MoETransformer(load_model_config(args.config)), expert_parallel=True))
    print(json.dumps({"config": str(args.config.relative_to(REPO_ROOT)), "updates_per_step": updates, **costs,
                      "us_per_step": round(updates * per_update / 1e3, 2), "step_s": round(step_s, 4),
                      "share_of_step": f"{updates * per_update / 1e9 / step_s:.2e}", "record_bytes": len(record),
                      "fsdp_units": units, "hook_pair_ns": hook_pair_ns(args.calls // 10),
                      "straggler_bookkeeping_ns": straggler_bookkeeping_ns(args.calls // 10),
                      "window_gather_ranks": args.gather_ranks, "window_gather_us": gather_us}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
