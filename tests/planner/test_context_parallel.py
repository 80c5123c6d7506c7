"""``plan`` under context parallelism: the key side against saved-tensor hooks, every CP figure of
``configs/1t-128k.yaml`` recomputed by hand, the fit verdicts at CP 4 and CP 1, and the refusals."""

import pytest
import torch
import torch.nn.functional as F

from moe_lightning.model import MoEConfig, mla
from moe_lightning.model import attention as attention_module
from moe_lightning.model.attention import SequenceShard
from moe_lightning.planner.activations import block_working_set_bytes, key_side_bytes, mtp_activation_bytes
from moe_lightning.planner.plan import GiB, Cluster, Workload, main, plan
from moe_lightning.planner.run_config import load_model_config
from tests.planner.test_block_memory import GQA, MLA, make_block
from tests.support.block_reference import saved_bytes
from tests.support.distributed import REPO_ROOT

ONE_T_128K = str(REPO_ROOT / "configs" / "1t-128k.yaml")
GH200 = ["--gpu", "GH200", "--gpu-memory", "95", "--host-memory", "111"]


class _Repeat(torch.autograd.Function):
    """The shape of ``ContextParallelShard.gather`` on one process: the key-side tensors packed side by side in one
    buffer of ``n`` times the local positions (the other ranks' rows stand in as copies), split into views."""

    @staticmethod
    def forward(ctx, n, *local_BS):
        B, s = local_BS[0].shape[:2]
        ctx.shapes, widths = [x.shape for x in local_BS], [x[0, 0].numel() for x in local_BS]
        global_BTX = torch.cat([x.reshape(B, s, -1) for x in local_BS], -1).repeat(1, n, 1)
        ctx.n, ctx.widths = n, widths
        return tuple(p.reshape(B, n * s, *x.shape[2:]) for p, x in zip(global_BTX.split(widths, -1), local_BS))

    @staticmethod
    def backward(ctx, *grads):
        return (None, *(g.reshape(g.shape[0], ctx.n, -1, *g.shape[2:]).sum(1) for g in grads))


class RepeatShard(SequenceShard):
    def __init__(self, n: int):
        self.size = n

    def gather(self, *key_side_BS):
        return _Repeat.apply(self.size, *key_side_BS)


class _FusedSaves(torch.autograd.Function):
    """Attention of S queries over T keys keeping what fused kernels keep (FlashAttention, FlexAttention): q, k,
    v, the output laid out ``[B, S, H, V]`` and an fp32 log-sum-exp ``[B, H, S]``. Only the bytes matter here."""

    @staticmethod
    def forward(ctx, q, k, v):
        out = F.scaled_dot_product_attention(q, k, v, enable_gqa=q.shape[1] != k.shape[1])
        out = out.transpose(1, 2).contiguous().transpose(1, 2)
        ctx.save_for_backward(q, k, v, out, q.new_empty(q.shape[:-1], dtype=torch.float32))
        return out


def fused_attend(q, k, v, mask=None, scale=None, return_max_logits=False):
    return _FusedSaves.apply(q, k, v)


def attention_saved_bytes(config: MoEConfig, shard: SequenceShard | None, tokens: int, monkeypatch) -> int:
    """Bytes the attention half (norm + attention) of a bf16 block keeps for backward, its input excluded."""
    monkeypatch.setattr(mla, "attend", fused_attend)
    monkeypatch.setattr(attention_module, "attend", fused_attend)
    block = make_block(config, True, torch.bfloat16)
    x = torch.randn(1, tokens, config.dim, dtype=torch.bfloat16, requires_grad=True)
    exclude = [*block.parameters(), *block.buffers(), x]
    return saved_bytes(lambda x: x + block.attention(block.attention_norm(x), sequence_shard=shard), x,
                       exclude=exclude)


@pytest.mark.parametrize("config", [GQA, MLA], ids=["gqa", "mla"])
def test_key_side_scales_with_the_whole_sequence(config, monkeypatch):
    """Counted with saved-tensor hooks: going from 2 to 4 ranks' worth of keys (same local queries) adds exactly
    ``2 · s · key_side_bytes(gathered)``; the whole figure is the formula's within the 5 % the one-rank test allows
    (per-layer constants such as the rotary tables' padding are left out of the formula)."""
    s = 32
    two, four = (attention_saved_bytes(config, RepeatShard(n), s, monkeypatch) for n in (2, 4))
    assert four - two == 2 * s * key_side_bytes(config, gathered=True)
    for n, measured in ((2, two), (4, four)):
        assert block_working_set_bytes(config, s, True, part="attention", key_tokens=n * s) == pytest.approx(
            measured, rel=0.05)
    one = attention_saved_bytes(config, None, s, monkeypatch)
    assert block_working_set_bytes(config, s, True, part="attention") == pytest.approx(one, rel=0.05)


