"""The recipe's model on one H200, shared by the parts that measure it (no Lightning, no CUDA needed to read it).

Chosen to fill the card with real work: MLA attention (DeepSeek-V2-Lite's head dims: 16 heads, query/key
128 + 64 rotary, value 128, key/value latent 512, query latent 768), 20 blocks of which the first is dense,
32 routed experts with top-4 sigmoid routing plus 2 shared experts (hidden 1,408 each), one multi-token
prediction module, document masking, sequences of 8,192 tokens, 2 per step (16,384 tokens). Parameters are
counted by ``moe_lightning.planner.flops.parameter_counts``: ``python benchmarks/gpu_recipe.py --describe``.
Memory at world size 1, bf16-mixed: fp32 parameters, gradients and Muon momentum (AdamW's two moments for the
embeddings and norms), ~12 B per parameter, plus bf16 working copies and one block's recomputed activations.
The dry run keeps the structure at toy size.
"""

from moe_lightning.model import MoEConfig

RECIPE = dict(vocab_size=32768, dim=2048, n_layers=20, n_heads=16, max_seq_len=8192, rope_theta=10000.0,
              ffn_hidden=10944, n_dense_layers=1, num_experts=32, top_k=4, expert_hidden=1408, n_shared_experts=2,
              score_func="sigmoid", route_norm=True, route_scale=2.5, bias_update_rate=1e-3, aux_loss_coef=1e-4,
              document_masking=True, eod_token_id=256, attention="mla", q_lora_rank=768, kv_lora_rank=512,
              qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, mtp_layers=1, mtp_loss_weight=0.3)
DRY = dict(RECIPE, vocab_size=320, dim=64, n_layers=3, n_heads=4, max_seq_len=64, ffn_hidden=192, num_experts=8,
           top_k=2, expert_hidden=64, n_shared_experts=1, q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16,
           qk_rope_head_dim=8, v_head_dim=16)
SEQ_LEN, BATCH_SIZE, DOC_LEN = 8192, 2, 2048
DRY_SEQ_LEN, DRY_BATCH_SIZE, DRY_DOC_LEN = 64, 2, 16


def recipe_config(dry_run: bool = False) -> MoEConfig:
    return MoEConfig(**(DRY if dry_run else RECIPE))
