"""The 1T recipe on one CUDA device: configs/1t-mini.yaml's MLA model with every optimization, timed.

    python benchmarks/gpu_smoke.py              # one GPU: meta init, FSDP CPU offload, activation offload (MTP
                                                # blocks too), chunked loss, document masking, Muon (Newton-Schulz
                                                # on the GPU), QK-clip, one multi-token prediction layer, clipping
    python benchmarks/gpu_smoke.py --dry-run    # the same code on CPU, 2 steps (a test runs it)

Reads the model, strategy, ActivationOffload, QKClip, Muon, loss chunk, clipping and sequence length from the
YAML (expert parallelism needs two ranks, so one device runs ``expert_parallel_size=1``; ``--mtp-layers``
overrides the config's 0), trains on random tokens with an end-of-document token every ``--doc-len``
positions, asserts every loss is finite, and prints one JSON line per step as it ends, then a summary and a
Markdown table: tokens/s, MFU (``moe_lightning.planner.flops``: attention over the pairs the document mask keeps, counted
from the batches), peak allocated/reserved memory, every host sync that one steady-state step performs (the
profiler's blocking CUDA runtime calls, ``SYNC_CALLS``: also event waits and synchronous copies, which
``set_sync_debug_mode`` misses), each named by the frame of this package or Lightning that made it, and the
device timeline of that step's activation-offload copies against compute kernels: the fraction of copy time
that overlaps compute, measured. No jsonargparse needed.
"""

import argparse
import json
import math
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import lightning as L
import torch
import yaml
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import moe_lightning  # noqa: E402
from moe_lightning import MoEConfig, MoELanguageModel  # noqa: E402
from moe_lightning.training.callbacks import ActivationOffload, QKClip  # noqa: E402
from moe_lightning.planner.flops import attended_pairs_BS, attention_flops_per_pair, dense_flops_per_token  # noqa: E402
from moe_lightning.planner.flops import peak_bf16_flops  # noqa: E402
from moe_lightning.optim import Muon  # noqa: E402
from moe_lightning.training.strategy import MoEFSDPStrategy  # noqa: E402

CONFIG = Path(__file__).resolve().parent.parent / "configs" / "1t-mini.yaml"
GIB = float(1 << 30)


def callback_args(config: dict, name: str) -> dict:
    for entry in config["trainer"].get("callbacks", []):
        if entry["class_path"].endswith(name):
            return entry.get("init_args", {})
    raise ValueError(f"{CONFIG}: no {name} among trainer.callbacks")


def packed_tokens(n: int, seq_len: int, vocab: int, eod: int, doc_len: int) -> torch.Tensor:
    """Random byte tokens with an end-of-document token every ``doc_len`` positions (varied by one per row)."""
    tokens = torch.randint(0, min(vocab, eod), (n, seq_len + 1))
    for row in range(n):
        tokens[row, doc_len + row % 7::doc_len] = eod
    return tokens


SYNC_CALLS = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize", "cudaMemcpy", "cudaMemcpy2D")


def _frame_of_interest(stack: list[str]) -> str:
    """The innermost frame (``"path(line): name"``, innermost first, as the profiler records them) in this
    package, else Lightning, else the innermost one: where a sync came from."""
    for package in (moe_lightning, L):
        root = str(Path(package.__file__).resolve().parent)
        for frame in stack:
            if frame.startswith(root):
                return Path(frame.split("(")[0]).name + frame[len(frame.split("(")[0]):]
    return stack[0] if stack else "unknown"


def sync_sites(events) -> list[str]:
    """One entry per blocking CUDA runtime call among profiler ``events`` (``cudaMemcpy`` without ``Async``
    included), named by the nearest enclosing op that has a Python stack (``with_stack=True``)."""
    sites = []
    for event in events:
        if event.name in SYNC_CALLS:
            owner = event
            while owner is not None and not owner.stack:
                owner = owner.cpu_parent
            sites.append(_frame_of_interest(owner.stack if owner is not None else []))
    return sites


def merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Union of ``(start, end)`` intervals, as disjoint sorted intervals."""
    out: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def overlap_fraction(copies: list[tuple[float, float]], compute: list[tuple[float, float]]) -> float | None:
    """Fraction of the copies' total time during which some compute kernel ran (None without copies)."""
    total = sum(end - start for start, end in copies)
    if not total:
        return None
    busy = merged(compute)
    covered = sum(max(0.0, min(end, b) - max(start, a)) for start, end in copies for a, b in busy)
    return covered / total


