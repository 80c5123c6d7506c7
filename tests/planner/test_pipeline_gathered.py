"""``plan``'s "gathered stages" and "unsharded gradients" rows under pipeline stages (planner/pipeline.py), read from
torch's own action order: against a plain count of torch's UNSHARD/RESHARD actions, and against the bytes a real
fit at 2 stages holds."""

import contextlib
import io
import json

import pytest
import yaml
from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

from moe_lightning.commands.main import run
from moe_lightning.model import MoEConfig
from moe_lightning.parallel.pipeline import SPLIT_BACKWARD, resolve_pipeline, schedule_class
from moe_lightning.planner.pipeline import held_stages, lowered_actions, peak_held, stage_parameters
from tests.support.distributed import LAUNCHERS, REPO_ROOT, run_nodes

ONE_T = str(REPO_ROOT / "configs" / "1t.yaml")


def _open_gathers(schedule: str, size: int, microbatches: int, stages_per_rank: int) -> list[int]:
    """Per rank, the most of its stages between an UNSHARD and their RESHARD at once, counted on the list torch's
    runtime executes (``pipeline_order_with_comms``)."""
    most = []
    for rank in get_schedule_ops(schedule_class(schedule), size, microbatches, stages_per_rank, with_comms=True):
        open_, top = set(), 0
        for action in filter(None, rank):
            kind = str(action.computation_type).split(".")[-1]
            if kind == "UNSHARD":
                open_.add(action.stage_index)
            elif kind == "RESHARD":
                open_.discard(action.stage_index)
            top = max(top, len(open_))
        most.append(top)
    return most


@pytest.mark.parametrize("schedule, size, microbatches, stages_per_rank, gathered", [
    ("InterleavedZeroBubble", 2, 4, 2, 2), ("InterleavedZeroBubble", 2, 4, 4, 3), ("InterleavedZeroBubble", 4, 8, 6, 3),
    ("ZBVZeroBubble", 4, 8, 2, 2), ("DualPipeV", 4, 8, 2, 2),
    ("Interleaved1F1B", 4, 8, 2, 2), ("Interleaved1F1B", 2, 4, 4, 3), ("LoopedBFS", 2, 4, 4, 3)])
def test_the_planned_stages_gathered_at_once_are_torchs_unshard_reshard_count(schedule, size, microbatches,
                                                                               stages_per_rank, gathered):
    """Each rank's most stages gathered at once, planned from the action order (``held_stages``), equals the most
    UNSHARD...RESHARD intervals open at once in torch's lowered order, min(V, 3) here (torch's
    ``max_active_stages=3``). Split backward (``reshard_after_forward`` off): exactly those intervals. With it on,
    a forward reshards its stage, yet the count is the same: every stage is gathered by its UNSHARD before it first
    runs, and again by each backward (torch runs them with ``set_reshard_after_backward(False)``)."""
    counted = _open_gathers(schedule, size, microbatches, stages_per_rank)
    assert counted == [gathered] * size
    for reshard_after_forward in ({False} if schedule in SPLIT_BACKWARD else {True, False}):
        planned = [peak_held(held_stages(actions, reshard_after_forward), [1.0] * size * stages_per_rank,
                             [0.0] * size * stages_per_rank)["most_stages"]
                   for actions in lowered_actions(schedule, size, microbatches, stages_per_rank)]
        assert planned == counted


def test_one_stage_schedules_hold_their_stage_gathered_after_its_first_backward():
    """1F1B and GPipe have no UNSHARD: a stage is gathered unit by unit, but torch's stage keeps every unit gathered
    after its backward (no reshard after backward until the reduction), so the whole stage is held: 1."""
    for schedule in ("1F1B", "GPipe"):
        for actions in lowered_actions(schedule, 4, 8, 1):
            assert actions[-1][0] == "REDUCE_GRAD"
            held = held_stages(actions, reshard_after_forward=True)
            first_backward = next(i for i, (kind, _) in enumerate(actions) if kind == "B")
            assert all(not now["gathered"] for now in held[:first_backward])
            assert peak_held(held, [1.0] * 4, [0.0] * 4)["most_stages"] == 1


def _plan(*flags: str) -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        run(["plan", "--config", ONE_T, "--gpu", "H100", "--pipeline-parallel-size", "8", "--expert-parallel-size",
             "48", "--json", *flags])
    return json.loads(out.getvalue())["pipeline"]


