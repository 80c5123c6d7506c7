"""The training recipe on one GPU, sized by its memory, measured: tokens/s, MFU, memory, host syncs, phases, offload.

    python benchmarks/gpu_recipe.py                      # one CUDA device, 6 steps, the largest recipe that fits
    python benchmarks/gpu_recipe.py --describe [--gpu-memory GIB]   # the shape it picks and its planned peak, no GPU
    python benchmarks/gpu_recipe.py --dry-run            # the same code on CPU at toy size, 6 steps (a test runs it)

The model is ``gpu_shapes.RECIPE`` with as many blocks as the card holds (``gpu_shapes.pick_recipe``: the largest
in ``RECIPE_BLOCKS`` whose peak, planned by ``moe_lightning.planner.plan``, leaves 8 % of the free memory; 20 blocks,
6.33B parameters / 1.49B active on an H200, 16 blocks on an H100 80 GB): MLA, 32 routed experts top-4 + 2 shared,
one multi-token prediction module, document masking over 8,192-token sequences of ~2,048-token documents, trained
with ``MoEFSDPStrategy`` (meta init, no ``cpu_offload``), bf16-mixed, Muon (Newton–Schulz on the GPU) + QK-clip,
``ActivationOffload`` (prefetch 1), clipping, chunked loss; built in Python (no jsonargparse). Routing is as
trained (no forced balance).

Steps: 0 compiles (warm-up); 1, 2 and 3 are timed: nothing but the training step between the synchronisations
that bound each (no profiler, no snapshot, the loss read afterwards); the figure (their median tokens/s and MFU
with the spread, min-max) is printed after step 3, before the slow diagnostics, with forward / backward /
optimizer times from CUDA events at Lightning's hooks, the offload copies' exposed time (for each copy, how long
the compute stream waited on its event) and the allocator retries during the timed steps (each one a ``cudaFree``
of the cache and a device-wide sync). 4 takes three allocator snapshots (end of forward, end of backward, end of
step) for the per-stream pools; 5 runs under the profiler (``with_stack``) and counts every blocking CUDA call
(``gpu_trace.SYNC_CALLS``, ``cudaFree`` included) with the frame that made it, leaving out this script's own two
synchronisations bounding the step (counted apart); each printed at once. After step 5: the planned peak beside
the measured peaks of the whole run and the free memory, on one line, and the figure again, now with the syncs
per step (gpu_all.sh keeps the last figure line: a time-out in the profiled step keeps the first). MFU is the package's count
(``planner/flops.py``: 6 x active matmul parameters + attention over the pairs the document mask keeps, from the
batch; recomputation not counted) over 989 TFLOP/s, and over the bf16 GEMM rate measured here first.
"""

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from gpu_device import Device, gemm_ceiling  # noqa: E402
from gpu_shapes import DOC_LEN, DRY_BATCH_SIZE, DRY_DOC_LEN, DRY_SEQ_LEN, LOSS_CHUNK, card_memory_gib  # noqa: E402
from gpu_shapes import packed_tokens, pick_recipe, recipe_config  # noqa: E402
from gpu_trace import OWN, load_trace, sync_sites  # noqa: E402
from moe_lightning import MoEConfig, MoELanguageModel  # noqa: E402
from moe_lightning.optim import Muon  # noqa: E402
from moe_lightning.planner.flops import attended_pairs_BS, attention_flops_per_pair, dense_flops_per_token  # noqa: E402
from moe_lightning.training.callbacks import ActivationOffload, QKClip  # noqa: E402
from moe_lightning.training.strategy import MoEFSDPStrategy  # noqa: E402

PEAK_FLOPS = 989e12  # H100 SXM and H200 dense bf16, datasheet
MFU_TARGET = 0.20  # of PEAK_FLOPS, with real routing (a published MoE run fell from 32.4 % to 14.7 % with it)
TIMED, SNAPSHOT, PROFILED = (1, 2, 3), 4, 5  # step 0 is the warm-up (compiles); the figure before the diagnostics
STEPS = PROFILED + 1
GIB = float(1 << 30)


