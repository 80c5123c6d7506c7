"""The training recipe on one H200, sized to fill it, measured: tokens/s, MFU, memory, host syncs, phases, offload stall.

    python benchmarks/gpu_recipe.py              # one CUDA device, 4 steps (~6.3B parameters, 1.5B active)
    python benchmarks/gpu_recipe.py --describe   # the model's parameters (planner/flops.py) and shape, no GPU
    python benchmarks/gpu_recipe.py --dry-run    # the same code on CPU at toy size, 4 steps (a test runs it)

The model is ``gpu_shapes.RECIPE`` (MLA, 32 routed experts top-4 + 2 shared, one multi-token prediction module,
document masking over 8,192-token sequences of ~2,048-token documents), trained with ``MoEFSDPStrategy`` (meta
init, no ``cpu_offload``), bf16-mixed, Muon (Newton–Schulz on the GPU) + QK-clip, ``ActivationOffload``
(prefetch 1), clipping, chunked loss; built in Python (no jsonargparse). Routing is as trained: the router picks
freely (no forced balance), so expert load is whatever it is. Step 0 compiles; step 1 runs under the profiler
(``with_stack``) and counts every blocking CUDA call (``SYNC_CALLS``) with the frame that made it; step 2 runs
unprofiled and is the measured one: wall time, forward / backward / optimizer time from CUDA events at Lightning's
hooks, the offload copies' exposed time (for each copy, how long the compute stream waited on its event: the
stall, not the overlap), and the caching allocator's reserved-minus-allocated bytes per stream pool at the
largest of three snapshots (end of forward, end of backward, end of step). The probe and the summary print at
the end of step 2, before step 3 can time out. MFU is the package's count (``planner/flops.py``: 6 x active
matmul parameters + attention over the pairs the document mask keeps, from the batch; recomputation not
counted) over 989 TFLOP/s, and over the bf16 GEMM rate measured here first.
"""

import argparse
import json
import math
import sys
import time
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

import moe_lightning  # noqa: E402
from gpu_shapes import BATCH_SIZE, DOC_LEN, DRY_BATCH_SIZE, DRY_DOC_LEN, DRY_SEQ_LEN, SEQ_LEN, recipe_config  # noqa: E402
from moe_lightning import MoEConfig, MoELanguageModel  # noqa: E402
from moe_lightning.optim import Muon  # noqa: E402
from moe_lightning.planner.flops import attended_pairs_BS, attention_flops_per_pair, dense_flops_per_token  # noqa: E402
from moe_lightning.planner.flops import parameter_counts  # noqa: E402
from moe_lightning.training.callbacks import ActivationOffload, QKClip  # noqa: E402
from moe_lightning.training.strategy import MoEFSDPStrategy  # noqa: E402

PEAK_FLOPS = 989e12  # H200 dense bf16, datasheet
MFU_TARGET = 0.20  # of PEAK_FLOPS, with real routing (a published MoE run fell from 32.4 % to 14.7 % with it)
STEPS, PROFILED, MEASURED = 4, 1, 2
GIB = float(1 << 30)
SYNC_CALLS = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize", "cudaMemcpy", "cudaMemcpy2D")


def describe(config: MoEConfig, seq_len: int, batch_size: int, doc_len: int) -> str:
    counts = parameter_counts(config)
    return (f"recipe model: {counts['total'] / 1e9:.3g}B parameters, {counts['active'] / 1e9:.3g}B active "
            f"(planner/flops.py), MLA, {config.num_experts} experts top-{config.top_k} + {config.n_shared_experts} "
            f"shared, {config.n_layers} blocks + {config.mtp_layers} MTP; sequence {seq_len} x batch {batch_size}, "
            f"documents ~{doc_len} tokens")


def packed_tokens(n: int, seq_len: int, vocab: int, eod: int, doc_len: int) -> torch.Tensor:
    """Random tokens with an end-of-document token every ``doc_len`` positions (shifted by a few per row)."""
    tokens = torch.randint(0, min(vocab, eod), (n, seq_len + 1))
    for row in range(n):
        tokens[row, doc_len - 1 - row % 7::doc_len] = eod
    return tokens


