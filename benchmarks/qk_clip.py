"""QK-clip at work: a small Muon run at a high learning rate, without and with ``QKClip``, same seed and data.

    python benchmarks/qk_clip.py                      # 100 steps each, threshold 5, table + PNG
    python benchmarks/qk_clip.py --steps 40 --every 5 # a quick look

Each step's largest pre-softmax logit (over layers and heads, measured in that step's forward, i.e. before the
step's clip) and the training loss are printed for both runs. Without the callback the logits climb; with it they
stay near the threshold: each forward sees the weights clipped on the previous batch plus one Muon update, on a
new batch, so it may read a little above. The plot goes to benchmarks/qk_clip.png when matplotlib is installed.
"""

import argparse
from functools import partial
from pathlib import Path

import lightning as L
import torch

from moe_lightning import MoEConfig, MoELanguageModel, TextDataModule
from moe_lightning.training.callbacks import QKClip
from moe_lightning.training.callbacks.qk_clip import attention_modules
from moe_lightning.optim import Muon

REPO = Path(__file__).resolve().parent.parent
CONFIG = dict(vocab_size=320, dim=128, n_layers=2, n_heads=4, n_kv_heads=4, max_seq_len=128, ffn_hidden=256,
              n_dense_layers=1, num_experts=4, top_k=2, expert_hidden=128, init_std=0.02)


class Series(L.Callback):
    """Per step: the largest recorded logit and the loss. Reads QKClip's combined maxima when given one, else
    switches the model's recording on itself and reads (and resets) it."""

    def __init__(self, qk_clip: QKClip | None = None):
        self.qk_clip, self.max_logits, self.losses = qk_clip, [], []

    def on_fit_start(self, trainer, pl_module):
        if self.qk_clip is None:
            for attention in attention_modules(pl_module):
                attention.record_max_logits = True

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.qk_clip is not None:
            max_logit = self.qk_clip.last_max_logits.max()
        else:
            attentions = attention_modules(pl_module)
            max_logit = torch.stack([a.max_logits for a in attentions]).max()
            for attention in attentions:
                attention.max_logits = None
        self.max_logits.append(float(max_logit))
        self.losses.append(float(outputs["loss"]))


def run(args, clip: bool) -> Series:
    L.seed_everything(0, verbose=False)
    qk_clip = QKClip(threshold=args.threshold) if clip else None
    series = Series(qk_clip)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=args.steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        num_sanity_val_steps=0, callbacks=[qk_clip, series] if clip else [series])
    model = MoELanguageModel(MoEConfig(**CONFIG), optimizer=partial(Muon, lr=args.lr, adjust_lr_fn="original",
                                                                    weight_decay=0.0, adamw_lr=args.adamw_lr))
    trainer.fit(model, TextDataModule(source="stdlib", seq_len=CONFIG["max_seq_len"], batch_size=args.batch_size,
                                      max_tokens=1_000_000))
    return series


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--lr", type=float, default=0.05, help="Muon's learning rate (high on purpose)")
    parser.add_argument("--adamw-lr", type=float, default=0.003)
    parser.add_argument("--threshold", type=float, default=5.0)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--every", type=int, default=10, help="print every this many steps")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "qk_clip.png")
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    plain, clipped = run(args, clip=False), run(args, clip=True)
    print(f"Muon lr {args.lr}, QKClip threshold {args.threshold}: max pre-softmax logit (over layers and heads) "
          f"and training loss per step")
    print(f"{'step':>6s} {'max logit, no clip':>20s} {'max logit, QKClip':>18s} {'loss, no clip':>14s} "
          f"{'loss, QKClip':>13s}")
    for step in range(0, args.steps, args.every):
        print(f"{step + 1:6d} {plain.max_logits[step]:20.2f} {clipped.max_logits[step]:18.2f} "
              f"{plain.losses[step]:14.4f} {clipped.losses[step]:13.4f}")
    last = slice(-args.every, None)
    print(f"last {args.every} steps: max logit {max(plain.max_logits[last]):.2f} without, "
          f"{max(clipped.max_logits[last]):.2f} with QKClip; mean loss {sum(plain.losses[last]) / args.every:.4f} "
          f"without, {sum(clipped.losses[last]) / args.every:.4f} with")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100, layout="constrained")
    steps = range(1, args.steps + 1)
    ax.plot(steps, plain.max_logits, label="Muon")
    ax.plot(steps, clipped.max_logits, label=f"Muon + QKClip(threshold={args.threshold:g})")
    ax.axhline(args.threshold, color="grey", linestyle=":", linewidth=1)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("largest pre-softmax logit (layers, heads)")
    ax.set_title(f"Attention max logits under Muon at lr {args.lr}")
    ax.legend()
    fig.savefig(args.out)
    print(f"plot: {args.out}")


if __name__ == "__main__":
    main()
