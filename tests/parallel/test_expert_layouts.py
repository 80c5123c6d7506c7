"""Expert parallelism on awkward layouts and its pipelined chunks, through ``apply_expert_parallel`` (gloo processes).

``tests/launchers/ep_layout_run.py`` runs one MoE layer (12 experts, top-2, fp32 unless said) per rank, its expert
stacks FSDP-sharded over the ranks holding the same experts, and compares with the whole layer in one process.
fp32 tolerance: outputs and gradients differ only by the order of sums (a token's expert outputs per node then
across nodes, an expert's weight gradient over its rows grouped by chunk and source), 1e-5 relative to the largest
entry (measured 0 to 2.3e-7).
"""

import json

import pytest
import torch
import torch.distributed as dist

from moe_lightning.model import MoEConfig
from moe_lightning.model.moe import MoELayer
from moe_lightning.parallel.expert_parallel import (AllToAllTokenDispatcher, apply_expert_parallel, dequantize_rows,
                                                    quantize_rows)
from tests.launchers.ep_layout_run import fp8_expert_inputs
from tests.support.collectives import recorded_schedule
from tests.support.distributed import LAUNCHERS, REPO_ROOT, run_nodes, run_ranks

SCRIPT = LAUNCHERS / "ep_layout_run.py"


def result_of(output: str) -> dict:
    return json.loads(next(line for line in output.splitlines() if line.startswith("{")))


@pytest.mark.extended
def test_two_nodes_of_three_with_ep_2_finish_and_equal_one_process():
    """The layout that hung: 2 torchrun agents x 3 ranks, ep 2. The group {2, 3} straddles the nodes and goes
    hierarchical (2 nodes x 1), the others stay flat: every rank learnt it from the same table and created the same
    sub-groups. Node membership is torchrun's GROUP_RANK."""
    result = result_of(run_nodes([str(SCRIPT), "--ep", "2"], nodes=2, per_node=3, cwd=REPO_ROOT, timeout=240)[0])
    kinds = ["hierarchical dispatch over 2 nodes x 1 ranks" in m for m in result["messages"]]
    assert kinds == [False, False, True, True, False, False], result["messages"]
    assert all("within one node of 2 ranks" in m for m, h in zip(result["messages"], kinds) if not h)
    assert max(result["relative_max_differences"].values()) < 1e-5, result


@pytest.mark.extended  # 4 processes
def test_cyclic_placement_is_hierarchical_by_the_launchers_node_and_chunks_equal_one_process():
    """Nodes a, b, b, a (ranks 0 and 3 on one node: no rank arithmetic finds that), ep 4, top-3, 3 pipelined chunks:
    2 nodes x 2 ranks, experts renumbered per inter-node group; equal to one process."""
    result = result_of(run_ranks(SCRIPT, 4, "--ep", "4", "--node-of", "a,b,b,a", "--experts", "8", "--top-k", "3",
                                 "--chunks", "3", timeout=240)[0])
    assert all("hierarchical dispatch over 2 nodes x 2 ranks" in m and "3 overlap chunks" in m
               for m in result["messages"]), result["messages"]
    assert max(result["relative_max_differences"].values()) < 1e-5, result


@pytest.mark.extended  # 4 processes; chunking is checked on one rank in the main suite
def test_flat_chunks_with_expert_fsdp_across_groups_equal_one_process():
    """ep 2 on 4 ranks (one node): two groups, each expert block FSDP-sharded over 2 ranks; 4 chunks of 12 tokens."""
    result = result_of(run_ranks(SCRIPT, 4, "--ep", "2", "--chunks", "4", timeout=240)[0])
    assert all("flat all-to-all dispatch within one node of 2 ranks, 4 overlap chunks" in m
               for m in result["messages"]), result["messages"]
    assert max(result["relative_max_differences"].values()) < 1e-5, result


