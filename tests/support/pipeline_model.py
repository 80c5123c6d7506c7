"""The small MoE the pipeline tests cut into stages and compare with the whole model, in float64: O(1) activations
(init 0.2), 4 blocks (the first dense, so 4 stages of one), balancing losses on so their gradient scaling is
checked too."""

import torch

from moe_lightning.model import MoEConfig
from moe_lightning.training.module import MoELanguageModel

SHAPE = dict(vocab_size=64, dim=32, n_layers=4, n_heads=4, n_kv_heads=2, max_seq_len=16, ffn_hidden=64,
             n_dense_layers=1, num_experts=4, top_k=2, expert_hidden=32, n_shared_experts=1, init_std=0.2,
             aux_loss_coef=0.01, z_loss_coef=0.001)


def build(config: MoEConfig, seed: int = 0) -> MoELanguageModel:
    """The module with its model built from ``seed`` in float64, in training mode (the same weights every call)."""
    torch.manual_seed(seed)
    module = MoELanguageModel(config)
    module.configure_model()
    module.model.double()
    return module.train()