def stream_pools(snapshot: list[dict], names: dict[int, str]) -> dict[str, dict]:
    """Reserved, allocated and reserved-minus-allocated GiB per stream pool, from ``torch.cuda.memory_snapshot()``."""
    pools: dict[str, dict] = {}
    for segment in snapshot:
        name = names.get(segment["stream"], f"stream {segment['stream']}")
        pool = pools.setdefault(name, {"reserved_gib": 0.0, "allocated_gib": 0.0})
        pool["reserved_gib"] += segment["total_size"] / GIB
        pool["allocated_gib"] += segment["allocated_size"] / GIB
    return {name: {k: round(v, 3) for k, v in pool.items()} | {
        "cached_unused_gib": round(pool["reserved_gib"] - pool["allocated_gib"], 3)} for name, pool in pools.items()}


def spread(values: list[float]) -> dict:
    """Median and range of a timed quantity."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


class TimedOffload(ActivationOffload):
    """ActivationOffload whose copies also record timing events: for each wait of the compute stream on a copy, the
    time from the compute stream reaching the wait to the copy's end (positive: the compute stream stalled)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.timing = False
        self.waits: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._ends: dict[int, torch.cuda.Event] = {}

    def _copy(self, boundary, source, destination):
        super()._copy(boundary, source, destination)
        side = self._side_stream(boundary.device)
        if self.timing and side is not None:
            end = torch.cuda.Event(enable_timing=True)
            end.record(side)
            self._ends[id(boundary)] = end

    def _release_source(self, boundary):
        end = self._ends.pop(id(boundary), None)
        if self.timing and end is not None and boundary.copy_done is not None:
            reached = torch.cuda.Event(enable_timing=True)
            reached.record()
            self.waits.append((reached, end))
        super()._release_source(boundary)

    def exposed_ms(self) -> tuple[float, int]:
        """Total stall (ms) over the recorded waits, and how many waits stalled; call after a synchronize."""
        stalls = [max(0.0, reached.elapsed_time(end)) for reached, end in self.waits]
        return sum(stalls), sum(s > 0 for s in stalls)


