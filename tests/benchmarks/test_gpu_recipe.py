"""The recipe part's device-only code, run on CPU: the shape it picks by the card's memory (through ``plan``), its
timed window (several steps, no snapshot or other host work inside), allocator retries counted over the timed
steps only, and host syncs parsed from a recorded profiler trace (``fixtures/profiled_step_trace.json``)."""

import contextlib
import json
import subprocess
import sys

import pytest

from tests.support.benchmark_script import load_benchmark
from tests.support.distributed import REPO_ROOT, clean_env

FIXTURES = REPO_ROOT / "tests" / "benchmarks" / "fixtures"
GIB = 1 << 30


@pytest.fixture(scope="module")
def gpu_recipe():
    return load_benchmark("gpu_recipe")


@pytest.fixture(scope="module")
def gpu_shapes():
    return load_benchmark("gpu_shapes")


@pytest.mark.parametrize("memory_gib, blocks, total, active", [(141, 20, "6.33B", "1.49B"), (80, 16, "5.11B", "1.24B")])
def test_recipe_picks_the_largest_shape_whose_planned_peak_leaves_8_percent(gpu_recipe, capsys, memory_gib, blocks,
                                                                           total, active):
    """An H200 (141 GiB) runs the 6.33B / 1.49B recipe, an H100 80 GB 16 blocks (>= 1B active); the line gives the
    planned peak against the memory, within 92 % of it."""
    gpu_recipe.main(["--describe", "--gpu-memory", str(memory_gib)])
    line = capsys.readouterr().out.strip()
    assert line.startswith(f"recipe, {blocks} blocks: {total} parameters, {active} active, sequence 8192 x batch 2; "
                           f"planned peak ")
    peak = float(line.split("planned peak ")[1].split(" GiB")[0])
    assert f"of {memory_gib:.1f} GiB" in line and peak <= 0.92 * memory_gib


def test_recipe_table_steps_down_and_refuses_a_card_too_small_in_one_line(gpu_shapes, capsys):
    shape = gpu_shapes.pick_recipe(60.0)
    assert shape.config.n_layers == 12 and shape.peak_gib <= 0.92 * 60  # 51.8 GiB planned
    assert gpu_shapes.recipe_shape(16).peak_gib > 0.92 * 60  # the next larger one would not leave 8 %
    with pytest.raises(SystemExit):
        gpu_shapes.main(["--gpu-memory", "40"])
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("gpu_shapes: no recipe shape fits 40.0 GiB: the smallest (recipe, "
                                                   "12 blocks) plans 51.80 GiB")


def test_sync_sites_of_a_recorded_trace_name_each_blocking_call_by_its_frame(gpu_recipe):
    """The recorded CPU trace of the recipe's profiled step, with the CUDA runtime calls a GPU step makes placed in
    chosen frames (see the fixture's make_ script): every blocking call, ``cudaFree`` included, is counted and named
    by the innermost frame of this package, else Lightning's, else the operator (another thread); kernel launches
    and asynchronous copies are not counted."""
    trace = load_benchmark("gpu_trace")
    events = trace.load_trace(FIXTURES / "profiled_step_trace.json")
    injected = sorted((e for e in events if e.get("cat") == "cuda_runtime"), key=lambda e: e["ts"])
    expected = [e["args"]["expected_site"] for e in injected if e["args"]["counts"]]
    assert trace.sync_sites(events) == expected and len(expected) == 16
    assert sum(e["name"] == "cudaFree" for e in injected) == 3 and "cudaFree" in trace.SYNC_CALLS
    assert any(site.startswith("lightning/") for site in expected) and "aten::slice" in expected


def test_sync_sites_mark_the_benchmarks_own_synchronisations_inside_lightnings_hooks():
    """The probe's window bounds run inside Lightning's callback hooks, under ``main`` of the script: a blocking call
    whose innermost frame of our code is a ``gpu_*.py`` one is the benchmark's own (marked, left out of the step's
    count); one under a Lightning or package frame, even with the script's ``main`` further out, is the step's."""
    trace = load_benchmark("gpu_trace")

    def frame(name, ts, dur):
        return {"ph": "X", "cat": "python_function", "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": 1}

    def sync(name, ts):
        return {"ph": "X", "cat": "cuda_runtime", "name": name, "ts": ts, "dur": 1, "pid": 1, "tid": 1}
    events = [frame("gpu_recipe.py(340): main", 0, 100), frame("lightning/pytorch/trainer/trainer.py(584): fit", 1, 98),
              frame("lightning/pytorch/trainer/call.py(210): _call_callback_hooks", 10, 10),
              frame("gpu_recipe.py(160): on_train_batch_end", 11, 8), frame("gpu_device.py(40): synchronize", 12, 6),
              frame("torch/cuda/__init__.py(1080): synchronize", 13, 4), sync("cudaDeviceSynchronize", 14),
              frame("moe_lightning/optim/muon.py(200): step", 30, 10), sync("cudaStreamSynchronize", 32),
              frame("lightning/pytorch/loops/optimization/automatic.py(300): run", 50, 10), sync("cudaMemcpy", 52)]
    sites = trace.sync_sites(events)
    assert sites == [trace.OWN + "gpu_device.py(40): synchronize", "moe_lightning/optim/muon.py(200): step",
                     "lightning/pytorch/loops/optimization/automatic.py(300): run"]