def test_1t_128k_figures_by_hand():
    """Every CP figure of ``configs/1t-128k.yaml`` (CP 4, 131,072 tokens, MLA C = 512, R = 64, 128 heads of
    N = 128, V = 128; 61 layers) from the shapes, not from the planner's helpers."""
    config = load_model_config(ONE_T_128K)
    cluster = Cluster(nodes=96, gpus_per_node=4, gpu="GH200", gpu_memory_gib=95, expert_parallel_size=96,
                      context_parallel_size=4)
    work = Workload(seq_len=131072, optimizer="muon", cpu_offload=True, loss_chunk=4096, activation_offload=True)
    result = plan(config, cluster, work)
    S, local, d, H = 131072, 32768, 7168, 128
    assert result["tokens_per_gpu"] == local
    assert result["boundary_activations_bytes"] == 61 * 2 * local * d
    rows = result["memory"]["with_offload"]["gpu_bytes"]
    # the whole sequence's assembled keys 2H(128+64), up-projected keys and values 2H(128+128), gathered C + R
    assert rows["key side, whole sequence (CP)"] == S * (2 * H * 192 + 2 * H * 256 + 2 * 576)
    assert rows["key side gradient (CP backward)"] == rows["key side, whole sequence (CP)"]  # 14.14 GiB
    # the MoE block's per-local-token bytes (attention 220,044 and MoE half 218,876 at CP 1, both measured in
    # benchmarks/block_memory.py at 1t.yaml, whose aux_loss_coef this config keeps) less the key side kept per
    # token at CP 1, 2H(192) + 2H(256) + 2C
    assert rows["block recompute working set"] == local * (220_044 + 218_876 - (2 * H * 192 + 2 * H * 256 + 1024))
    pairs = S * (S + 1) // 2
    assert result["attention_flops_per_rank"] == pairs * 6 * 61 * H * (192 + 128) / 4
    ex = main_json(["--config", ONE_T_128K, *GH200])["cp_exchange"]
    per_pass = 3 * S * 576 * 2 // 4  # (N-1)/N of S x width x 2 bytes
    assert ex["bytes_per_layer_and_pass"] == per_pass == 108 * 2**20  # docs/context_parallel.md: 108.0 MiB
    gradient = 3 * S * 576 * 4 // 4  # the key side's gradient is summed in fp32
    assert ex["gradient_bytes_per_layer"] == gradient == 2 * per_pass
    assert ex["rows"]["+ recompute"]["bytes"] == 61 * (2 * per_pass + gradient)
    assert ex["rows"]["+ recompute"]["bytes"] / GiB == pytest.approx(25.73, abs=0.005)
    assert ex["rows"]["forward + backward"]["seconds"] == pytest.approx(61 * (per_pass + gradient) / 450e9, rel=1e-12)
    assert ex["link"] == "NVLink"


def main_json(argv):
    import contextlib
    import io
    import json
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        main([*argv, "--json"])
    return json.loads(out.getvalue())


def test_1t_128k_fits_at_cp_4_and_not_at_cp_1(capsys):
    main(["--config", ONE_T_128K, *GH200])
    out = capsys.readouterr().out
    assert "verdict           fits as configured" in out
    assert "context_parallel_size=4" in out.split("from flags")[0]  # read from the config
    assert "context parallel  4 ranks share each sequence (head-tail chunks): 32,768 tokens per GPU of 1 x 131,072; " \
           f"attention {131072 * 131073 // 2 * 6 * 61 * 128 * 320 / 4 / 1e15:,.2f} PFLOP per GPU per step" in out
    # 3/4 x 131,072 x 576 x 2 B gathered, x 4 B for the gradient
    assert "108.0 MiB per layer and gather, 216.0 MiB per layer's gradient x 61 layers" in out
    assert any(line.split()[:4] == ["+", "recompute", "25.73", "GiB"] for line in out.splitlines())
    main(["--config", ONE_T_128K, *GH200, "--context-parallel-size", "1"])
    out = capsys.readouterr().out
    assert "verdict           does NOT fit as configured" in out
    assert "context_parallel_size=1" in out.split("from flags")[1]
    assert "context parallel  " not in out


def test_a_group_wider_than_a_node_exchanges_over_infiniband():
    """CP 8 over 4-GPU nodes: the group spans two nodes, priced at the InfiniBand speed (25 GB/s on GH200)."""
    ex = main_json(["--config", ONE_T_128K, *GH200, "--context-parallel-size", "8"])["cp_exchange"]
    per_pass = 7 * 131072 * 576 * 2 // 8
    assert (ex["link"], ex["gbps"], ex["bytes_per_layer_and_pass"]) == ("InfiniBand", 25.0, per_pass)
    assert ex["rows"]["+ recompute"]["seconds"] == pytest.approx(61 * 4 * per_pass / 25e9, rel=1e-12)


