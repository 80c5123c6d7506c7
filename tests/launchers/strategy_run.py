"""One tiny training run for the strategy tests and the CPU benchmark (launched as real processes).

Rank 0 writes JSON: the world-mean loss of every micro-batch, collective and barrier counts per micro-batch,
and how often gradient clipping read a tensor back to the host.
``--strategy single`` is the one-process reference (Lightning's default single-device strategy).
"""

import json
import os
import signal
import time
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import torch
from lightning.pytorch.callbacks import Callback

from moe_lightning import MoEConfig, MoELanguageModel, TextDataModule
from moe_lightning.checkpoint.sharded import ShardedCheckpointer
from moe_lightning.optim import WarmupCosineLR
from tests.support.collectives import CollectiveCounter
from tests.support.fit_launcher import cpu_trainer, fit_arguments, fsdp_or_single, parse

TINY = dict(vocab_size=320, dim=64, n_layers=3, n_heads=4, n_kv_heads=2, max_seq_len=32, ffn_hidden=128,
            n_dense_layers=1, num_experts=4, top_k=2, expert_hidden=64, n_shared_experts=1)


class Record(Callback):
    """World-mean loss, collective/barrier calls, bytes and wall time of every micro-batch; gradient norms per step."""

    def __init__(self, counter: CollectiveCounter, replicas: int, out: Path):
        self.counter, self.replicas, self.out, self.rows = counter, replicas, out, []
        self.grad_norms, self.clipped_norms = [], []
        self.barriers, self.clip_host_reads = 0, 0
        self.last_end = None  # end of the previous batch: the gap to the next start holds checkpoint saves

    @contextmanager
    def counting_barriers(self):
        barrier = torch.distributed.barrier

        def counted(*args, **kwargs):
            self.barriers += 1
            return barrier(*args, **kwargs)
        torch.distributed.barrier = counted
        try:
            yield
        finally:
            torch.distributed.barrier = barrier

    def counting_host_reads(self, clip):
        """``clip`` wrapped to count ``Tensor.item``/``tolist``/``cpu`` calls while it runs."""
        def counted_clip(*args, **kwargs):
            originals = {name: getattr(torch.Tensor, name) for name in ("item", "tolist", "cpu")}

            def wrap(fn):
                def counted(*a, **k):
                    self.clip_host_reads += 1
                    return fn(*a, **k)
                return counted
            for name, fn in originals.items():
                setattr(torch.Tensor, name, wrap(fn))
            try:
                return clip(*args, **kwargs)
            finally:
                for name, fn in originals.items():
                    setattr(torch.Tensor, name, fn)
        return counted_clip

    @staticmethod
    def _sum(tensor: torch.Tensor) -> torch.Tensor:
        """All-reduce without Lightning's barrier, so that the barrier count is the training step's own."""
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(tensor)
        return tensor

    def _norms(self, trainer, pl_module) -> dict[str, float]:
        """Global L2 norms of expert and other gradients (each rank's shard, summed, replicas counted once)."""
        squares = torch.zeros(2)
        for name, param in pl_module.named_parameters():
            grad = param.grad.to_local() if hasattr(param.grad, "to_local") else param.grad
            squares[int(".experts." in name)] += grad.float().pow(2).sum()
        squares = self._sum(squares) / self.replicas
        return {"other": squares[0].sqrt().item(), "experts": squares[1].sqrt().item()}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.grad_norms.append(self._norms(trainer, pl_module))  # before gradient clipping

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.before, self.barriers_before, self.start = self.counter.snapshot(), self.barriers, time.perf_counter()
        self.gap = None if self.last_end is None else self.start - self.last_end

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        calls, nbytes = self.counter.snapshot()
        barriers = self.barriers - self.barriers_before
        if (batch_idx + 1) % trainer.accumulate_grad_batches == 0:  # gradients stay until the next zero_grad
            self.clipped_norms.append(self._norms(trainer, pl_module))
        seconds = time.perf_counter() - self.start
        loss = self._sum(outputs["loss"].detach().float().clone()) / trainer.world_size
        self.rows.append({"step": trainer.global_step, "batch": batch_idx, "loss": loss.item(), "seconds": seconds,
                          "barriers": barriers, "gap_before_s": self.gap,
                          "calls": {k: v - self.before[0].get(k, 0) for k, v in calls.items()},
                          "bytes": {k: v - self.before[1].get(k, 0) for k, v in nbytes.items()}})
        if trainer.is_global_zero:  # after every batch: a killed run still reports what it did
            self.out.write_text(json.dumps({"batches": self.rows, "grad_norms": self.grad_norms,
                                            "clipped_norms": self.clipped_norms,
                                            "clip_host_reads": self.clip_host_reads,
                                            "barriers_total": self.barriers}))
        self.last_end = time.perf_counter()