class StubCuda:
    """``gpu_device.Device`` on the host with a stand-in allocator: statistics whose retry count grows by one at
    every synchronisation, a snapshot of two stream pools, and a log of every call in order."""

    def __init__(self, device):
        self.device, self.cuda, self.calls, self.retries = device.device, False, [], 0
        self.event, self.name = device.event, device.name

    def synchronize(self):
        self.calls.append("sync")
        self.retries += 1

    def memory_stats(self):
        self.calls.append("stats")
        return {"num_alloc_retries": self.retries, "allocated_bytes.all.peak": 5 * GIB,
                "reserved_bytes.all.peak": 6 * GIB}

    def memory_allocated(self):
        return 4 * GIB

    def memory_snapshot(self):
        self.calls.append("snapshot")
        return [{"stream": 7, "total_size": 4 * GIB, "allocated_size": 3 * GIB},
                {"stream": 9, "total_size": GIB, "allocated_size": 0}]

    def compute_stream_id(self):
        return 7

    def mem_get_info(self):
        self.calls.append("mem_get_info")
        return 70 * GIB, 80 * GIB


@pytest.mark.extended
def test_recipe_dry_run_times_three_steps_after_warm_up_with_nothing_else_in_their_windows(gpu_recipe, capsys):
    """The timed steps come right after the warm-up and their figure is printed before the snapshot and profiled
    steps (whose trace export is slow); after those, one memory line and the figure again with the syncs."""
    gpu_device = load_benchmark("gpu_device")
    import torch
    stub = StubCuda(gpu_device.Device(torch.device("cpu")))
    summary = gpu_recipe.main(["--dry-run"], device=stub)
    out = capsys.readouterr().out.splitlines()
    rows = [json.loads(line) for line in out if line.startswith('{"step"')]
    assert [(r["step"], r["role"]) for r in rows] == [(0, "warm-up"), (1, "timed"), (2, "timed"), (3, "timed"),
                                                      (4, "snapshots"), (5, "profiled")]
    # each step's window is one pair of synchronisations; nothing but the step (no snapshot, no statistics) inside
    syncs = [i for i, call in enumerate(stub.calls) if call == "sync"]
    assert len(syncs) == 2 * len(rows)
    windows = [stub.calls[syncs[2 * k] + 1:syncs[2 * k + 1]] for k in range(len(rows))]
    assert windows[4] == ["snapshot", "snapshot"] and all(window == [] for window in windows[1:4])
    assert stub.calls.count("snapshot") == 3  # end of forward, end of backward, end of step: step 4 only
    # the figure: median and range of the timed steps, printed at once and again last with the syncs
    timed = [r["tokens_per_s"] for r in rows[1:4]]
    assert summary["timed_steps"] == [1, 2, 3] and summary["tokens_per_s"] == {
        "median": sorted(timed)[1], "min": min(timed), "max": max(timed)}
    syncs_at = next(i for i, line in enumerate(out) if line.startswith('{"host_syncs_profiled_step": 0'))
    assert json.loads(out[syncs_at])["benchmarks_own_syncs_left_out"] == 0  # a CPU trace has no CUDA calls
    pools_at = next(i for i, line in enumerate(out) if line.startswith('{"pools_at_peak"'))
    row_at = {r["step"]: next(i for i, line in enumerate(out) if line.startswith(f'{{"step": {r["step"]},'))
              for r in rows}
    figures = [i for i, line in enumerate(out) if line.startswith("figure: recipe | ")]
    memory_at = next(i for i, line in enumerate(out) if line.startswith("memory: "))
    assert row_at[3] < figures[0] < pools_at < row_at[4] < syncs_at < row_at[5] < memory_at < figures[1]
    assert len(figures) == 2 and figures[1] == len(out) - 1
    assert "3 timed steps, syncs/step not yet profiled (step 5), 6 allocator retries" in out[figures[0]]
    assert "3 timed steps, 0 syncs/step, 6 allocator retries" in out[-1]  # 6 syncs in the timed steps, not 12
    assert summary["alloc_retries_timed_steps"] == 6
    assert out[memory_at] == ("memory: planned peak n/a; measured over the whole run max_memory_allocated 5.00 GiB, "
                              "max_memory_reserved 6.00 GiB; mem_get_info free 70.00 GiB of 80.00 GiB")
    assert summary["pools_at_peak"] == {"where": "end of forward", "compute": {
        "reserved_gib": 4.0, "allocated_gib": 3.0, "cached_unused_gib": 1.0}, "stream 9": {
        "reserved_gib": 1.0, "allocated_gib": 0.0, "cached_unused_gib": 1.0}}
    assert summary["max_allocated_gib"] == 5.0 and all(0 < loss < 10 for loss in summary["losses"])
    assert summary["offload"]["boundaries_out"] == 2 and summary["offload"]["copies_in"] == 2  # 3 blocks, not the last
    # MFU from the package's count: per-token FLOPs between the document-masked and the whole-sequence count
    from moe_lightning.planner.flops import training_flops_per_token
    config = gpu_recipe.recipe_config(dry_run=True)
    flops_per_token = rows[3]["flops"] / (2 * 64)
    assert flops_per_token == pytest.approx(training_flops_per_token(config, 64, doc_len=16), rel=0.1)
    table = [line for line in out if line.startswith("| ")]
    assert table[0] == "| measurement | value |"
    assert any(line.startswith("| MFU vs measured bf16 GEMM") for line in table)