def test_key_width_on_the_wire():
    """MLA: latent + shared rotary key; GQA: grouped K and V, never per query head."""
    from moe_lightning.planner.context_parallel import key_width
    assert key_width(MLA) == 32 + 8 and key_width(GQA) == 2 * 2 * (64 // 4)


@pytest.mark.parametrize("flag, message", [
    (["--context-parallel-size", "5"], "strategy.context_parallel_size=5 must divide strategy.shard_size=384 (a "
     "context-parallel group is folded into the shard ranks, so it also divides the world): choose it from [1, 2, 4, "
     "8, 16, 32, 64, 128]"),  # divisors whose 2N divides seq_len 131,072 (not 3), those wider than a node too
    (["--context-parallel-size", "0"], "must be a positive integer"),
    (["--context-parallel-size", "4", "--seq-len", "131068"], "not a multiple of 8"),
])
def test_bad_context_parallel_sizes_are_the_strategys_refusals_in_one_line(flag, message, capsys):
    """plan checks the layout with the strategy's own ``resolve_layout``: what fit would refuse, in its words."""
    with pytest.raises(SystemExit):
        main(["--config", ONE_T_128K, *GH200, *flag])
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]


def test_multi_token_prediction_and_the_balancing_losses_under_cp_are_priced(tmp_path):
    """The strategy splits MTP's depths over a CP group, so plan prices them: their activations at the local tokens,
    their attention layers in the exchange; the balancing losses (sums completed over the group) are accepted."""
    with_mtp = tmp_path / "mtp.yaml"
    with_mtp.write_text("model:\n  init_args:\n    config:\n      mtp_layers: 1\n")
    result = main_json(["--config", ONE_T_128K, "--config", str(with_mtp), *GH200])
    config = load_model_config([ONE_T_128K, str(with_mtp)])
    rows = result["memory"]["with_offload"]["gpu_bytes"]
    assert rows["multi-token prediction activations"] == mtp_activation_bytes(config, 32768, checkpointed=True)
    assert result["cp_exchange"]["layers"] == 62
    losses = tmp_path / "losses.yaml"
    losses.write_text("model:\n  init_args:\n    config:\n      z_loss_coef: 0.001\n      aux_loss_coef: 0.0001\n")
    balanced = main_json(["--config", ONE_T_128K, "--config", str(with_mtp), "--config", str(losses), *GH200])
    assert balanced["cp_exchange"]["layers"] == 62


def test_cp_adds_the_key_up_projection_each_rank_repeats():
    """Issue 45, item 4: every CP rank up-projects all gathered latents through wkv_b (512 -> 128 x (128 + 128)),
    the other N - 1 ranks' too: 6 x (N - 1) x 61 layers x 512 x 128 x 256 FLOPs per local token, forward + backward.
    It was left out of plan's FLOPs (0.5 % at CP 2, 3.6 % at CP 8 of 1t-128k's causal count)."""
    from moe_lightning.planner.flops import training_flops_per_token

    config = load_model_config(ONE_T_128K)
    model_flops = training_flops_per_token(config, 131072)
    for cp in (2, 8):
        result = main_json(["--config", ONE_T_128K, *GH200, "--context-parallel-size", str(cp)])
        extra = 6 * (cp - 1) * 61 * 512 * 128 * 256
        assert result["cp_key_upprojection_flops_per_token"] == extra
        assert result["flops_per_token"] == model_flops + extra
        assert result["step_time"]["parts"]["compute"] == pytest.approx(
            32768 * 4 // cp * (model_flops + extra) / (0.3 * 989e12), rel=1e-12)
    assert 6 * 61 * 512 * 128 * 256 / model_flops == pytest.approx(0.0051, abs=5e-4)


def test_a_group_spanning_nodes_is_warned_about_and_its_exchange_joins_the_step(capsys):
    """CP 8 over 4-GPU nodes: priced over InfiniBand, said in a warning line naming the sizes that stay on NVLink;
    the exchange (forward, recompute, backward) is a part of the step time."""
    main(["--config", ONE_T_128K, *GH200, "--context-parallel-size", "8"])
    warnings = [line for line in capsys.readouterr().out.splitlines() if line.startswith("warning ")]
    assert len(warnings) == 1 and "context_parallel_size=8" in warnings[0] and "[1, 2, 4]" in warnings[0]
    result = main_json(["--config", ONE_T_128K, *GH200, "--context-parallel-size", "8"])
    assert result["step_time"]["parts"]["context-parallel exchange"] == result["cp_exchange"]["rows"][
        "+ recompute"]["seconds"]
    assert main_json(["--config", ONE_T_128K, *GH200])["warnings"] == []  # CP 4 stays within a node