def gemm_ceiling(device: torch.device, n: int = 8192, runs: int = 20) -> float:
    """FLOP/s of a square bf16 matmul on this GPU (the attainable ceiling MFU is also reported against)."""
    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(runs):
        a @ b
    end.record()
    end.synchronize()
    return 2 * n ** 3 * runs / (start.elapsed_time(end) / 1e3)


def _frame_of_interest(stack: list[str]) -> str:
    """The innermost frame (``"path(line): name"``, innermost first) in this package, else Lightning, else any."""
    for package in (moe_lightning, L):
        root = str(Path(package.__file__).resolve().parent)
        for frame in stack:
            if frame.startswith(root):
                return Path(frame.split("(")[0]).name + frame[len(frame.split("(")[0]):]
    return stack[0] if stack else "unknown"


def sync_sites(events) -> list[str]:
    """One entry per blocking CUDA runtime call among profiler ``events``, named by the nearest enclosing op that
    has a Python stack (``with_stack=True``)."""
    sites = []
    for event in events:
        if event.name in SYNC_CALLS:
            owner = event
            while owner is not None and not owner.stack:
                owner = owner.cpu_parent
            sites.append(_frame_of_interest(owner.stack if owner is not None else []))
    return sites


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
    """Per-step rows; host syncs of the profiled step; phases, offload stall and pools of the measured step, whose
    summary prints at once."""

    def __init__(self, config: MoEConfig, offload: TimedOffload, gemm_flops: float | None, describe_line: str):
        self.config, self.offload, self.gemm_flops, self.describe_line = config, offload, gemm_flops, describe_line
        self.dense, self.per_pair = dense_flops_per_token(config), attention_flops_per_pair(config)
        self.rows, self.sync_sites, self.summary = [], [], None
        self._profiler, self._marks, self._snapshots, self._start = None, {}, [], 0.0

    def _cuda(self, pl_module) -> bool:
        return pl_module.device.type == "cuda"

    def _mark(self, pl_module, name: str) -> None:
        if self._cuda(pl_module):
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._marks[name] = event
        else:
            self._marks[name] = time.perf_counter()

    def _snapshot(self, pl_module, where: str, batch_idx: int) -> None:
        if batch_idx == MEASURED and self._cuda(pl_module):
            self._snapshots.append((torch.cuda.memory_allocated(), where, torch.cuda.memory_snapshot()))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self._cuda(pl_module):
            torch.cuda.synchronize()
        self.offload.timing, self.offload.waits = batch_idx == MEASURED, []
        self._start = time.perf_counter()
        self._mark(pl_module, "start")
        if batch_idx == PROFILED and self._cuda(pl_module):
            activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            self._profiler = torch.profiler.profile(activities=activities, with_stack=True)
            self._profiler.__enter__()

    def on_before_backward(self, trainer, pl_module, loss):
        self._mark(pl_module, "forward")
        self._snapshot(pl_module, "end of forward", trainer.global_step)

    def on_after_backward(self, trainer, pl_module):
        self._mark(pl_module, "backward")
        self._snapshot(pl_module, "end of backward", trainer.global_step)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._mark(pl_module, "optimizer")
        self._snapshot(pl_module, "end of step", batch_idx)
        if self._profiler is not None:
            self._profiler.__exit__(None, None, None)
            self.sync_sites = sync_sites(self._profiler.events())
            self._profiler = None
        if self._cuda(pl_module):
            torch.cuda.synchronize()
        seconds = time.perf_counter() - self._start
        loss = float(outputs["loss"])
        if not math.isfinite(loss):
            raise RuntimeError(f"gpu_recipe: non-finite loss {loss} at step {batch_idx}")
        inputs_BS = batch[:, :-1]
        eod = self.config.eod_token_id if self.config.document_masking else None
        flops = inputs_BS.numel() * self.dense + self.per_pair * int(attended_pairs_BS(inputs_BS, eod).sum())
        row = {"step": batch_idx, "loss": round(loss, 4), "step_s": round(seconds, 3),
               "tokens_per_s": round(inputs_BS.numel() / seconds, 1), "achieved_tflops": round(flops / seconds / 1e12, 2),
               "mfu": round(flops / seconds / PEAK_FLOPS, 4), "profiled": batch_idx == PROFILED}
        if self._cuda(pl_module):
            row["max_allocated_gib"] = round(torch.cuda.max_memory_allocated() / GIB, 2)
        self.rows.append(row)
        print(json.dumps(row), flush=True)
        if batch_idx == MEASURED:
            self.summary = self._summarize(pl_module, row, flops / seconds)
            print(json.dumps({"summary": self.summary}), flush=True)
            print(summary_table(self.summary), flush=True)
            print(figure_line(self.summary), flush=True)

    def _summarize(self, pl_module, row: dict, achieved: float) -> dict:
        marks = self._marks
        elapsed = (lambda a, b: marks[a].elapsed_time(marks[b])) if self._cuda(pl_module) else (
            lambda a, b: 1e3 * (marks[b] - marks[a]))
        summary = {"device": torch.cuda.get_device_name() if self._cuda(pl_module) else "cpu",
                   "model": self.describe_line, "routing": "as trained (no forced balance)",
                   "step": row["step"], "step_s": row["step_s"], "tokens_per_s": row["tokens_per_s"],
                   "achieved_tflops": row["achieved_tflops"], "achieved_flops": round(achieved), "mfu_vs_989": row["mfu"],
                   "gemm_ceiling_tflops": round(self.gemm_flops / 1e12, 1) if self.gemm_flops else None,
                   "mfu_vs_gemm_ceiling": round(achieved / self.gemm_flops, 4) if self.gemm_flops else None,
                   "phases_ms": {"forward": round(elapsed("start", "forward"), 1),
                                 "backward": round(elapsed("forward", "backward"), 1),
                                 "optimizer (clip + Muon + QK-clip)": round(elapsed("backward", "optimizer"), 1)},
                   "host_syncs_per_step": len(self.sync_sites) if self._cuda(pl_module) else None,
                   "host_sync_sites": {s: self.sync_sites.count(s) for s in sorted(set(self.sync_sites))},
                   "offload": {"boundaries_out": self.offload.tensors_offloaded,
                               "bytes_out": self.offload.bytes_offloaded,
                               "copies_in": self.offload.tensors_copied_in},
                   "losses": [r["loss"] for r in self.rows]}
        if self._cuda(pl_module):
            stall_ms, stalled = self.offload.exposed_ms()
            summary["offload"].update(exposed_stall_ms=round(stall_ms, 2), waits=len(self.offload.waits),
                                      waits_that_stalled=stalled)
            summary.update(max_allocated_gib=round(torch.cuda.max_memory_allocated() / GIB, 2),
                           max_reserved_gib=round(torch.cuda.max_memory_reserved() / GIB, 2),
                           alloc_retries=torch.cuda.memory_stats().get("num_alloc_retries", 0))
            names = {torch.cuda.current_stream().cuda_stream: "compute"}
            names.update({s.cuda_stream: "offload copies" for s in self.offload._side_streams.values()})
            _, where, snapshot = max(self._snapshots, key=lambda s: s[0])
            summary["pools_at_peak"] = {"where": where, **stream_pools(snapshot, names)}
        return summary