class Probe(L.Callback):
    """The profiled step's host syncs, the snapshot step's pools and the timed steps' figure, each printed as soon
    as it is known. ``device``: the CUDA calls (``gpu_device.Device``), a stand-in in tests."""

    def __init__(self, config: MoEConfig, offload: TimedOffload, device: Device, gemm_flops: float | None,
                 describe_line: str, trace_dir: Path, planned_peak_gib: float | None = None):
        self.config, self.offload, self.device, self.gemm_flops = config, offload, device, gemm_flops
        self.describe_line, self.trace_dir, self.planned_peak_gib = describe_line, trace_dir, planned_peak_gib
        self.dense, self.per_pair = dense_flops_per_token(config), attention_flops_per_pair(config)
        self.rows, self.timed, self.sync_sites, self.pools, self.summary = [], [], None, None, None
        self._profiler, self._marks, self._snapshots, self._start, self._retries = None, {}, [], 0.0, 0
        self._stall_ms, self._stalled_waits, self._waits, self.own_syncs = [], 0, 0, None

    def _mark(self, name: str) -> None:
        event = self.device.event()
        event.record()
        self._marks[name] = event

    def _snapshot(self, where: str, step: int) -> None:
        if step == SNAPSHOT:
            self._snapshots.append((self.device.memory_allocated(), where, self.device.memory_snapshot()))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == TIMED[0]:  # read before the window opens (a previous step's frees are in it: an upper bound)
            self._retries = self.device.memory_stats().get("num_alloc_retries", 0)
        self.offload.timing, self.offload.waits = batch_idx in TIMED, []
        self._marks = {}
        if batch_idx == PROFILED:
            activities = [torch.profiler.ProfilerActivity.CPU] + (
                [torch.profiler.ProfilerActivity.CUDA] if self.device.cuda else [])
            self._profiler = torch.profiler.profile(activities=activities, with_stack=True)
            self._profiler.__enter__()
        self.device.synchronize()  # the window opens: from here to the synchronisation at the batch's end
        self._start = time.perf_counter()
        self._mark("start")

    def on_before_backward(self, trainer, pl_module, loss):
        self._mark("forward")
        self._snapshot("end of forward", trainer.global_step)

    def on_after_backward(self, trainer, pl_module):
        self._mark("backward")
        self._snapshot("end of backward", trainer.global_step)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._mark("optimizer")
        self.device.synchronize()
        seconds = time.perf_counter() - self._start  # the timed window ends here: what follows is bookkeeping
        if self._profiler is not None:
            self._profiler.__exit__(None, None, None)
            trace = self.trace_dir / "profiled_step.json"  # hundreds of MB at full size: read once, then deleted
            self._profiler.export_chrome_trace(str(trace))
            every = sync_sites(load_trace(trace))
            trace.unlink()
            self._profiler, self.sync_sites = None, [site for site in every if not site.startswith(OWN)]
            self.own_syncs = len(every) - len(self.sync_sites)  # this probe's window bounds: not the step's
            print(json.dumps({"host_syncs_profiled_step": len(self.sync_sites),
                              "sites": {s: self.sync_sites.count(s) for s in sorted(set(self.sync_sites))},
                              "benchmarks_own_syncs_left_out": self.own_syncs}), flush=True)
        self._snapshot("end of step", batch_idx)
        if batch_idx == SNAPSHOT and any(snapshot for _, _, snapshot in self._snapshots):
            names = {self.device.compute_stream_id(): "compute"}
            names.update({s.cuda_stream: "offload copies" for s in self.offload._side_streams.values()})
            _, where, snapshot = max(self._snapshots, key=lambda s: s[0])
            self.pools = {"where": where, **stream_pools(snapshot, names)}
            print(json.dumps({"pools_at_peak": self.pools}), flush=True)
        loss = float(outputs["loss"])
        if not math.isfinite(loss):
            raise RuntimeError(f"gpu_recipe: non-finite loss {loss} at step {batch_idx}")
        inputs_BS = batch[:, :-1]
        eod = self.config.eod_token_id if self.config.document_masking else None
        flops = inputs_BS.numel() * self.dense + self.per_pair * int(attended_pairs_BS(inputs_BS, eod).sum())
        marks = self._marks
        row = {"step": batch_idx, "loss": round(loss, 4), "step_s": round(seconds, 4),
               "tokens_per_s": round(inputs_BS.numel() / seconds, 1), "flops": flops,
               "mfu": round(flops / seconds / PEAK_FLOPS, 4), "role": "timed" if batch_idx in TIMED else {
                   0: "warm-up", PROFILED: "profiled", SNAPSHOT: "snapshots"}.get(batch_idx, "extra"),
               "phases_ms": {"forward": round(marks["start"].elapsed_time(marks["forward"]), 2),
                             "backward": round(marks["forward"].elapsed_time(marks["backward"]), 2),
                             "optimizer": round(marks["backward"].elapsed_time(marks["optimizer"]), 2)}}
        if batch_idx in TIMED and self.device.cuda:
            stall_ms, stalled = self.offload.exposed_ms()
            self._stall_ms.append(stall_ms)
            self._stalled_waits += stalled
            self._waits += len(self.offload.waits)
        self.rows.append(row)
        print(json.dumps(row), flush=True)
        if batch_idx == TIMED[-1]:  # the figure first: the snapshots and the profiled step may run out of time
            self.summary = self._summarize()
            print(figure_line(self.summary), flush=True)
        if batch_idx == PROFILED:
            self.summary.update(self._memory(), host_syncs_per_step=len(self.sync_sites),
                                host_sync_sites={s: self.sync_sites.count(s) for s in sorted(set(self.sync_sites))},
                                benchmarks_own_syncs_left_out=self.own_syncs, pools_at_peak=self.pools,
                                losses=[row["loss"] for row in self.rows])
            print(memory_line(self.summary), flush=True)
            print(json.dumps({"summary": self.summary}), flush=True)
            print(summary_table(self.summary), flush=True)
            print(figure_line(self.summary), flush=True)

    def _memory(self) -> dict:
        """Planned peak beside the measured peaks of the whole run (never reset) and the free memory now."""
        stats, free_total = self.device.memory_stats(), self.device.mem_get_info()
        return {"planned_peak_gib": self.planned_peak_gib,
                "max_allocated_gib": round(stats["allocated_bytes.all.peak"] / GIB, 2) if stats else None,
                "max_reserved_gib": round(stats["reserved_bytes.all.peak"] / GIB, 2) if stats else None,
                "free_gib": round(free_total[0] / GIB, 2) if free_total else None,
                "total_gib": round(free_total[1] / GIB, 2) if free_total else None}

    def _summarize(self) -> dict:
        timed = [row for row in self.rows if row["role"] == "timed"]
        tokens_per_s = spread([row["tokens_per_s"] for row in timed])
        achieved = spread([row["flops"] / row["step_s"] for row in timed])
        stats = self.device.memory_stats()
        summary = {"device": self.device.name(), "model": self.describe_line,
                   "routing": "as trained (no forced balance)",
                   "timed_steps": [row["step"] for row in timed],
                   "step_s": spread([row["step_s"] for row in timed]),
                   "tokens_per_s": tokens_per_s,
                   "achieved_tflops": {k: round(v / 1e12, 2) for k, v in achieved.items()},
                   "mfu_vs_989": {k: round(v / PEAK_FLOPS, 4) for k, v in achieved.items()},
                   "gemm_ceiling_tflops": round(self.gemm_flops / 1e12, 1) if self.gemm_flops else None,
                   "mfu_vs_gemm_ceiling": round(achieved["median"] / self.gemm_flops, 4) if self.gemm_flops else None,
                   "phases_ms": {phase: round(statistics.median(row["phases_ms"][phase] for row in timed), 1)
                                 for phase in ("forward", "backward", "optimizer")},
                   "host_syncs_per_step": len(self.sync_sites) if self.sync_sites is not None else None,
                   "host_sync_sites": {s: self.sync_sites.count(s) for s in sorted(set(self.sync_sites or []))},
                   "alloc_retries_timed_steps": stats.get("num_alloc_retries", 0) - self._retries if stats else None,
                   "offload": {"boundaries_out": self.offload.tensors_offloaded,
                               "bytes_out": self.offload.bytes_offloaded,
                               "copies_in": self.offload.tensors_copied_in},
                   "losses": [row["loss"] for row in self.rows], "pools_at_peak": self.pools}
        if self._stall_ms:
            summary["offload"].update(exposed_stall_ms=round(statistics.median(self._stall_ms), 2),
                                      waits=self._waits, waits_that_stalled=self._stalled_waits)
        return summary


