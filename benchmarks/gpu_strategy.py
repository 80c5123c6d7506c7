"""MoEFSDPStrategy on the GPUs of one machine: tokens/s, MFU and allocator behaviour per variant.

    python benchmarks/gpu_strategy.py             # every variant in a fresh process, each in its own time box
    python benchmarks/gpu_strategy.py --dry-run   # CPU, tiny shapes, the default variant in this process

Each variant trains the same model (bf16 parameters, fp32 reduction and master weights, AdamW) on
random tokens for ``--warmup`` + ``--steps`` optimizer steps (2 + 3; built on the meta device, so nothing is
initialised on the host) and prints one JSON line as soon as it ends:
tokens/s per device, MFU (``moe_lightning.planner.flops.training_flops_per_token`` over the bf16 peak of the GPU, or
``--peak-flops``), ``max_memory_allocated``/``max_memory_reserved`` in GiB and the allocator's
``num_alloc_retries``. A variant that fails or runs out of time prints a JSON line saying so and the
others still run; the exit status is non-zero if any failed.

At world size 1 FSDP2 does no all-gather at all (``unshard`` returns early), so ``unshard_async_op`` and
``prefetch_depth`` cannot change anything on one GPU: there only the default variant runs, and the
output says why. With two or more GPUs every variant of ``unshard_async_op`` x ``prefetch_depth`` runs.
"""

import time

STARTED = time.monotonic()  # before the imports: gpu_all.sh's time box counts them, CUDA's start and the plan too

import argparse  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import Callback  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from gpu_shapes import STRATEGY_CONFIG, card_memory_gib, check_fits, fixed_shape  # noqa: E402
from moe_lightning import MoEConfig, MoELanguageModel  # noqa: E402
from moe_lightning.planner.flops import peak_bf16_flops  # noqa: E402
from moe_lightning.planner.flops import training_flops_per_token  # noqa: E402
from moe_lightning.training.strategy import MoEFSDPStrategy  # noqa: E402

GPU = dict(config=STRATEGY_CONFIG, seq_len=4096, batch_size=2)
DRY = dict(config=MoEConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=16,
                            ffn_hidden=64, n_dense_layers=1, num_experts=4, top_k=2, expert_hidden=32),
           seq_len=16, batch_size=2)
VARIANTS = [{"unshard_async_op": a, "prefetch_depth": p} for a, p in itertools.product([False, True], [1, 2])]
GIB = float(1 << 30)


class StepTimer(Callback):
    """Wall time of each optimizer step after ``warmup``, from batch start to batch end, both synchronised (so it
    measures finished work and leaves out the fit's set-up and teardown)."""

    def __init__(self, warmup: int):
        self.warmup, self.start, self.step_s = warmup, None, []

    def _sync(self, pl_module):
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx >= self.warmup:
            self._sync(pl_module)
            if batch_idx == self.warmup and pl_module.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(pl_module.device)
            self.start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx >= self.warmup:
            self._sync(pl_module)
            self.step_s.append(time.perf_counter() - self.start)


def run_variant(variant: dict, shapes: dict, warmup: int, steps: int, peak_flops: float | None,
                devices: int = 1) -> dict | None:
    """Train one variant; returns its result on global rank 0 (``None`` on the other ranks)."""
    config, seq_len, batch_size = shapes["config"], shapes["seq_len"], shapes["batch_size"]
    cuda = torch.cuda.is_available()
    torch.manual_seed(0)
    tokens = torch.randint(0, config.vocab_size, ((warmup + steps) * batch_size * devices, seq_len + 1))
    timer = StepTimer(warmup)
    strategy = MoEFSDPStrategy(meta_init=True, **variant)  # no host initialisation of the whole model
    trainer = L.Trainer(accelerator="cuda" if cuda else "cpu", devices=devices, strategy=strategy,
                        max_steps=warmup + steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        num_sanity_val_steps=0, callbacks=[timer])
    trainer.fit(MoELanguageModel(config), DataLoader(tokens, batch_size=batch_size))
    if not trainer.is_global_zero:
        return None
    step_s = statistics.median(timer.step_s)
    tokens_per_s = batch_size * seq_len / step_s  # per device, at the median step
    peak = peak_flops or (peak_bf16_flops(torch.cuda.get_device_name()) if cuda else None)
    result = {**variant, "devices": devices, "tokens_per_s": round(tokens_per_s, 1), "timed_steps": len(timer.step_s),
              "step_s": round(step_s, 4), "step_s_min": round(min(timer.step_s), 4),
              "step_s_max": round(max(timer.step_s), 4),
              "mfu": round(tokens_per_s * training_flops_per_token(config, seq_len) / peak, 4) if peak else None}
    if cuda:
        stats = torch.cuda.memory_stats()
        result.update(max_allocated_gib=round(torch.cuda.max_memory_allocated() / GIB, 2),
                      max_reserved_gib=round(torch.cuda.max_memory_reserved() / GIB, 2),
                      alloc_retries=stats.get("num_alloc_retries", 0))
    return result


