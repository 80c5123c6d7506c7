"""``plan``'s stage rows under activation offload (planner/pipeline.py, ``offloaded_boundaries``): the block inputs
split as ``ActivationOffload`` places them under pipeline stages, every input but the model's last block's offloaded."""

import contextlib
import io
import json

import pytest

from moe_lightning.commands.main import run
from moe_lightning.planner.activations import pinned_bytes
from tests.support.distributed import REPO_ROOT

ONE_T = str(REPO_ROOT / "configs" / "1t.yaml")
HOP = 65536 * 7168 * 2  # one block input at 1t.yaml: a sequence of 65,536 positions x dim 7,168, bf16 (896 MiB)
KEPT, COPIED, IN_FLIGHT = "boundary activations kept (last block)", "boundary activations copied back", \
    "boundary activations (in flight)"


def _plan(*flags: str) -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        run(["plan", "--config", ONE_T, "--gpu", "H100", "--gpu-memory", "80", "--json", *flags])
    return json.loads(out.getvalue())


FOUR = ("--pipeline-parallel-size", "4", "--pipeline-microbatches", "4")
EIGHT_INTERLEAVED = ("--pipeline-parallel-size", "8", "--pipeline-microbatches", "8", "--expert-parallel-size", "48",
                     "--pipeline-schedule", "Interleaved1F1B", "--pipeline-stages-per-rank", "2")
GPIPE = (*FOUR, "--pipeline-schedule", "GPipe")


@pytest.mark.parametrize("flags", [FOUR, pytest.param(EIGHT_INTERLEAVED, marks=pytest.mark.extended),
                                   pytest.param(GPIPE, marks=pytest.mark.extended)],
                         ids=["1F1B", "Interleaved1F1B", "GPipe"])
def test_the_offloaded_split_adds_up_to_the_inputs_held_without_offload_on_every_rank(flags):
    """Kept on the GPU plus offloaded to the host is every block input the rank holds without offload (the
    copies back are duplicates of host-resident inputs); the host row is one pinned power-of-two block each."""
    without = _plan(*flags, "--no-activation-offload")["pipeline"]["ranks"]
    with_ = _plan(*flags, "--activation-offload")["pipeline"]["ranks"]
    for plain, offloaded in zip(without, with_, strict=True):
        inputs, split = plain["boundary_inputs"]["kept"], offloaded["boundary_inputs"]
        assert plain["bytes"][IN_FLIGHT] == inputs * HOP > 0
        assert split["kept"] + split["host"] == inputs
        assert offloaded["bytes"][KEPT] + split["host"] * HOP == plain["bytes"][IN_FLIGHT]
        assert offloaded["host_bytes_by_row"]["boundary activations (pinned)"] == split["host"] * pinned_bytes(HOP)
        assert IN_FLIGHT not in offloaded["bytes"] and KEPT not in plain["bytes"]


@pytest.mark.parametrize("flags, last_in_flight", [(FOUR, 1), (EIGHT_INTERLEAVED, 1), (GPIPE, 4)],
                         ids=["1F1B", "Interleaved1F1B", "GPipe"])
def test_only_the_rank_with_the_last_stage_keeps_inputs_one_per_micro_batch_in_flight_there(flags, last_in_flight):
    """The model's last block's input stays on the device, once per micro-batch in flight on the last stage (1F1B
    and Interleaved1F1B: 1; GPipe runs every forward first: M = 4); no other rank keeps any."""
    rows = _plan(*flags, "--activation-offload")["pipeline"]
    last = len(rows["blocks_per_stage"]) - 1
    for rank in rows["ranks"]:
        holds_last = last in rank["stages"]
        assert rank["bytes"][KEPT] == (last_in_flight * HOP if holds_last else 0)
        if holds_last:
            assert rank["in_flight"][rank["stages"].index(last)] == last_in_flight


@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_the_gpu_holds_the_non_stage_plans_copies_back(prefetch):
    """At one sequence per micro-batch (``P = M``) a stage's block input is the no-stage plan's, so a rank without
    the last stage holds exactly that plan's offloaded "boundary activations" row on the GPU, ``1 + prefetch``
    inputs, however many micro-batches it has in flight (rank 0: 4, 60 of its inputs on the host); the last stage's
    block in backward is a kept input, so it adds ``prefetch`` copies to its kept ones. Before the split, rank 0
    priced all 60 on the GPU (52.5 GiB)."""
    result = _plan(*FOUR, "--activation-offload", "--offload-prefetch", str(prefetch))
    non_stage = result["memory"]["with_offload"]["gpu_bytes"]["boundary activations"]
    assert non_stage == (1 + prefetch) * HOP
    *inner, last = result["pipeline"]["ranks"]
    for rank in inner:
        assert rank["bytes"][COPIED] == non_stage
    assert last["bytes"][COPIED] == prefetch * HOP and last["bytes"][KEPT] == HOP
    rank_0 = inner[0]
    assert rank_0["in_flight"] == [4] and rank_0["boundary_inputs"]["host"] == 4 * 15 and rank_0["bytes"][KEPT] == 0


