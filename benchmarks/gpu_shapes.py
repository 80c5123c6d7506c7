"""The shapes the GPU parts run, sized by the card they find (no Lightning, no CUDA needed to read them).

    python benchmarks/gpu_shapes.py [--gpu-memory GIB]   # each part's shape and planned peak (gpu_all.sh --list)

The recipe's model is chosen to fill the card with real work: MLA attention (DeepSeek-V2-Lite's head dims: 16
heads, query/key 128 + 64 rotary, value 128, key/value latent 512, query latent 768), blocks of which the first is
dense, 32 routed experts with top-4 sigmoid routing plus 2 shared experts (hidden 1,408 each), one multi-token
prediction module, document masking, sequences of 8,192 tokens, 2 per step (16,384 tokens). Only the number of
blocks changes with the card (``RECIPE_BLOCKS``, largest first): the largest whose planned peak leaves
``HEADROOM`` of the memory free. The planned peak is ``moe_lightning.planner.plan.plan``'s for the run the recipe
makes (one GPU, Muon, ``ActivationOffload`` prefetch 1, loss chunks of 4,096): fp32 parameters, gradients and
Muon momentum (AdamW's two moments for embeddings and norms), the boundary activations, the larger of one block's
recomputed working set and the loss's, FSDP buffers and ``plan``'s 3 GiB runtime reserve. Parameters are counted
by ``moe_lightning.planner.flops.parameter_counts``.

The memory is ``--gpu-memory`` when given, else what ``torch.cuda.mem_get_info`` finds free on the device, else
80 GiB (the H100 a lent machine most likely has). The other parts have one fixed shape each; their planned peak is
printed too (``FIXED``) and each refuses to start, in one line, where it would not fit.
"""

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from moe_lightning.model import MoEConfig  # noqa: E402
from moe_lightning.planner.flops import parameter_counts  # noqa: E402
from moe_lightning.planner.plan import Cluster, Workload, plan  # noqa: E402

GIB = float(1 << 30)
HEADROOM = 0.08  # of the card's memory left free by a part's planned peak
DEFAULT_MEMORY_GIB = 80.0  # no GPU to ask: an H100 80 GB, the card a lent machine most likely has

RECIPE = dict(vocab_size=32768, dim=2048, n_layers=20, n_heads=16, max_seq_len=8192, rope_theta=10000.0,
              ffn_hidden=10944, n_dense_layers=1, num_experts=32, top_k=4, expert_hidden=1408, n_shared_experts=2,
              score_func="sigmoid", route_norm=True, route_scale=2.5, bias_update_rate=1e-3, aux_loss_coef=1e-4,
              document_masking=True, eod_token_id=256, attention="mla", q_lora_rank=768, kv_lora_rank=512,
              qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, mtp_layers=1, mtp_loss_weight=0.3)
# Largest first. Planned peaks (python benchmarks/gpu_shapes.py --gpu-memory 141): 20 blocks 79.13 GiB (6.33B
# parameters, 1.49B active: an H200), 16 blocks 65.46 GiB (5.11B / 1.24B: an H100 80 GB), 12 blocks 51.80 GiB
# (3.89B / 0.98B: a 64 GiB card).
RECIPE_BLOCKS = (20, 16, 12)
DRY = dict(RECIPE, vocab_size=320, dim=64, n_layers=3, n_heads=4, max_seq_len=64, ffn_hidden=192, num_experts=8,
           top_k=2, expert_hidden=64, n_shared_experts=1, q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16,
           qk_rope_head_dim=8, v_head_dim=16)
SEQ_LEN, BATCH_SIZE, DOC_LEN, LOSS_CHUNK = 8192, 2, 2048, 4096
DRY_SEQ_LEN, DRY_BATCH_SIZE, DRY_DOC_LEN = 64, 2, 16


@dataclass(frozen=True)
class Shape:
    """A part's model and step, with what ``plan`` prices for it on one GPU."""

    name: str
    config: MoEConfig
    seq_len: int
    batch_size: int
    peak_bytes: int

    @property
    def peak_gib(self) -> float:
        return self.peak_bytes / GIB

    def describe(self, memory_gib: float) -> str:
        counts = parameter_counts(self.config)
        return (f"{self.name}: {counts['total'] / 1e9:.3g}B parameters, {counts['active'] / 1e9:.3g}B active, "
                f"sequence {self.seq_len} x batch {self.batch_size}; planned peak {self.peak_gib:.2f} GiB of "
                f"{memory_gib:.1f} GiB ({self.peak_gib / memory_gib:.0%})")


def card_memory_gib(given: float | None = None) -> tuple[float, str]:
    """The GiB a part sizes itself by, and where that number came from."""
    if given is not None:
        if not given > 0:
            raise ValueError(f"--gpu-memory={given:g}: must be > 0 (GiB on the card).")
        return given, "--gpu-memory"
    if torch.cuda.is_available():
        free, _ = torch.cuda.mem_get_info()
        return free / GIB, f"free on {torch.cuda.get_device_name()} (torch.cuda.mem_get_info)"
    return DEFAULT_MEMORY_GIB, "no GPU here: an H100's 80 GiB assumed"


