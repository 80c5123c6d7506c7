"""MFU under document masking: attention FLOPs from the (query, key) pairs the document mask keeps, counted on the
batch's device and read only when the monitor logs; checked against a float64 count of the mask itself."""

import lightning as L
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from moe_lightning import MoEConfig, MoELanguageModel
from moe_lightning.training.callbacks import MoEThroughputMonitor
from moe_lightning.planner.flops import (attended_pairs, attended_pairs_BS, attention_flops_per_pair, dense_flops_per_token,
                                 training_flops_per_token)
from moe_lightning.model.attention import dense_mask, document_ids

EOD = 3
CONFIG = dict(vocab_size=32, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=24, ffn_hidden=48,
              n_dense_layers=1, num_experts=4, top_k=2, expert_hidden=16, document_masking=True, eod_token_id=EOD,
              mtp_layers=1)


def mask_entries(tokens_BS: torch.Tensor, eod: int | None) -> float:
    """The brute-force count: True entries of the boolean mask attention is given, summed in float64."""
    doc_BS = document_ids(tokens_BS, eod) if eod is not None else torch.zeros_like(tokens_BS)
    return dense_mask(doc_BS, tokens_BS.shape[1]).double().sum().item()


def test_pairs_equal_the_document_mask():
    g = torch.Generator().manual_seed(0)
    tokens_BS = torch.randint(0, 8, (5, 61), generator=g)  # ~1 in 8 tokens ends a document
    tokens_BS[0, -1] = tokens_BS[1, 0] = EOD  # a document ending at the last and at the first position
    tokens_BS[2] = EOD  # every token its own document
    assert attended_pairs_BS(tokens_BS, EOD).sum().item() == mask_entries(tokens_BS, EOD)
    assert attended_pairs_BS(tokens_BS, None).sum().item() == mask_entries(tokens_BS, None) == 5 * 61 * 62 / 2
    for S, doc_len in ((64, 16), (61, 16), (64, None), (10, 100), (7, 1)):
        periodic_S = torch.zeros(S, dtype=torch.long)
        if doc_len:
            periodic_S[doc_len - 1::doc_len] = EOD
        assert attended_pairs(S, doc_len) == mask_entries(periodic_S[None], EOD if doc_len else None)
    assert attended_pairs(8, causal=False) == 64


def test_documents_shrink_the_attention_count():
    """1t.yaml's shape: 65,536 tokens in ~4k-token documents score a sixteenth of the whole-sequence pairs."""
    config = MoEConfig(vocab_size=64, dim=64, n_layers=2, n_heads=4, max_seq_len=65536, ffn_hidden=64)
    whole = training_flops_per_token(config, 65536) - dense_flops_per_token(config)
    documents = training_flops_per_token(config, 65536, doc_len=4096) - dense_flops_per_token(config)
    assert documents / whole == pytest.approx(4097 / 65537)


class LocalScalarReads(TorchDispatchMode):
    """Counts ``aten._local_scalar_dense``: what ``item``/``bool``/``int`` of a tensor dispatch to (a host sync
    on a GPU)."""

    def __init__(self):
        super().__init__()
        self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.reads += func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))


class Batches(L.Callback):
    def __init__(self):
        self.seen = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.seen.append(batch.clone())


def test_monitor_counts_the_batches_documents_without_a_read_per_step(tmp_path):
    torch.manual_seed(0)
    data = torch.randint(0, 8, (4 * 4, 25))
    data[:4, :] = 5  # the first step: one document per row
    monitor, batches = MoEThroughputMonitor(log_every_n_steps=2, peak_flops=1e12), Batches()
    reads = []

    class Probe(L.Callback):  # the monitor's own hook, under the dispatch counter, on a step it does not log
        def on_train_batch_start(self, *args):
            monitor.on_train_batch_start(*args)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step % 2:
                with LocalScalarReads() as probe:
                    monitor.on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
                reads.append(probe.reads)
            else:
                monitor.on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    logged = []

    class Logger(L.pytorch.loggers.logger.DummyLogger):
        def log_metrics(self, metrics, step=None):
            logged.append((step, metrics))

    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=4, logger=Logger(), callbacks=[Probe(), batches],
                        default_root_dir=tmp_path, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0)
    monitor.on_fit_start(trainer, MoELanguageModel(MoEConfig(**CONFIG)))  # Probe stands in for the callback
    trainer.fit(MoELanguageModel(MoEConfig(**CONFIG)), torch.utils.data.DataLoader(data, batch_size=4))
    assert reads == [0, 0]  # steps 1 and 3 log nothing and read nothing back
    config = MoEConfig(**CONFIG)
    per_step = {2: batches.seen[:2], 4: batches.seen[2:]}
    perf = [(step, m) for step, m in logged if "perf/mfu" in m]
    assert [step for step, _ in perf] == [2, 4]
    for step, metrics in perf:
        inputs = [b[:, :-1] for b in per_step[step]]
        tokens = sum(x.numel() for x in inputs)
        flops = tokens * dense_flops_per_token(config) + attention_flops_per_pair(config) * sum(
            mask_entries(x, EOD) for x in inputs)
        measured = metrics["perf/tflops_per_device"] * 1e12 / metrics["perf/tokens_per_sec_per_device"]
        assert measured == pytest.approx(flops / tokens, rel=1e-9)
        assert metrics["perf/mfu"] == pytest.approx(metrics["perf/tflops_per_device"], rel=1e-9)
    whole = training_flops_per_token(config, 24)  # the old count: causal over the whole sequence
    first = perf[0][1]["perf/tflops_per_device"] * 1e12 / perf[0][1]["perf/tokens_per_sec_per_device"]
    assert first < whole