def summary_table(summary: dict) -> str:
    def fmt(value, spec):
        return "n/a" if value is None else format(value, spec)
    offload = summary["offload"]
    rows = [("device", summary["device"]), ("model", summary["model"]), ("routing", summary["routing"]),
            ("step time (unprofiled step 2)", f"{summary['step_s']} s"),
            ("tokens/s", fmt(summary["tokens_per_s"], ",.0f")),
            ("MFU vs 989 TFLOP/s", fmt(summary["mfu_vs_989"], ".1%")),
            ("MFU vs measured bf16 GEMM", f"{fmt(summary['mfu_vs_gemm_ceiling'], '.1%')} (GEMM "
                                          f"{fmt(summary['gemm_ceiling_tflops'], '.0f')} TFLOP/s)"),
            ("forward / backward / optimizer", " / ".join(f"{v} ms" for v in summary["phases_ms"].values())),
            ("peak allocated / reserved", f"{fmt(summary.get('max_allocated_gib'), '.1f')} / "
                                          f"{fmt(summary.get('max_reserved_gib'), '.1f')} GiB"),
            ("host syncs per step (profiled step 1)", fmt(summary["host_syncs_per_step"], "d")),
            ("offload: boundaries out, exposed stall", f"{offload['boundaries_out']} "
                                                       f"({offload['bytes_out'] / GIB:.2f} GiB), "
                                                       f"{fmt(offload.get('exposed_stall_ms'), '.2f')} ms")]
    for name, pool in summary.get("pools_at_peak", {}).items():
        if name != "where":
            rows.append((f"pool '{name}' at peak ({summary['pools_at_peak']['where']})",
                         f"reserved {pool['reserved_gib']} GiB, cached unused {pool['cached_unused_gib']} GiB"))
    return "\n".join(["| measurement | value |", "| --- | --- |"] + [f"| {a} | {b} |" for a, b in rows])


