"""The flagship path on one CUDA device, in under 90 s: configs/1t-mini.yaml's model and every optimization.

    python benchmarks/gpu_smoke.py              # one GPU: meta init, CPU offload, activation offload, chunked
                                                # loss, document masking, Muon (Newton-Schulz on the GPU), clipping
    python benchmarks/gpu_smoke.py --dry-run    # the same code on CPU, 2 steps (a test runs it)

Reads the model, strategy, ActivationOffload, Muon, loss chunk, clipping and sequence length from the YAML
(expert parallelism needs two ranks, so one device runs ``expert_parallel_size=1``), trains on random tokens
with an end-of-document token every few hundred positions, asserts every loss is finite, and prints one
JSON line per step as it ends, then a summary: step time, peak allocated/reserved memory, and every host
sync that one steady-state step performs, counted from the profiler's CUDA runtime events (the blocking calls
of ``SYNC_CALLS``: also event waits and synchronous copies, which ``set_sync_debug_mode`` misses), each named by
the frame of this package or Lightning on the Python stack of the op that made it. No jsonargparse needed.
"""

import argparse
import json
import math
import sys
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
from moe_lightning.callbacks import ActivationOffload  # noqa: E402
from moe_lightning.optim import Muon  # noqa: E402
from moe_lightning.strategy import MoEFSDPStrategy  # noqa: E402

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


class SmokeProbe(L.Callback):
    """Step times, the finite-loss check, and where step ``probe_step`` syncs with the host (CUDA only)."""

    def __init__(self, probe_step: int):
        self.probe_step, self.rows, self.sync_sites = probe_step, [], []
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
            self._profiler = None
        self._sync(pl_module)
        loss = float(outputs["loss"])
        row = {"step": batch_idx, "loss": round(loss, 4), "step_s": round(time.perf_counter() - self._start, 3)}
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
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.dry_run
    if not cuda and not args.dry_run:
        parser.error("no CUDA device: run with --dry-run on CPU")
    steps = 2 if args.dry_run else args.steps
    with open(args.config) as f:
        config = yaml.safe_load(f)
    model_args = config["model"]["init_args"]
    seq_len = args.seq_len or config["data"]["init_args"]["seq_len"]
    model_config = MoEConfig(**{**model_args["config"], "max_seq_len": max(seq_len, model_args["config"]["max_seq_len"])})
    strategy_args = {**config["trainer"]["strategy"]["init_args"], "expert_parallel_size": 1}
    offload_args = callback_args(config, "ActivationOffload")
    muon_args = {**model_args["optimizer"]["init_args"], "ns_device": "cuda" if cuda else None}
    probe = SmokeProbe(probe_step=steps - 1)
    trainer = L.Trainer(accelerator="cuda" if cuda else "cpu", devices=1, strategy=MoEFSDPStrategy(**strategy_args),
                        precision="bf16-mixed" if cuda else "32-true", max_steps=steps,
                        gradient_clip_val=config["trainer"]["gradient_clip_val"], logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, num_sanity_val_steps=0,
                        callbacks=[ActivationOffload(**offload_args), probe])
    module = MoELanguageModel(model_config, optimizer=partial(Muon, **muon_args),
                              loss_chunk_size=model_args["loss_chunk_size"])
    batch_size = config["data"]["init_args"]["batch_size"]
    torch.manual_seed(0)
    tokens = packed_tokens(steps * batch_size, seq_len, model_config.vocab_size, model_config.eod_token_id,
                           doc_len=max(seq_len // 4, 8))
    start = time.perf_counter()
    trainer.fit(module, DataLoader(tokens, batch_size=batch_size))
    steady = [row["step_s"] for row in probe.rows[1:]] or [probe.rows[0]["step_s"]]
    summary = {"device": torch.cuda.get_device_name() if cuda else "cpu", "precision": str(trainer.precision),
               "seq_len": seq_len, "batch_size": batch_size, "steps": len(probe.rows),
               "wall_s": round(time.perf_counter() - start, 1), "median_step_s": sorted(steady)[len(steady) // 2],
               "losses": [row["loss"] for row in probe.rows]}
    if cuda:
        summary.update(max_allocated_gib=round(torch.cuda.max_memory_allocated() / GIB, 3),
                       max_reserved_gib=round(torch.cuda.max_memory_reserved() / GIB, 3),
                       host_syncs_in_probe_step=len(probe.sync_sites),
                       host_sync_sites={site: probe.sync_sites.count(site) for site in sorted(set(probe.sync_sites))})
    print(json.dumps({"summary": summary}), flush=True)
    return summary


if __name__ == "__main__":
    main()