@pytest.mark.extended  # multi-process, bf16
def test_gradients_at_ep_3_in_bf16_equal_ep_1_when_fsdp_divides():
    """bf16, ep 3: with ``scale_in_exchange=False`` and ``divide_expert_gradients`` the input and router gradients
    are bitwise those of the whole layer in one process (nothing rescales them), while scaling by 1/3 and back in the
    exchange changes most input-gradient elements. Expert weight gradients: the ep run rounds one bf16 gradient of
    all 3 ranks' rows, the reference rounds each rank's before the fp32 sum: at most (1 + 3) half-ulps of 2^-9
    relative to the largest partial, so 2^-6 relative to the largest entry (measured 3e-3 to 5e-3)."""
    exact = result_of(run_ranks(SCRIPT, 3, "--ep", "3", "--dtype", "bf16", "--scale", "fsdp", "--tokens", "96")[0])
    diffs = exact["relative_max_differences"]
    assert exact["x_grad_changed_fraction"] == 0 and diffs["y"] == diffs["x_grad"] == diffs["router.gate.weight"] == 0
    assert max(v for k, v in diffs.items() if k.startswith("experts.")) < 2 ** -6, exact
    rounded = result_of(run_ranks(SCRIPT, 3, "--ep", "3", "--dtype", "bf16", "--scale", "exchange", "--tokens", "96")[0])
    assert rounded["x_grad_changed_fraction"] > 0.1, rounded  # measured 0.57


@pytest.mark.extended  # 6 processes, bf16
def test_gradients_at_ep_3_in_bf16_with_expert_fsdp_over_two_ranks():
    """As above on 6 ranks: each expert block's gradient reduce-scattered over 2 ranks, summed then divided by 6."""
    exact = result_of(run_ranks(SCRIPT, 6, "--ep", "3", "--dtype", "bf16", "--scale", "fsdp", "--tokens", "96")[0])
    diffs = exact["relative_max_differences"]
    assert exact["x_grad_changed_fraction"] == 0 and diffs["x_grad"] == diffs["router.gate.weight"] == 0
    assert max(v for k, v in diffs.items() if k.startswith("experts.")) < 2 ** -6, exact