class KillWhileWriting(ShardedCheckpointer):
    """Every rank dies by SIGKILL once it has written its shards of save number ``kill_at_save``: before DCP's
    finish step and the commit; with asynchronous saves, in the background thread while training goes on."""

    def __init__(self, kill_at_save: int):
        super().__init__()
        self.kill_at_save, self.saves = kill_at_save, 0

    def storage_writer(self, partial):
        writer = super().storage_writer(partial)
        self.saves += 1
        if self.saves == self.kill_at_save:
            write = writer.write_data

            def write_then_die(plan, planner):
                write(plan, planner).wait()
                os.kill(os.getpid(), signal.SIGKILL)
            writer.write_data = write_then_die
        return writer


def main() -> None:
    parser = fit_arguments(max_steps=4, checkpoints=True)
    parser.add_argument("--strategy", choices=["single", "fsdp"], default="fsdp")
    parser.add_argument("--replicate", type=int, default=1)
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--every", type=int, default=2)
    parser.add_argument("--no-save-last", action="store_true", help="ModelCheckpoint(save_last=False)")
    parser.add_argument("--kill-at-save", type=int, default=0)
    parser.add_argument("--prefetch", type=int, default=1)
    parser.add_argument("--offload", action="store_true", help="cpu_offload=True")
    parser.add_argument("--keep-gathered", action="store_true", help="reshard_after_forward=False")
    parser.add_argument("--async-op", action="store_true", help="unshard_async_op=True")
    parser.add_argument("--meta-init", action="store_true", help="meta_init=True")
    parser.add_argument("--async-checkpoint", action="store_true", help="async_checkpoint=True")
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--clip", type=float, default=None, help="gradient_clip_val")
    parser.add_argument("--config", default="{}", help="JSON overrides of the tiny MoEConfig")
    parser.add_argument("--loss-chunk", type=int, default=None, help="MoELanguageModel(loss_chunk_size=...)")
    args = parse(parser)

    strategy = fsdp_or_single(args.strategy == "single", replicate_size=args.replicate, expert_parallel_size=args.ep,
                              prefetch_depth=args.prefetch, cpu_offload=args.offload,
                              reshard_after_forward=not args.keep_gathered, unshard_async_op=args.async_op,
                              meta_init=args.meta_init, async_checkpoint=args.async_checkpoint)
    if args.strategy == "fsdp" and args.kill_at_save:
        strategy.checkpointer = KillWhileWriting(args.kill_at_save)
    counter = CollectiveCounter()
    record = Record(counter, args.replicate, Path(args.out))
    if args.strategy == "fsdp":
        strategy.clip_grad_by_norm = record.counting_host_reads(strategy.clip_grad_by_norm)
    trainer = cpu_trainer(strategy, [record], args.max_steps, args.ckpt_dir, every=args.every,
                          save_last=not args.no_save_last, accumulate_grad_batches=args.accumulate,
                          gradient_clip_val=args.clip)
    model = MoELanguageModel(MoEConfig(**{**TINY, **json.loads(args.config)}),
                             optimizer=partial(torch.optim.AdamW, lr=1e-2, betas=(0.9, 0.95)),
                             lr_scheduler=partial(WarmupCosineLR, warmup_steps=2), loss_chunk_size=args.loss_chunk)
    data = TextDataModule(source=os.__file__, seq_len=args.seq_len, batch_size=args.batch_size, val_fraction=0.05)
    with counter.installed(), record.counting_barriers():
        trainer.fit(model, data, ckpt_path=args.resume)


if __name__ == "__main__":
    main()
