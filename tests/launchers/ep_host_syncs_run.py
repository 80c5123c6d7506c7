"""One rank of a 2-node x 1-rank fit (torchrun) under MoEFSDPStrategy(ep=2): hierarchical dispatch whose node holds
one rank. Records tests/training/test_host_syncs.py's host reads per step; rank 0 prints them as JSON."""

import json

import lightning as L
import torch
from torch.utils.data import DataLoader

from moe_lightning import MoEConfig, MoELanguageModel
from moe_lightning.training.callbacks import ActivationOffload
from moe_lightning.training.strategy import MoEFSDPStrategy
from tests.training.test_host_syncs import HostReads

config = MoEConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=16, ffn_hidden=64,
                   num_experts=4, top_k=2, expert_hidden=32, n_dense_layers=0, n_expert_groups=2, n_limited_groups=1)
probe = HostReads()
trainer = L.Trainer(accelerator="cpu", devices=1, num_nodes=2, strategy=MoEFSDPStrategy(expert_parallel_size=2),
                    max_steps=3, log_every_n_steps=2, logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                    callbacks=[probe, ActivationOffload(min_offload_bytes=0)])
try:
    trainer.fit(MoELanguageModel(config, loss_chunk_size=8), DataLoader(torch.randint(0, 64, (8, 17)), batch_size=2))
finally:
    probe.restore()
if trainer.global_rank == 0:
    print(json.dumps({"moe_layers": config.n_moe_layers, "steps": [dict(c) for c in probe.steps]}))