def test_plan_at_1t_prices_two_gathered_stages_and_one_stages_gradients_under_interleaved_1f1b():
    """configs/1t.yaml at 8 stages x 2 per rank, Interleaved1F1B, M = 8: every rank holds both its stages gathered
    at the step's start (their UNSHARDs come first), so the row is 2 bytes x both stages' gathered parameters, and
    the stages' unsharded gradients never coexist (the later stage's REDUCE_GRAD comes before the earlier stage's
    first backward in torch's order), so the gradient row is 4 bytes x the larger stage's, not both."""
    rows = _plan("--pipeline-schedule", "Interleaved1F1B", "--pipeline-stages-per-rank", "2")
    config = MoEConfig(**yaml.safe_load(open(ONE_T))["model"]["init_args"]["config"])
    layout = resolve_pipeline(config, 8, "Interleaved1F1B", 8, 2)
    blocks = list(layout.blocks_per_stage)
    routed = stage_parameters(config, blocks, routed=True)
    whole = [n - e + e / 48 for n, e in zip(stage_parameters(config, blocks), routed)]  # experts: 1 / ep gathered
    for r, (rank, actions) in enumerate(zip(rows["ranks"], lowered_actions("Interleaved1F1B", 8, 8, 2))):
        early, late = rank["stages"]
        assert rank["gathered_stages"] == 2
        assert rank["bytes"]["gathered stages (bf16)"] == int(2 * (whole[early] + whole[late]))
        order = [(kind, stage) for kind, stage in actions]
        assert order.index(("REDUCE_GRAD", late)) < order.index(("B", early))
        assert rank["bytes"]["unsharded gradients across micro-batches"] == int(4 * max(whole[early], whole[late]))


def test_plan_caps_the_gathered_stages_at_three_of_four():
    """InterleavedZeroBubble at 4 stages per rank (32 stages of 61 blocks): 3 of 4 gathered at the peak (without
    activation offload, which fit refuses under a split backward)."""
    rows = _plan("--pipeline-schedule", "InterleavedZeroBubble", "--pipeline-stages-per-rank", "4",
                 "--no-activation-offload")
    assert [rank["gathered_stages"] for rank in rows["ranks"]] == [3] * 8
    assert rows["reshard_after_forward"] is False


@pytest.mark.extended
@pytest.mark.parametrize("schedule, stages_per_rank, microbatches, n_layers", [
    ("Interleaved1F1B", 2, 2, 4), ("ZBVZeroBubble", 2, 2, 4), ("InterleavedZeroBubble", 4, 4, 8), ("1F1B", 1, 2, 4)])
def test_a_fit_at_two_stages_holds_the_planned_gathered_parameters_and_gradients(tmp_path, schedule, stages_per_rank,
                                                                                 microbatches, n_layers):
    """One step of configs/tiny-fsdp.yaml's model at 2 stages on 4 gloo processes (each stage FSDP over 2 ranks:
    at one rank a stage, torch 2.13 copies the shard in at the wait and holds no all-gather in flight, which
    hides the UNSHARD issued ahead), fp32: the most gathered parameter bytes each rank holds (unsharded parameters
    and all-gather outputs in flight), the stages wholly gathered then, the most unsharded gradient bytes, and the
    parameter elements all-gathered in the step (what the plan's FSDP time scales with) equal the plan's from the
    action order (4 bytes an element, ``reshard_after_forward`` the strategy's default, off for a split backward),
    exactly."""
    out = tmp_path / "run.json"
    run_nodes([str(LAUNCHERS / "pipeline_gathered_run.py"), "--devices", "4", "--schedule", schedule,
               "--stages-per-rank", str(stages_per_rank), "--microbatches", str(microbatches), "--n-layers",
               str(n_layers), "--out", str(out)], 1, 4, cwd=tmp_path, timeout=900)
    measured = json.loads(out.read_text())
    shape = yaml.safe_load((REPO_ROOT / "configs" / "tiny-fsdp.yaml").read_text())["model"]["init_args"]["config"]
    config = MoEConfig(**{**shape, "n_layers": n_layers})
    blocks = list(resolve_pipeline(config, 2, schedule, microbatches, stages_per_rank).blocks_per_stage)
    whole, kept = stage_parameters(config, blocks), stage_parameters(config, blocks, kept=True)
    for r, actions in enumerate(lowered_actions(schedule, 2, microbatches, stages_per_rank)):
        planned = peak_held(held_stages(actions, schedule not in SPLIT_BACKWARD), whole, kept)
        for rank in measured[2 * r:2 * r + 2]:  # global rank = pipeline rank x 2 + shard rank
            assert rank["gathered_bytes"] == 4 * planned["parameters"]
            assert rank["stages_at_peak"] == planned["stages"]
            assert rank["gradient_bytes"] == 4 * planned["gradients"]
            assert rank["all_gathered_elements"] == planned["all_gathered"]