def test_recipe_offload_stall_is_read_from_events(gpu_recipe):
    class Event:  # stand-in timing event: elapsed_time(end) = end's time - this one's, in ms
        def __init__(self, t):
            self.t = t

        def elapsed_time(self, other):
            return other.t - self.t
    offload = gpu_recipe.TimedOffload()
    offload.waits = [(Event(10), Event(12.5)), (Event(20), Event(19)), (Event(30), Event(30.5))]
    assert offload.exposed_ms() == (3.0, 2)  # the copy ending before compute reached the wait costs nothing


@pytest.mark.slow
def test_every_gpu_part_imports_and_the_list_prints_without_jsonargparse():
    """The GPU machine has torch, Lightning and torchmetrics but not jsonargparse, and no registry to fetch it: every
    part must import, and the shapes (the 1T shard's config included) be read, without it."""
    script = f"""
import importlib.metadata, sys
sys.modules["jsonargparse"] = None  # any import of it fails, and its metadata is gone (Lightning checks that first)
version = importlib.metadata.version
def without_jsonargparse(name):
    if name == "jsonargparse":
        raise importlib.metadata.PackageNotFoundError(name)
    return version(name)
importlib.metadata.version = without_jsonargparse
sys.path.insert(0, {str(REPO_ROOT)!r})
from tests.support.benchmark_script import load_benchmark
for name in ("gpu_paths", "gpu_recipe", "gpu_attention", "gpu_compile", "gpu_offload", "gpu_muon", "gpu_strategy",
             "gpu_ep_chunks", "gpu_preflight"):
    load_benchmark(name)
load_benchmark("gpu_shapes").main(["--gpu-memory", "80"])
muon = load_benchmark("gpu_muon")
print(len(muon.expert_shard_shapes(muon.REPO / "configs" / "1t.yaml")))
"""
    done = subprocess.run([sys.executable, "-c", script], env=clean_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "recipe, 16 blocks" in done.stdout and done.stdout.splitlines()[-1] == "165"


def test_recipe_offload_timing_events_follow_every_copy_on_a_stand_in_copy_stream(gpu_recipe, monkeypatch):
    """The CUDA path of ``TimedOffload`` on CPU: a stand-in side stream and host-clock events in place of CUDA's.
    Every copy (2 boundaries out, 2 back in, for 3 blocks) records its end on the copy stream, and every wait of the
    compute stream on one records where the compute stream reached it, in that order: one pair per copy."""
    import torch
    from moe_lightning.model import MoEConfig, MoETransformer
    host_event = load_benchmark("gpu_device").HostEvent
    recorded = []

    class Event(host_event):
        def record(self, stream=None):
            super().record(stream)
            recorded.append("copy end" if stream is not None else "compute reached")

    class Stream:
        def wait_stream(self, other):
            pass

        def wait_event(self, event):
            recorded.append("compute waits")

        def record_event(self):
            return object()
    monkeypatch.setattr(torch.cuda, "Event", lambda enable_timing=False: Event())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    offload = gpu_recipe.TimedOffload(prefetch=1, min_offload_bytes=0)
    monkeypatch.setattr(offload, "_side_stream", lambda device: Stream())
    offload.timing = True
    config = MoEConfig(vocab_size=64, dim=32, n_layers=3, n_heads=4, n_kv_heads=2, max_seq_len=32, ffn_hidden=64,
                       n_dense_layers=1, num_experts=4, top_k=2, expert_hidden=32)
    torch.manual_seed(0)
    model = MoETransformer(config)
    offload.apply(model.layers)
    logits_BSV = model(torch.randint(0, 64, (2, 16)))
    logits_BSV.float().pow(2).mean().backward()
    offload.remove()
    assert offload.tensors_offloaded == 2 and offload.tensors_copied_in == 2
    assert len(offload.waits) == 4 and recorded.count("copy end") == 4
    assert recorded.count("compute reached") == 4 and all(  # each wait timed just before the compute stream waits
        recorded[i + 1] == "compute waits" for i, what in enumerate(recorded) if what == "compute reached")
    stall_ms, stalled = offload.exposed_ms()
    assert stalled == 0 and stall_ms == 0.0  # each copy ended (host clock) before the compute stream reached it