def planned_peak_bytes(config: MoEConfig, seq_len: int, batch_size: int, optimizer: str,
                       activation_offload: bool = False, loss_chunk: int | None = None,
                       doc_len: int | None = None) -> int:
    """``plan``'s GPU peak for one GPU training ``config`` as configured (not a second formula)."""
    result = plan(config, Cluster(nodes=1, gpus_per_node=1),
                  Workload(micro_batch=batch_size, seq_len=seq_len, optimizer=optimizer, loss_chunk=loss_chunk,
                           activation_offload=activation_offload, offload_prefetch=1, doc_len=doc_len))
    return result["memory"][result["configured"]]["gpu_peak_bytes"]


def recipe_shape(blocks: int) -> Shape:
    config = MoEConfig(**dict(RECIPE, n_layers=blocks))
    peak = planned_peak_bytes(config, SEQ_LEN, BATCH_SIZE, "muon", activation_offload=True, loss_chunk=LOSS_CHUNK,
                              doc_len=DOC_LEN)
    return Shape(f"recipe, {blocks} blocks", config, SEQ_LEN, BATCH_SIZE, peak)


def fits(shape: Shape, memory_gib: float) -> bool:
    return shape.peak_gib <= (1 - HEADROOM) * memory_gib


def pick_recipe(memory_gib: float) -> Shape:
    """The largest recipe in ``RECIPE_BLOCKS`` whose planned peak leaves ``HEADROOM`` of ``memory_gib`` free."""
    for blocks in RECIPE_BLOCKS:
        shape = recipe_shape(blocks)
        if fits(shape, memory_gib):
            return shape
    raise ValueError(f"no recipe shape fits {memory_gib:.1f} GiB: the smallest ({shape.name}) plans "
                     f"{shape.peak_gib:.2f} GiB, more than {1 - HEADROOM:.0%} of it; use a card with at least "
                     f"{shape.peak_gib / (1 - HEADROOM):.0f} GiB.")


def check_fits(shape: Shape, memory_gib: float, where: str) -> None:
    """One line, before any allocation, when a fixed shape would not leave ``HEADROOM`` free."""
    if not fits(shape, memory_gib):
        raise SystemExit(f"{shape.name}: planned peak {shape.peak_gib:.2f} GiB exceeds {1 - HEADROOM:.0%} of the "
                         f"{memory_gib:.1f} GiB {where}; run it on a larger card.")


# The parts with one fixed shape, and the plan each is priced as (name: config, sequence, batch, plan arguments)
STRATEGY_CONFIG = MoEConfig(vocab_size=32768, dim=1536, n_layers=12, n_heads=12, n_kv_heads=4, max_seq_len=4096,
                            ffn_hidden=4096, n_dense_layers=1, num_experts=16, top_k=2, expert_hidden=768,
                            n_shared_experts=1)
OFFLOAD_CONFIG = MoEConfig(vocab_size=4096, dim=1024, n_layers=16, n_heads=8, n_kv_heads=8, max_seq_len=65536,
                           ffn_hidden=2816, n_dense_layers=1, num_experts=16, top_k=2, expert_hidden=512,
                           n_shared_experts=1)
MUON_CONFIG = MoEConfig(**dict(RECIPE, n_layers=4, max_seq_len=4096))
COMPILE_CONFIG = MoEConfig(**dict(RECIPE, n_layers=2, mtp_layers=0))
FIXED = {
    "strategy": ("MoEFSDPStrategy default variant, AdamW", STRATEGY_CONFIG, 4096, 2, dict(optimizer="adamw")),
    "offload": ("checkpoint/offload modes, priced as AdamW training (an upper bound: no optimizer state)",
                OFFLOAD_CONFIG, 65536, 1, dict(optimizer="adamw")),
    "muon": ("4 recipe blocks, fp32 master weights, Muon (AdamW's state is larger: priced as AdamW)",
             MUON_CONFIG, 4096, 2, dict(optimizer="adamw", loss_chunk=LOSS_CHUNK)),
    "compile": ("2 recipe blocks, forward + backward, priced as AdamW training (an upper bound)", COMPILE_CONFIG,
                SEQ_LEN, BATCH_SIZE, dict(optimizer="adamw", doc_len=DOC_LEN)),
}


def fixed_shape(part: str) -> Shape:
    what, config, seq_len, batch_size, how = FIXED[part]
    return Shape(f"{part} ({what})", config, seq_len, batch_size,
                 planned_peak_bytes(config, seq_len, batch_size, **how))


def recipe_config(dry_run: bool = False) -> MoEConfig:
    """The recipe's largest model (its head dims are the parts' attention shape), or its toy-size dry run."""
    return MoEConfig(**(DRY if dry_run else RECIPE))


def packed_tokens(n: int, seq_len: int, vocab: int, eod: int, doc_len: int) -> torch.Tensor:
    """Random tokens with an end-of-document token every ``doc_len`` positions (shifted by a few per row): the
    recipe's batches."""
    tokens = torch.randint(0, min(vocab, eod), (n, seq_len + 1))
    for row in range(n):
        tokens[row, doc_len - 1 - row % 7::doc_len] = eod
    return tokens


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu-memory", type=float, default=None, help="GiB to size by (default: the card's "
                        "free memory, else 80)")
    args = parser.parse_args(argv)
    try:
        memory, source = card_memory_gib(args.gpu_memory)
        recipe = pick_recipe(memory)
    except ValueError as error:
        parser.exit(2, f"gpu_shapes: {error}\n")
    print(f"sized by {memory:.1f} GiB ({source}), headroom {HEADROOM:.0%}")
    print(recipe.describe(memory))
    for part in FIXED:
        print(fixed_shape(part).describe(memory))


if __name__ == "__main__":
    main()