def summary_table(summary: dict) -> str:
    def fmt(value, spec):
        return "n/a" if value is None else format(value, spec)
    offload, tps, mfu = summary["offload"], summary["tokens_per_s"], summary["mfu_vs_989"]
    rows = [("device", summary["device"]), ("model", summary["model"]), ("routing", summary["routing"]),
            (f"step time, median of steps {summary['timed_steps']}", f"{summary['step_s']['median']:.3f} s "
             f"({summary['step_s']['min']:.3f}-{summary['step_s']['max']:.3f})"),
            ("tokens/s (min-max)", f"{tps['median']:,.0f} ({tps['min']:,.0f}-{tps['max']:,.0f})"),
            ("MFU vs 989 TFLOP/s (min-max)", f"{mfu['median']:.1%} ({mfu['min']:.1%}-{mfu['max']:.1%})"),
            ("MFU vs measured bf16 GEMM", f"{fmt(summary['mfu_vs_gemm_ceiling'], '.1%')} (GEMM "
                                          f"{fmt(summary['gemm_ceiling_tflops'], '.0f')} TFLOP/s)"),
            ("forward / backward / optimizer", " / ".join(f"{v} ms" for v in summary["phases_ms"].values())),
            ("planned peak; measured peak allocated / reserved (whole run)",
             f"{fmt(summary.get('planned_peak_gib'), '.1f')}; {fmt(summary.get('max_allocated_gib'), '.1f')} / "
             f"{fmt(summary.get('max_reserved_gib'), '.1f')} GiB"),
            (f"host syncs per step (profiled step {PROFILED}, the benchmark's own left out)",
             fmt(summary["host_syncs_per_step"], "d")),
            ("allocator retries (timed steps)", fmt(summary["alloc_retries_timed_steps"], "d")),
            ("offload: boundaries out, exposed stall per step", f"{offload['boundaries_out']} "
                                                                f"({offload['bytes_out'] / GIB:.2f} GiB), "
                                                                f"{fmt(offload.get('exposed_stall_ms'), '.2f')} ms")]
    pools = summary.get("pools_at_peak") or {}
    for name, pool in pools.items():
        if name != "where":
            rows.append((f"pool '{name}' at peak ({pools['where']}, step {SNAPSHOT})",
                         f"reserved {pool['reserved_gib']} GiB, cached unused {pool['cached_unused_gib']} GiB"))
    return "\n".join(["| measurement | value |", "| --- | --- |"] + [f"| {a} | {b} |" for a, b in rows])