_children: list[subprocess.Popen] = []  # the variant running now, stopped with us (see stop_children_on_sigterm)


def stop_children_on_sigterm() -> None:
    """A child runs in its own session (so a timeout can kill Lightning's per-GPU processes with it), which also
    keeps it out of reach of the signal that ends this process: ``timeout`` in gpu_all.sh sends SIGTERM to us
    only. Kill the child's whole group then, so nothing keeps training on the GPU after our time box."""
    def stop(signum, frame):
        for child in _children:
            if child.poll() is None:
                os.killpg(child.pid, signal.SIGKILL)
        raise SystemExit(128 + signum)
    signal.signal(signal.SIGTERM, stop)


def default_budget() -> float:
    """Seconds from this process's start (``STARTED``) to the end of the last variant: the time box gpu_all.sh gives
    this part ($GPU_ALL_BOX_S), less 5 s to report."""
    return float(os.environ.get("GPU_ALL_BOX_S", 95)) - 5


def run_child(index: int, args, timeout: float) -> dict:
    """One variant in a fresh process (clean allocator and peak statistics); never raises."""
    cmd = [sys.executable, __file__, "--variant", str(index), "--devices", str(args.devices), "--warmup",
           str(args.warmup), "--steps", str(args.steps)] + (["--peak-flops", str(args.peak_flops)] if args.peak_flops else [])
    child = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    _children[:] = [child]
    try:
        stdout, stderr = child.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)  # the whole group: Lightning's launcher starts one process per GPU
        child.communicate()
        return {**VARIANTS[index], "status": "timeout", "timeout_s": round(timeout)}
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    if child.returncode != 0 or not lines:
        return {**VARIANTS[index], "status": "failed", "exit": child.returncode, "stderr_tail": stderr[-1500:]}
    return {**json.loads(lines[-1]), "status": "ok"}


def figure_line(results: list[dict]) -> str:
    """The part's figure: the first variant's tokens/s and MFU (one GPU runs the default variant only)."""
    ok = [r for r in results if r.get("tokens_per_s")]
    if not ok:
        return "figure: strategy | no variant finished | MFU >= 20% | FAIL"
    r = ok[0]
    mfu = f", MFU {r['mfu']:.1%}" if r.get("mfu") is not None else ""
    steps = (f" (median of {r['timed_steps']} steps, {r['step_s_min']:.3f}-{r['step_s_max']:.3f} s)"
             if "step_s_min" in r else "")
    return (f"figure: strategy | {r['tokens_per_s']:,.0f} tokens/s{steps}{mfu}, {r.get('alloc_retries', 0)} allocator retries "
            f"| MFU >= 20% | {'PASS' if (r.get('mfu') or 0) >= 0.2 else 'FAIL'}")


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, the default variant in this process")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--devices", type=int, default=None, help="GPUs to use (default: all visible)")
    parser.add_argument("--budget", type=float, default=default_budget(),
                        help="seconds from this process's start to the last variant's end (default: gpu_all.sh's "
                        "time box less 5 s)")
    parser.add_argument("--peak-flops", type=float, default=None, help="override the GPU's bf16 peak FLOP/s")
    parser.add_argument("--variant", type=int, default=None, help=argparse.SUPPRESS)  # child process mode
    args = parser.parse_args(argv)
    if args.dry_run:  # one process, as on one GPU: the default variant (the others change nothing at world size 1)
        results = [run_variant(VARIANTS[0], DRY, 1, 1, args.peak_flops)]
        for result in results:
            print(json.dumps(result), flush=True)
        print(figure_line(results), flush=True)
        return results
    if args.variant is not None:
        result = run_variant(VARIANTS[args.variant], GPU, args.warmup, args.steps, args.peak_flops, args.devices)
        if result is not None:
            print(json.dumps(result), flush=True)
        return [result]
    if not torch.cuda.is_available():
        parser.error("no CUDA device: run with --dry-run on CPU")
    memory, source = card_memory_gib()
    check_fits(fixed_shape("strategy"), memory, source)
    stop_children_on_sigterm()
    args.devices = args.devices or torch.cuda.device_count()
    indices = list(range(len(VARIANTS)))
    if args.devices == 1:
        print(json.dumps({"note": "1 GPU: FSDP2 does no all-gather at world size 1, so unshard_async_op and "
                                  "prefetch_depth change nothing here; running the default variant only. "
                                  "Measure them with >= 2 GPUs."}), flush=True)
        indices = [0]
    deadline = STARTED + args.budget  # the imports, CUDA's start and the fit check came out of the same box
    results = []
    for position, i in enumerate(indices):
        share = (deadline - time.monotonic()) / (len(indices) - position)  # what is left, split evenly
        results.append(run_child(i, args, max(share, 1.0)))
        print(json.dumps(results[-1]), flush=True)
    print(figure_line(results), flush=True)
    if any(r["status"] != "ok" for r in results):
        raise SystemExit(1)
    return results


if __name__ == "__main__":
    main()