def figure_line(summary: dict) -> str:
    mfu = summary["mfu_vs_989"]
    vs_gemm = summary["mfu_vs_gemm_ceiling"]
    key = f"{summary['tokens_per_s']:,.0f} tokens/s, MFU {mfu:.1%}" + (f" ({vs_gemm:.1%} of measured GEMM)" if vs_gemm else "")
    return f"figure: recipe | {key} | MFU >= {MFU_TARGET:.0%} of 989 TFLOP/s | {'PASS' if mfu >= MFU_TARGET else 'FAIL'}"


def main(argv: list[str] | None = None) -> dict | None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="CPU, toy size, 4 steps: checks the script end to end")
    parser.add_argument("--describe", action="store_true", help="print the model's parameters and shape, and exit")
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.dry_run
    config = recipe_config(dry_run=args.dry_run)
    seq_len, batch_size, doc_len = (DRY_SEQ_LEN, DRY_BATCH_SIZE, DRY_DOC_LEN) if args.dry_run else (
        SEQ_LEN, BATCH_SIZE, DOC_LEN)
    line = describe(config, seq_len, batch_size, doc_len)
    if args.describe:
        print(line)
        return None
    if not cuda and not args.dry_run:
        parser.error("no CUDA device: run with --dry-run on CPU")
    print(line, flush=True)
    gemm = gemm_ceiling(torch.device("cuda")) if cuda else None
    if gemm:
        print(json.dumps({"gemm_ceiling_tflops": round(gemm / 1e12, 1)}), flush=True)
    offload = TimedOffload(prefetch=1, min_offload_bytes=1 << 20 if cuda else 0)
    probe = Probe(config, offload, gemm, line)
    strategy = MoEFSDPStrategy(meta_init=True, cpu_offload=False)
    trainer = L.Trainer(accelerator="cuda" if cuda else "cpu", devices=1, strategy=strategy,
                        precision="bf16-mixed" if cuda else "32-true", max_steps=STEPS, gradient_clip_val=1.0,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
                        callbacks=[offload, QKClip(threshold=100.0), probe])
    optimizer = partial(Muon, lr=0.02, adjust_lr_fn="original", adamw_lr=3e-3, momentum=0.95,
                        ns_device="cuda" if cuda else None)
    module = MoELanguageModel(config, optimizer=optimizer, loss_chunk_size=4096 if cuda else 32)
    torch.manual_seed(0)
    tokens = packed_tokens(STEPS * batch_size, seq_len, config.vocab_size, config.eod_token_id, doc_len)
    trainer.fit(module, DataLoader(tokens, batch_size=batch_size))
    return probe.summary


if __name__ == "__main__":
    main()