def memory_line(summary: dict) -> str:
    def gib(key):
        return "n/a" if summary.get(key) is None else f"{summary[key]:.2f} GiB"
    return (f"memory: planned peak {gib('planned_peak_gib')}; measured over the whole run max_memory_allocated "
            f"{gib('max_allocated_gib')}, max_memory_reserved {gib('max_reserved_gib')}; mem_get_info free "
            f"{gib('free_gib')} of {gib('total_gib')}")


def figure_line(summary: dict) -> str:
    tps, mfu, vs_gemm = summary["tokens_per_s"], summary["mfu_vs_989"], summary["mfu_vs_gemm_ceiling"]
    syncs, retries = summary["host_syncs_per_step"], summary["alloc_retries_timed_steps"]
    key = (f"{tps['median']:,.0f} tokens/s ({tps['min']:,.0f}-{tps['max']:,.0f}), MFU {mfu['median']:.1%}"
           + (f" ({vs_gemm:.1%} of measured GEMM)" if vs_gemm else "")
           + f", {len(summary['timed_steps'])} timed steps, "
           + (f"syncs/step not yet profiled (step {PROFILED})" if syncs is None else f"{syncs} syncs/step")
           + (f", {retries} allocator retries" if retries is not None else ""))
    return (f"figure: recipe | {key} | MFU >= {MFU_TARGET:.0%} of 989 TFLOP/s | "
            f"{'PASS' if mfu['median'] >= MFU_TARGET else 'FAIL'}")


def main(argv: list[str] | None = None, device: Device | None = None) -> dict | None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="CPU, toy size, 6 steps: checks the script end to end")
    parser.add_argument("--describe", action="store_true", help="print the shape it picks and its planned peak")
    parser.add_argument("--gpu-memory", type=float, default=None, help="GiB to size the recipe by (default: the "
                        "card's free memory, else 80)")
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.dry_run
    if not cuda and not args.dry_run and not args.describe:
        parser.error("no CUDA device: run with --dry-run on CPU")
    if args.dry_run:
        config, seq_len, batch_size, doc_len = recipe_config(dry_run=True), DRY_SEQ_LEN, DRY_BATCH_SIZE, DRY_DOC_LEN
        planned_peak_gib = None
        line = f"recipe model (dry run): toy size, {config.n_layers} blocks, sequence {seq_len} x batch {batch_size}"
    else:
        try:
            memory, source = card_memory_gib(args.gpu_memory)
            shape = pick_recipe(memory)
        except ValueError as error:
            parser.exit(2, f"gpu_recipe: {error}\n")
        config, seq_len, batch_size, doc_len = shape.config, shape.seq_len, shape.batch_size, DOC_LEN
        planned_peak_gib = shape.peak_gib
        line = f"{shape.describe(memory)} ({source}); MLA, documents ~{doc_len} tokens"
    print(line, flush=True)
    if args.describe:
        return None
    device = device or Device(torch.device("cuda" if cuda else "cpu"))
    gemm = gemm_ceiling(device) if cuda else gemm_ceiling(device, n=256, runs=3)
    print(json.dumps({"gemm_ceiling_tflops": round(gemm / 1e12, 3)}), flush=True)
    offload = TimedOffload(prefetch=1, min_offload_bytes=1 << 20 if cuda else 0)
    optimizer = partial(Muon, lr=0.02, adjust_lr_fn="original", adamw_lr=3e-3, momentum=0.95,
                        ns_device="cuda" if cuda else None)
    module = MoELanguageModel(config, optimizer=optimizer, loss_chunk_size=LOSS_CHUNK if cuda else 32)
    torch.manual_seed(0)
    tokens = packed_tokens(STEPS * batch_size, seq_len, config.vocab_size, config.eod_token_id, doc_len)
    with tempfile.TemporaryDirectory(prefix="gpu_recipe_") as trace_dir:
        probe = Probe(config, offload, device, gemm if cuda else None, line, Path(trace_dir), planned_peak_gib)
        trainer = L.Trainer(accelerator="cuda" if cuda else "cpu", devices=1,
                            strategy=MoEFSDPStrategy(meta_init=True, cpu_offload=False),
                            precision="bf16-mixed" if cuda else "32-true", max_steps=STEPS, gradient_clip_val=1.0,
                            logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
                            callbacks=[offload, QKClip(threshold=100.0), probe])
        trainer.fit(module, DataLoader(tokens, batch_size=batch_size))
    return probe.summary


if __name__ == "__main__":
    main()