def test_the_host_row_is_checked_against_the_host_memory():
    """With room on the GPU (200 GiB), 40 GiB of host memory holds rank 2's 32 pinned inputs (32 GiB) and rank 3's
    14, not rank 0's 60 nor rank 1's 45: the verdict per rank follows the host row."""
    rows = _plan(*FOUR, "--activation-offload", "--gpu-memory", "200", "--host-memory", "40")["pipeline"]
    assert [rank["host_bytes"] // 2**30 for rank in rows["ranks"]] == [60, 45, 32, 14]
    assert all(rank["peak"] <= 200 * 2**30 for rank in rows["ranks"])
    assert [rank["fits"] for rank in rows["ranks"]] == [False, False, True, True]


def test_a_background_save_stages_the_ranks_own_state_on_the_host():
    """``--async-checkpoint``: each rank's host copy of its stages' fp32 parameters and AdamW moments, 12 bytes a
    parameter over the stage's shard, beside its pinned inputs; the host total is their sum."""
    rows = _plan(*FOUR, "--activation-offload", "--async-checkpoint")["pipeline"]
    for rank in rows["ranks"]:
        host = rank["host_bytes_by_row"]
        assert host["async checkpoint staging"] == int(12 * rank["parameters"] / rows["shard"]) > 0
        assert rank["host_bytes"] == pytest.approx(sum(host.values()), abs=1)


def test_activation_offload_under_a_split_backward_schedule_is_refused_in_one_line(capsys):
    """fit refuses ActivationOffload under a split backward (strategy._check_pipeline_trainer); so does plan."""
    with pytest.raises(SystemExit):
        _plan(*EIGHT_INTERLEAVED[:6], "--pipeline-schedule", "ZBVZeroBubble", "--activation-offload")
    error = capsys.readouterr().err.strip()
    assert "\n" not in error
    assert "--pipeline-schedule=ZBVZeroBubble with activation offload" in error and "--no-activation-offload" in error


def test_a_stage_rank_prices_the_expert_exchange_and_only_the_larger_working_set():
    """At one sequence per micro-batch and the same ``ep`` (96) every stage rank holds a MoE block and prices the
    plan's expert exchange buffers (21 GiB at 1t.yaml); the last stage's loss working set never coexists with the
    block's working set and its exchange, so its peak counts the larger, as the plan's does (before: both, and no
    exchange)."""
    result = _plan(*FOUR, "--activation-offload")
    exchange = result["memory"]["with_offload"]["gpu_bytes"]["expert exchange buffers"]
    for rank in result["pipeline"]["ranks"]:
        rows = rank["bytes"]
        assert rows["expert exchange buffers"] == exchange > 20 * 2**30
        transient = rows["block recompute working set"] + exchange
        assert rank["peak"] == sum(rows.values()) - min(transient, rows.get("loss working set", 0))
    assert result["pipeline"]["ranks"][-1]["bytes"]["loss working set"] > 0


@pytest.mark.parametrize("schedule", ["1F1B", "GPipe"])
@pytest.mark.parametrize("prefetch", [0, 1])
@pytest.mark.parametrize("stage", [0, 1])
def test_the_split_is_what_the_callback_holds_running_a_stage_in_its_schedules_order(schedule, prefetch, stage):
    """One stage of 2 (the 4-block pipeline test model, blocks 0-1 and 2-3, float64) runs its rank's forwards and
    backwards of 2 micro-batches in the schedule's order under ``ActivationOffload(prefetch)``; counted with weak
    references: the most offloaded inputs alive at once (their host copies), the most kept inputs alive, and the
    most inputs on the device at once (kept, and copies back still referenced by a recompute) equal the plan's
    ``offloaded_boundaries`` from the same order's in-flight counts."""
    import weakref

    import torch

    from moe_lightning.model import MoEConfig
    from moe_lightning.parallel.pipeline import keep_stage, resolve_pipeline
    from moe_lightning.planner.pipeline import offloaded_boundaries, schedule_actions, simulate
    from moe_lightning.training.callbacks import ActivationOffload
    from tests.support.pipeline_model import SHAPE as PIPELINE_SHAPE, build

    config, M = MoEConfig(**PIPELINE_SHAPE), 2
    part = keep_stage(build(config).model, stage, resolve_pipeline(config, 2))
    offload = ActivationOffload(prefetch=prefetch, min_offload_bytes=0)
    offload.wrap(part)
    host, kept, copies, most = [], [], [], {"host": 0, "kept": 0, "device": 0}

    def sample():
        alive = {name: sum(ref() is not None for ref in refs) for name, refs in
                 (("host", host), ("kept", kept), ("copies", copies))}
        most.update(host=max(most["host"], alive["host"]), kept=max(most["kept"], alive["kept"]),
                    device=max(most["device"], alive["kept"] + alive["copies"]))

    pack, copy_in = offload._pack, offload._copy_in

    def counted_pack(index, tensor):
        boundary = pack(index, tensor)
        (host if boundary.offloaded else kept).append(weakref.ref(boundary))
        return boundary

    def counted_copy_in(boundary):
        copy_in(boundary)
        copies.append(weakref.ref(boundary.device_tensor))
        sample()

    offload._pack, offload._copy_in = counted_pack, counted_copy_in
    torch.manual_seed(0)
    inputs = [torch.randint(0, config.vocab_size, (2, 16)) if stage == 0 else
              torch.randn(2, 16, config.dim, dtype=torch.float64, requires_grad=True) for _ in range(M)]
    targets = [torch.randint(0, config.vocab_size, (2, 17)) for _ in range(M)]
    outputs = {}
    order = schedule_actions(schedule, 2, M, 1)
    for kind, _, m in order[stage]:
        if kind == "F":
            outputs[m] = part(inputs[m], targets[m])
        else:
            out = outputs.pop(m)
            out.backward(torch.randn_like(out)) if stage == 0 else out.float().sum().backward()
            del out
        sample()
    in_flight = simulate(order, [1.0, 1.0], 0.0)["in_flight"]
    planned = offloaded_boundaries(in_flight, [2, 2], [stage], prefetch)
    assert most == {"host": planned["host"], "kept": planned["kept"],
                    "device": planned["kept"] + planned["copied_back"]}, (in_flight, planned)
