"""``MoEThroughputMonitor`` under context parallelism (issue 45, item 4): each token and attended pair counted once
in the world, and the key up-projection every CP rank repeats counted as ``plan`` prices it. Before, every CP rank
counted the whole batch, so tokens/s, TFLOP/s and MFU came out N times too high."""

from types import SimpleNamespace

import pytest
import torch

from moe_lightning.model import MoEConfig
from moe_lightning.training.callbacks import throughput
from moe_lightning.training.callbacks.throughput import MoEThroughputMonitor

B, S = 2, 16
CONFIG = MoEConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, max_seq_len=S, ffn_hidden=48, n_dense_layers=1,
                   num_experts=4, top_k=2, expert_hidden=16, attention="mla", q_lora_rank=0, kv_lora_rank=12,
                   qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8)


def measure(monkeypatch, cp: int, world: int = 8, pp: int = 1) -> dict[str, float]:
    """One logging interval of one optimizer step, 2.0 s long by the callback's clock, on a rank of a world of 8
    whose strategy splits sequences over ``cp`` ranks."""
    clock = iter([10.0, 12.0])
    monkeypatch.setattr(throughput.time, "perf_counter", lambda: next(clock))
    logged = []
    strategy = SimpleNamespace(context_parallel_size=cp, pipeline_parallel_size=pp)
    trainer = SimpleNamespace(strategy=strategy, world_size=world, global_step=1,
                              loggers=[SimpleNamespace(log_metrics=lambda metrics, step: logged.append(metrics))],
                              fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace(_should_accumulate=lambda: False)))
    module = SimpleNamespace(config=CONFIG, device=torch.device("cpu"))
    monitor = MoEThroughputMonitor(log_every_n_steps=1, peak_flops=1e12)
    monitor.on_fit_start(trainer, module)
    batch = torch.randint(4, 64, (B, S + 1))
    monitor.on_train_batch_start(trainer, module, batch, 0)
    monitor.on_train_batch_end(trainer, module, None, batch, 0)
    return logged[0]


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_a_cp_rank_counts_its_share_of_tokens_pairs_and_flops(monkeypatch, cp):
    """By hand: active matmul parameters of CONFIG (embedding excluded, head included) x 6 per token; causal pairs
    S(S+1)/2 per sequence x 6 x layers x heads x (qk 12 + v 8); under CP each rank has B·S/N tokens and 1/N of the
    pairs, and up-projects the other N - 1 ranks' keys: 6 (N - 1) x layers x 12 x 4 x (8 + 8) per local token."""
    from moe_lightning.planner.flops import parameter_counts

    counts = parameter_counts(CONFIG)
    dense = 6 * (counts["active"] - counts["embedding"])
    per_pair = 6 * 2 * 4 * (12 + 8)
    pairs = B * S * (S + 1) // 2
    upprojection = 6 * (cp - 1) * 2 * 12 * 4 * 16
    metrics = measure(monkeypatch, cp)
    tokens = B * S // cp
    assert metrics["perf/tokens_per_sec_per_device"] == tokens / 2.0
    assert metrics["perf/tokens_per_sec"] == B * S * 8 / cp / 2.0  # each group of cp ranks reads one batch
    flops = tokens * (dense + upprojection) + per_pair * pairs / cp
    assert metrics["perf/tflops_per_device"] == pytest.approx(flops / 2.0 / 1e12, rel=1e-12)
    assert metrics["perf/mfu"] == pytest.approx(flops / 2.0 / 1e12, rel=1e-12)


def test_cp4_is_not_four_times_cp1(monkeypatch):
    """The same batch read by a CP 4 group: a quarter of the tokens per device, a quarter of the world's tokens."""
    one, four = measure(monkeypatch, 1), measure(monkeypatch, 4)
    assert four["perf/tokens_per_sec"] == one["perf/tokens_per_sec"] / 4
    assert four["perf/tokens_per_sec_per_device"] == one["perf/tokens_per_sec_per_device"] / 4


def test_a_pipelines_stages_count_their_batch_once(monkeypatch):
    """2 stages read one batch (each runs about half the layers): a device counts half of it, the world each token
    once, and the FLOPs per device are the world's mean. Before: tokens/s and MFU twice too high under 2 stages."""
    whole, staged = measure(monkeypatch, 1), measure(monkeypatch, 1, pp=2)
    assert staged["perf/tokens_per_sec"] == whole["perf/tokens_per_sec"] / 2
    assert staged["perf/tflops_per_device"] == pytest.approx(whole["perf/tflops_per_device"] / 2, rel=1e-12)