@pytest.fixture
def one_rank_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_chunks_pipeline_the_exchange_behind_the_experts_forward_and_backward(one_rank_group, monkeypatch):
    """Two chunks of 4 tokens (top-2: 8 rows each way). Forward: chunk 1's dispatch is launched before chunk 0's
    experts run, chunk 0's combine is in flight while chunk 1's experts run; the shared experts run while the first
    dispatch is in flight. Backward mirrors it. One host read (the split sizes of both chunks) per forward."""
    events, reads = [], []
    recorded_schedule(monkeypatch, events)
    torch.manual_seed(0)
    config = MoEConfig(dim=16, num_experts=4, top_k=2, expert_hidden=8, n_shared_experts=1)
    moe = MoELayer(config)
    moe.init_weights(std=16 ** -0.5, out_std=8 ** -0.5)
    reference = MoELayer(config)
    reference.load_state_dict(moe.state_dict())
    apply_expert_parallel([moe], one_rank_group, overlap_chunks=2)
    moe.shared_experts.register_forward_hook(lambda *_: events.append("shared"))
    moe.shared_experts.register_full_backward_hook(lambda *_: events.append("shared backward"))
    moe.experts.register_forward_hook(lambda *_: events.append("experts"))
    moe.experts.register_full_backward_hook(lambda *_: events.append("experts backward"))
    x = torch.randn(1, 8, 16, requires_grad=True)
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t, _orig=torch.Tensor.tolist: reads.append(1) or _orig(t))
    y = moe(x)
    assert len(reads) == 1
    assert events == ["counts", "launch 8", "shared",  # chunk 0's dispatch in flight during the shared experts
                      "launch 8", "wait 8", "experts", "launch 8",  # chunk 1's dispatch in flight: chunk 0's experts
                      "wait 8", "experts", "launch 8",  # chunk 0's combine in flight: chunk 1's experts
                      "wait 8", "wait 8"], events
    events.clear()
    g = torch.randn_like(y)
    (y * g).sum().backward()
    assert events == ["launch 8", "launch 8",  # both combines' gradients go out
                      "wait 8", "experts backward", "launch 8",  # chunk 0's in flight: chunk 1's experts backward
                      "wait 8", "experts backward", "launch 8",  # chunk 1's dispatch gradient in flight
                      "wait 8", "shared backward", "wait 8"], " | ".join(events)  # chunk 0's: the shared experts'

    x_ref = x.detach().clone().requires_grad_()
    y_ref = reference(x_ref)
    (y_ref * g).sum().backward()
    # One rank: the same rows through the same experts, grouped in two GEMMs instead of one; fp32 sum order only
    torch.testing.assert_close(y, y_ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-6, atol=1e-6)
    for (name, p), p_ref in zip(moe.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, p_ref.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_overlap_chunks_must_be_a_positive_integer(one_rank_group):
    moe = MoELayer(MoEConfig(dim=16, num_experts=4, top_k=2, expert_hidden=8))
    with pytest.raises(ValueError, match=r"strategy.ep_overlap_chunks=0: must be a positive integer"):
        apply_expert_parallel([moe], one_rank_group, overlap_chunks=0)
    assert isinstance(moe.dispatcher, type(MoELayer(MoEConfig(dim=16, num_experts=4)).dispatcher))
    assert not isinstance(moe.dispatcher, AllToAllTokenDispatcher)  # refused before any collective or change


def test_fp8_rows_round_to_e4m3_with_power_of_two_block_scales():
    """Each element within half an e4m3 step: 2^-4 of its magnitude (3 mantissa bits), or half the subnormal step
    2^-10 x scale below the normal range; a block's scale is a power of two with its maximum in [224, 448]; the
    dequantized values are exact in bf16 and quantize again to themselves (the hierarchical dispatcher's second
    hop adds no error; a block whose maximum rounded to 224 may take half the scale, same values)."""
    gen = torch.Generator().manual_seed(0)
    x_RD = torch.randn(64, 300, generator=gen) * torch.logspace(-3, 3, 64)[:, None]  # 3 blocks, the last of 44
    x_RD[5, 128:256] = 0  # an all-zero block
    q, scale_RB = quantize_rows(x_RD, torch.float8_e4m3fn)
    assert q.dtype == torch.float8_e4m3fn and scale_RB.shape == (64, 3) and scale_RB.dtype == torch.float32
    assert torch.equal(torch.frexp(scale_RB).mantissa, torch.full_like(scale_RB, 0.5))  # powers of two
    back = dequantize_rows(q, scale_RB, torch.float32)
    expanded = scale_RB.repeat_interleave(128, 1)[:, :300]
    assert ((back - x_RD).abs() <= torch.maximum(x_RD.abs() * 2 ** -4, expanded * 2 ** -10)).all()
    block_max = q.float().abs()[:, :256].unflatten(1, (2, 128)).amax(-1)  # the two full blocks
    assert ((block_max >= 224) & (block_max <= 448) | (block_max == 0)).all() and block_max[5, 1] == 0
    assert torch.equal(dequantize_rows(*quantize_rows(back, torch.float8_e4m3fn), torch.float32), back)
    assert torch.equal(dequantize_rows(*quantize_rows(back.bfloat16(), torch.float8_e4m3fn), torch.bfloat16),
                       back.bfloat16()) and torch.equal(back.bfloat16().float(), back)  # exact in bf16 too


def test_fp8_dispatch_on_one_rank_is_the_layer_with_quantized_expert_inputs(one_rank_group):
    """One rank, 2 chunks: outputs and gradients equal a one-process layer whose experts see their input rows
    quantized (straight-through gradient), fp32 sum order only (1e-6); the backward exchanges stay fp32 (the
    dispatch's gradient launch is 4-byte rows). Against the unquantized layer: each expert input within 2^-4 of
    itself (half e4m3's 2^-3 step), which the experts (O(1) gains at this init) carry into the output: within 2^-3
    of the largest entry (measured ~1e-2)."""
    events = []
    torch.manual_seed(0)
    config = MoEConfig(dim=32, num_experts=4, top_k=2, expert_hidden=16, n_shared_experts=1)
    moe = MoELayer(config)
    moe.init_weights(std=32 ** -0.5, out_std=16 ** -0.5)
    plain, quantized = MoELayer(config), MoELayer(config)
    plain.load_state_dict(moe.state_dict()), quantized.load_state_dict(moe.state_dict())
    fp8_expert_inputs(quantized)
    message = apply_expert_parallel([moe], one_rank_group, overlap_chunks=2, dispatch_dtype="float8_e4m3fn")
    assert "FP8 dispatch" in message
    x = torch.randn(1, 16, 32, requires_grad=True)
    g = torch.randn(1, 16, 32)
    y = moe(x)
    launch = dist.all_to_all_single
    dist.all_to_all_single = lambda out, inp, *a, **k: events.append((inp.dtype, inp.shape[1])) or launch(out, inp, *a, **k)
    try:
        (y * g).sum().backward()
    finally:
        dist.all_to_all_single = launch
    assert set(events) == {(torch.float32, 32), (torch.uint8, 33 * 4)}, events  # fp32 rows + fp32 weight: 132 B
    for ref, tolerance in ((quantized, 1e-6), (plain, 2 ** -3)):
        x_ref = x.detach().clone().requires_grad_()
        y_ref = ref(x_ref)
        (y_ref * g).sum().backward()
        scale = y_ref.abs().max()
        assert (y - y_ref).abs().max() <= tolerance * scale, (tolerance, (y - y_ref).abs().max() / scale)
        if ref is quantized:
            torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-6, atol=1e-6)
            for (name, p), p_ref in zip(moe.named_parameters(), ref.parameters()):
                torch.testing.assert_close(p.grad, p_ref.grad, rtol=1e-5, atol=1e-6, msg=name)
    assert (y - plain(x)).abs().max() > 0  # the dispatch did quantize