def offload_timeline(trace: dict, copy_bytes: int) -> dict:
    """From a profiler Chrome trace: the device copies of ``copy_bytes`` (ActivationOffload's boundary size), each
    ``(direction, start_ms, duration_ms)`` from the first kernel, and the fraction of their time that overlaps
    kernels on other streams (compute). Kineto names the categories ``kernel``/``gpu_memcpy`` (older: ``Kernel``/
    ``Memcpy``) and gives each copy's ``stream`` and ``bytes`` in its args."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    kernels = [e for e in events if str(e.get("cat")).lower() == "kernel"]
    copies = [e for e in events if e.get("cat") in ("gpu_memcpy", "Memcpy") and (e.get("args") or {}).get("bytes") == copy_bytes
              and ("DtoH" in e.get("name", "") or "HtoD" in e.get("name", ""))]
    if not copies:
        return {"copies": 0, "overlap_fraction": None, "timeline": []}
    origin = min(e["ts"] for e in kernels + copies)
    copy_streams = {(e.get("args") or {}).get("stream") for e in copies}
    compute = [(e["ts"], e["ts"] + e["dur"]) for e in kernels if (e.get("args") or {}).get("stream") not in copy_streams]
    spans = [(e["ts"], e["ts"] + e["dur"]) for e in copies]
    return {"copies": len(copies), "copy_ms": round(sum(e["dur"] for e in copies) / 1e3, 3),
            "overlap_fraction": overlap_fraction(spans, compute),
            "timeline": [("out" if "DtoH" in e["name"] else "in", round((e["ts"] - origin) / 1e3, 3),
                          round(e["dur"] / 1e3, 3)) for e in sorted(copies, key=lambda e: e["ts"])]}


def summary_table(summary: dict) -> str:
    """The figures as a Markdown table for the README (each row: what, value)."""
    def fmt(value, spec):
        return "n/a" if value is None else format(value, spec)
    rows = [("device", summary["device"]),
            ("model", f"configs/1t-mini.yaml shape, MLA, {summary['mtp_layers']} MTP layer(s), Muon + QK-clip, "
                      f"documents of ~{summary['doc_len']} tokens, seq {summary['seq_len']} x batch {summary['batch_size']}"),
            ("step time (median)", f"{summary['median_step_s']} s"),
            ("tokens/s per GPU", fmt(summary.get("tokens_per_s"), ",.0f")),
            ("MFU (document-masked attention FLOPs)", fmt(summary.get("mfu"), ".2%")),
            ("peak memory allocated / reserved", f"{fmt(summary.get('max_allocated_gib'), '.2f')} / "
                                                 f"{fmt(summary.get('max_reserved_gib'), '.2f')} GiB"),
            ("host syncs per step", fmt(summary.get("host_syncs_in_probe_step"), "d")),
            ("offload copies overlapped with compute", fmt(summary.get("offload_overlap_fraction"), ".1%"))]
    return "\n".join(["| measurement | value |", "| --- | --- |"] + [f"| {a} | {b} |" for a, b in rows])


class SmokeProbe(L.Callback):
    """Step times, tokens/s and MFU, the finite-loss check, and where step ``probe_step`` syncs with the host and
    how its offload copies overlap compute (CUDA only)."""

    def __init__(self, probe_step: int, config: MoEConfig, peak_flops: float | None, offload: ActivationOffload):
        self.probe_step, self.rows, self.sync_sites, self.timeline = probe_step, [], [], {}
        self.peak_flops, self.offload = peak_flops, offload
        self.eod = config.eod_token_id if config.document_masking else None
        self.dense, self.per_pair = dense_flops_per_token(config), attention_flops_per_pair(config)
        self._start, self._profiler = None, None

    def _sync(self, pl_module):
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._sync(pl_module)
        self._start = time.perf_counter()
        if batch_idx == self.probe_step and pl_module.device.type == "cuda":
            activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            self._profiler = torch.profiler.profile(activities=activities, with_stack=True)
            self._profiler.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self._profiler is not None:
            self._profiler.__exit__(None, None, None)
            self.sync_sites = sync_sites(self._profiler.events())
            with tempfile.NamedTemporaryFile(suffix=".json") as f:
                self._profiler.export_chrome_trace(f.name)
                trace = json.load(open(f.name))
            per_copy = self.offload.bytes_offloaded // max(self.offload.tensors_offloaded, 1)
            self.timeline = offload_timeline(trace, per_copy)
            self._profiler = None
        self._sync(pl_module)
        seconds = time.perf_counter() - self._start
        loss = float(outputs["loss"])
        inputs = batch[:, :-1]
        flops = inputs.numel() * self.dense + self.per_pair * int(attended_pairs_BS(inputs, self.eod).sum())
        row = {"step": batch_idx, "loss": round(loss, 4), "step_s": round(seconds, 3),
               "tokens_per_s": round(inputs.numel() / seconds, 1),
               "mfu": round(flops / seconds / self.peak_flops, 5) if self.peak_flops else None}
        if pl_module.device.type == "cuda":
            row["max_allocated_gib"] = round(torch.cuda.max_memory_allocated() / GIB, 3)
        print(json.dumps(row), flush=True)
        self.rows.append(row)
        if not math.isfinite(loss):
            raise RuntimeError(f"gpu_smoke: non-finite loss {loss} at step {batch_idx}")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="CPU, 2 steps: checks the script end to end")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--seq-len", type=int, default=None, help="default: the config's data.seq_len")
    parser.add_argument("--config", default=str(CONFIG))
    parser.add_argument("--mtp-layers", type=int, default=1, help="multi-token prediction layers (config: 0)")
    parser.add_argument("--doc-len", type=int, default=None, help="tokens per document (default: seq_len / 4)")
    parser.add_argument("--peak-flops", type=float, default=None, help="FLOP/s of the device for the MFU "
                        "(default: the bf16 peak table by device name)")
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.dry_run
    if not cuda and not args.dry_run:
        parser.error("no CUDA device: run with --dry-run on CPU")
    steps = 2 if args.dry_run else args.steps
    with open(args.config) as f:
        config = yaml.safe_load(f)
    model_args = config["model"]["init_args"]
    seq_len = args.seq_len or config["data"]["init_args"]["seq_len"]
    model_config = MoEConfig(**{**model_args["config"], "mtp_layers": args.mtp_layers,
                                "max_seq_len": max(seq_len, model_args["config"]["max_seq_len"])})
    doc_len = args.doc_len or max(seq_len // 4, 8)
    strategy_args = {**config["trainer"]["strategy"]["init_args"], "expert_parallel_size": 1}
    offload = ActivationOffload(**callback_args(config, "ActivationOffload"))
    muon_args = {**model_args["optimizer"]["init_args"], "ns_device": "cuda" if cuda else None}
    peak = args.peak_flops or (peak_bf16_flops(torch.cuda.get_device_name()) if cuda else None)
    probe = SmokeProbe(steps - 1, model_config, peak, offload)
    trainer = L.Trainer(accelerator="cuda" if cuda else "cpu", devices=1, strategy=MoEFSDPStrategy(**strategy_args),
                        precision="bf16-mixed" if cuda else "32-true", max_steps=steps,
                        gradient_clip_val=config["trainer"]["gradient_clip_val"], logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, num_sanity_val_steps=0,
                        callbacks=[offload, QKClip(**callback_args(config, "QKClip")), probe])
    module = MoELanguageModel(model_config, optimizer=partial(Muon, **muon_args),
                              loss_chunk_size=model_args["loss_chunk_size"])
    batch_size = config["data"]["init_args"]["batch_size"]
    torch.manual_seed(0)
    tokens = packed_tokens(steps * batch_size, seq_len, model_config.vocab_size, model_config.eod_token_id,
                           doc_len=doc_len)
    start = time.perf_counter()
    trainer.fit(module, DataLoader(tokens, batch_size=batch_size))
    steady = probe.rows[1:] or probe.rows[:1]  # the first step compiles
    median = sorted(steady, key=lambda row: row["step_s"])[len(steady) // 2]
    summary = {"device": torch.cuda.get_device_name() if cuda else "cpu", "precision": str(trainer.precision),
               "seq_len": seq_len, "batch_size": batch_size, "doc_len": doc_len, "mtp_layers": args.mtp_layers,
               "steps": len(probe.rows), "wall_s": round(time.perf_counter() - start, 1),
               "median_step_s": median["step_s"], "tokens_per_s": median["tokens_per_s"], "mfu": median["mfu"],
               "losses": [row["loss"] for row in probe.rows]}
    if cuda:
        summary.update(max_allocated_gib=round(torch.cuda.max_memory_allocated() / GIB, 3),
                       max_reserved_gib=round(torch.cuda.max_memory_reserved() / GIB, 3),
                       host_syncs_in_probe_step=len(probe.sync_sites),
                       host_sync_sites={site: probe.sync_sites.count(site) for site in sorted(set(probe.sync_sites))},
                       offload_overlap_fraction=probe.timeline.get("overlap_fraction"),
                       offload_timeline=probe.timeline)
    print(json.dumps({"summary": summary}), flush=True)
    print(summary_table(summary), flush=True)
    return summary


if __name__ == "__main__":
    main()