@pytest.mark.extended  # 4 processes; FP8 bytes between nodes stay in the main suite
def test_fp8_dispatch_hierarchical_2x2_equals_the_quantized_layer():
    """The cyclic 2 x 2 layout, top-3, 3 chunks, FP8 dispatch: both hops quantize (the second exactly re-creates
    the first's bytes: power-of-two scales), so every rank equals one process whose experts see quantized rows,
    within fp32 sum order (1e-5; measured 3e-7)."""
    result = result_of(run_ranks(SCRIPT, 4, "--ep", "4", "--node-of", "a,b,b,a", "--experts", "8", "--top-k", "3",
                                 "--chunks", "3", "--fp8", timeout=240)[0])
    assert all("hierarchical dispatch over 2 nodes x 2 ranks" in m and "FP8 dispatch" in m for m in result["messages"])
    assert max(result["relative_max_differences"].values()) < 1e-5, result


@pytest.mark.slow  # 2 processes, 2 x 50 training steps (~20 s)
def test_fp8_dispatch_trains_tiny_fsdp_like_fp32_dispatch():
    """configs/tiny-fsdp.yaml's model, 2 ranks, EP 2, a plain loop (``ep_fp8_loss_run.py``), 50 steps from the same
    weights on the same bytes: FP8 dispatch vs fp32 dispatch. Measured: every step within 3.6 % of fp32's loss (the
    first step 6.2233 both: one forward's quantization moves the loss in the 5th digit), the mean of the last 10
    steps 2.446 vs 2.465 (0.8 % apart). Tolerance: 8 % per step and 3 % on the last-10 mean (about twice the
    measured), and not bitwise equal (the dispatch did quantize)."""
    runs = result_of(run_ranks(LAUNCHERS / "ep_fp8_loss_run.py", 2, timeout=600)[0])
    fp32, fp8 = runs["fp32"], runs["fp8"]
    assert len(fp32) == len(fp8) == 50 and fp32 != fp8
    assert fp32[-1] < 0.5 * fp32[0]  # it trains
    assert all(abs(a - b) <= 0.08 * a for a, b in zip(fp32, fp8)), list(zip(fp32, fp8))
    assert abs(sum(fp8[-10:]) - sum(fp32[-10:])) <= 0.03 * sum(fp32[-10:])


def test_dispatch_dtype_must_be_null_or_float8_e4m3fn(one_rank_group):
    moe = MoELayer(MoEConfig(dim=16, num_experts=4, top_k=2, expert_hidden=8))
    with pytest.raises(ValueError, match=r"strategy.dispatch_dtype='float8_e5m2': must be null .* or 'float8_e4m3fn'"):
        apply_expert_parallel([moe], one_rank_group, dispatch_dtype="float8_e5m2")
