"""Several pipeline stages per rank inside Lightning: the rank's model is the union of its stages (names kept) and
torch runs a view of each (``pipeline.stage_parts``). In one process, the views chained in stage order give one
model's loss and gradients (float64, O(1) weights); on 2 gloo processes, ``fit`` under the interleaved, zero-bubble
and DualPipeV schedules equals ``fit`` without stages per step, and a checkpoint written under Interleaved1F1B
resumes without stages (tests/launchers/pipeline_fit_run.py)."""

import dataclasses
import json
import re

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from moe_lightning.model import MoEConfig
from moe_lightning.parallel.pipeline import PipelineError, PipelineLoss, keep_stage, keep_stages, resolve_pipeline, \
    stage_parts
from tests.support.distributed import LAUNCHERS, run_nodes
from tests.support.pipeline_model import SHAPE, build




@pytest.mark.parametrize("schedule, extra", [("Interleaved1F1B", dict(mtp_layers=1)), ("ZBVZeroBubble", dict())])
def test_stage_views_hold_their_stages_parameters_and_chained_give_one_models_loss_and_gradients(schedule, extra):
    """Each rank's model keeps its stages' blocks; each view's parameters are exactly its stage's (those of a
    one-stage ``keep_stage`` model, by name) and are the rank model's own tensors; the views are not registered
    in the rank model, whose keys are its views' together. Run in stage order over 2 micro-batches, the views'
    summed loss and the rank models' gradients (the embedding copy's added to the first's) equal one model's over
    the batch: 1e-6 relative for the loss (the head's cross-entropy sums are fp32 by design), 2e-6 for the router's
    weight (an fp32 sum, as in test_pipeline.py), 1e-9 for every other gradient (float64)."""
    config = MoEConfig(**{**SHAPE, **extra})
    batch_BS1 = torch.randint(0, config.vocab_size, (8, 17), generator=torch.Generator().manual_seed(1))
    reference = build(config).train()
    loss = reference._loss(batch_BS1)
    loss.backward()
    expected = {n: p.grad for n, p in reference.model.named_parameters()}

    # the V's placement without resolve_pipeline's torch-version refusal (no schedule runs here)
    layout = dataclasses.replace(resolve_pipeline(config, 2, "Interleaved1F1B", microbatches=2), schedule=schedule)
    assert layout.num_stages == 4 and layout.blocks_per_stage == (1, 1, 1, 1)
    ranks = [keep_stages(build(config).model, layout.stages_of(r), layout).train() for r in range(2)]
    views = {}
    for rank, model in enumerate(ranks):
        assert [int(i) for i in model.layers._modules] == sorted(b for s in layout.stages_of(rank)
                                                                  for b in layout.blocks_of(s))
        parts = stage_parts(model, layout)
        held = {id(p) for p in model.parameters()}
        for stage, part in zip(layout.stages_of(rank), parts):
            alone = keep_stage(build(config).model, stage, layout)
            assert [n for n, _ in part.named_parameters()] == [n for n, _ in alone.named_parameters()]
            assert all(id(p) in held for p in part.parameters())
            assert all(part is not m for m in model.modules())
            views[stage] = part
        assert set(model.state_dict()) == {k for p in parts for k in p.state_dict()}
    for model in ranks:
        for moe in model.moe_layers():
            moe.aux_loss_grad_scale = 1 / 2

    loss_fn = PipelineLoss(config)
    loss_fn.set_batch(batch_BS1)
    total = 0
    for mb_BS1 in batch_BS1.chunk(2):
        x = mb_BS1
        for stage in range(layout.num_stages):
            x = views[stage](x, mb_BS1)
        mb_loss = loss_fn(x, mb_BS1)
        mb_loss.backward()
        total = total + mb_loss.detach()
    assert total.item() == pytest.approx(loss.item(), rel=1e-6)
    grads: dict[str, torch.Tensor] = {}
    for model in ranks:
        for name, p in model.named_parameters():
            grads[name] = grads[name] + p.grad if name in grads else p.grad.clone()
    assert set(grads) == set(expected)
    errors = {name: ((grad - expected[name]).abs().max() / expected[name].abs().max()).item()
              for name, grad in grads.items()}
    for name, error in errors.items():  # the router's weight gradient: an fp32 sum over the tokens (model/moe.py)
        assert error < (2e-6 if name.endswith("router.gate.weight") else 1e-9), (name, error)


@pytest.mark.parametrize("version, refused", [("2.11.0+cu130", True), ("2.12.1", True), ("2.13.0+cpu", False),
                                              ("2.13.0a0+gitabc", False), ("2.14.1", False)])
def test_split_backward_schedules_are_refused_on_torch_before_2_13(version, refused):
    """Torch 2.11's weight pass fails on the model's custom autograd functions (measured: ``_input_metadata`` of
    their nodes in ``autograd._make_grads``, under ZBVZeroBubble through the strategy); 2.13's runs exactly, 2.12
    is untested. The strategy refuses (before any group); ``resolve_pipeline``, which ``plan`` uses, does not."""
    from moe_lightning.parallel.pipeline import check_torch_runs
    for schedule in ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"):
        if refused:
            with pytest.raises(PipelineError, match=rf"pipeline_schedule='{schedule}' splits backward.*torch "
                                                    rf"{re.escape(version)}.*use 'Interleaved1F1B'") as refusal:
                check_torch_runs(schedule, version)
            assert "\n" not in str(refusal.value)
        else:
            check_torch_runs(schedule, version)
        resolve_pipeline(MoEConfig(**SHAPE), 2, schedule, microbatches=4)
    check_torch_runs("Interleaved1F1B", version)  # measured exact on torch 2.11 too


def test_the_strategy_refuses_a_split_backward_schedule_on_old_torch(monkeypatch):
    from moe_lightning.training.strategy import _check_pipeline_arguments
    monkeypatch.setattr(torch, "__version__", "2.12.1")
    with pytest.raises(PipelineError, match=r"pipeline_schedule='ZBVZeroBubble' splits backward"):
        _check_pipeline_arguments("ZBVZeroBubble", config=MoEConfig(**SHAPE))


@pytest.mark.parametrize("extra", [dict(mtp_layers=1), dict(tie_embeddings=True)])
def test_a_v_schedule_is_refused_where_both_ends_would_run_the_one_embedding(extra, monkeypatch):
    """A V puts the first and last stage on one rank: MTP or a tied head would run the rank's one embedding in two
    FSDP roots."""
    monkeypatch.setattr(torch, "__version__", "2.13.0")  # the split-backward schedules' own refusal aside
    from moe_lightning.training.strategy import _check_pipeline_arguments
    config = MoEConfig(**{**SHAPE, **extra})
    with pytest.raises(PipelineError, match=r"pipeline_schedule='ZBVZeroBubble' puts the first and the last stage "
                                            r"on one rank.*use 'Interleaved1F1B'") as refused:
        _check_pipeline_arguments("ZBVZeroBubble", config=config)
    assert "\n" not in str(refused.value)
    _check_pipeline_arguments("InterleavedZeroBubble", config=config)  # stage 0 and the last: two ranks


BALANCE = ("train/aux_loss", "train/expert_imbalance")  # the whole model's on logged steps (every step here)


def _fit(tmp_path, name: str, *args: str) -> dict:
    """tests/launchers/pipeline_fit_run.py on 2 gloo processes, balancing loss on and logged every step: per-step
    losses, gradient norms before clipping, the held-out loss, each rank's logged ``BALANCE`` per step, every MoE
    layer's balancing bias after each step, and the folder of any checkpoint it saved."""
    out = tmp_path / name / "run.json"
    out.parent.mkdir()
    log = run_nodes([str(LAUNCHERS / "pipeline_fit_run.py"), "--out", str(out), "--clip", "0.5", "--aux-loss-coef",
                     "0.01", "--log-every", "1", "--record", str(out.with_name("probe")),
                     "--biases", str(out.with_name("biases.json")), *args], 1, 2, cwd=out.parent, timeout=900)[0]
    val = [line for line in log.splitlines() if line.startswith("val/loss")]
    balance = [[[row["logged"][key] for key in BALANCE] for row in
                json.loads(out.with_name(f"probe.rank{rank}.json").read_text())] for rank in range(2)]
    return {"losses": [r["loss"] for r in json.loads(out.read_text())["rows"]],
            "norms": json.loads(out.with_name("norms.json").read_text()),
            "val": float(val[-1].split()[-1]) if val else None, "balance": balance,
            "biases": json.loads(out.with_name("biases.json").read_text()), "dir": out.parent}


@pytest.fixture(scope="module")
def without_stages(tmp_path_factory):
    """5 steps of 8 sequences (4 per rank) without stages, saved after step 3; held-out loss after step 3."""
    return _fit(tmp_path_factory.mktemp("virtual"), "pp1", "--pp", "1", "--batch", "4", "--steps", "5",
                "--save-at", "3")


OLD_TORCH = pytest.mark.skipif(tuple(int(n) for n in torch.__version__.split(".")[:2]) < (2, 13),
                               reason="split-backward schedules need torch >= 2.13 (refused before)")
SCHEDULES = [pytest.param("Interleaved1F1B", 2, marks=pytest.mark.extended),  # slow: its 4-stages-per-rank fit
             pytest.param("LoopedBFS", 2, marks=pytest.mark.extended),
             pytest.param("InterleavedZeroBubble", 2, marks=[pytest.mark.extended, OLD_TORCH]),
             pytest.param("ZBVZeroBubble", 2, marks=[pytest.mark.slow, OLD_TORCH]),
             pytest.param("DualPipeV", 4, marks=[pytest.mark.extended, OLD_TORCH])]  # DualPipeV: at least 2P


@pytest.mark.parametrize("schedule, microbatches", SCHEDULES)
def test_fit_with_two_stages_per_rank_equals_fit_without_stages_per_step(tmp_path, without_stages, schedule,
                                                                         microbatches):
    """configs/tiny-fsdp.yaml's model (4 blocks: 4 stages of one) and data, 2 ranks x 2 stages, the same 8
    sequences a step as without stages, gradients clipped at 0.5 (every step's norm is above it, so the norm over
    all four stages decides each update); every rank logs the whole model's aux loss and expert imbalance, equal to
    without stages (1e-6: fp32 means of the same values). Losses to 1e-6 relative (fp32, the same sums in another order; measured:
    equal to the last digit), gradient norms to 1e-5 (measured 7e-7 to 1.2e-6: the squares summed per stage, not
    per shard), the held-out loss (forward only through the stages) to 1e-6. Every layer's balancing bias after
    every step equals the run's without stages exactly (each step moves an expert's bias by +-0.01 on its count
    summed over the ranks holding the layer: a count summed over the wrong ranks, or a layer updated on a rank that
    does not own it, flips some), and every rank holding a layer holds the same bias."""
    staged = _fit(tmp_path, schedule, "--pp", "2", "--schedule", schedule, "--stages-per-rank", "2",
                  "--microbatches", str(microbatches), "--batch", "8")
    assert len(staged["losses"]) == 3 and min(staged["norms"]) > 0.5
    assert staged["losses"] == pytest.approx(without_stages["losses"][:3], rel=1e-6)
    assert staged["norms"] == pytest.approx(without_stages["norms"][:3], rel=1e-5)
    assert staged["val"] is not None and staged["val"] == pytest.approx(without_stages["val"], rel=1e-6)
    for rank in range(2):  # each stage's layers' aux losses and counts summed over both ranks' stages
        for step, expected in enumerate(without_stages["balance"][0][:3]):
            assert staged["balance"][rank][step] == pytest.approx(expected, rel=1e-6), (rank, step)
    assert all(row["agree"] for row in staged["biases"])
    assert [row["biases"] for row in staged["biases"]] == [row["biases"] for row in without_stages["biases"][:3]]
    assert any(any(v != 0 for v in values) for values in staged["biases"][-1]["biases"].values())


@pytest.mark.slow
def test_fit_with_four_stages_per_rank_equals_fit_without_stages_through_a_validation(tmp_path):
    """8 blocks as 8 stages of one, 2 ranks x 4 stages under Interleaved1F1B: torch keeps at most 3 stages gathered
    and re-gathers the 4th's for its backward, which evaluation must drop with the backward (it crashed at the
    first validation). Losses, norms and the held-out loss as in the two-stage case."""
    common = ("--n-layers", "8", "--steps", "3")
    without = _fit(tmp_path, "pp1", "--pp", "1", "--batch", "4", *common)
    staged = _fit(tmp_path, "v4", "--pp", "2", "--schedule", "Interleaved1F1B", "--stages-per-rank", "4",
                  "--microbatches", "2", "--batch", "8", *common)
    assert len(staged["losses"]) == 3 and min(staged["norms"]) > 0.5
    assert staged["losses"] == pytest.approx(without["losses"], rel=1e-6)
    assert staged["norms"] == pytest.approx(without["norms"], rel=1e-5)
    assert staged["val"] is not None and staged["val"] == pytest.approx(without["val"], rel=1e-6)


@pytest.mark.parametrize("schedule, stages_per_rank", [("Interleaved1F1B", 4), ("InterleavedZeroBubble", 5),
                                                       ("ZBVZeroBubble", 2), ("DualPipeV", 2)])
def test_evaluation_order_gathers_a_stage_only_around_its_forwards(schedule, stages_per_rank):
    """Torch's own order (P=2, M=4) cut to evaluation keeps every forward in order, and each UNSHARD...RESHARD
    pair of a stage encloses a forward of it (torch's runtime refuses to reshard a stage it never computed on)."""
    from torch.distributed.pipelining import schedules
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops
    from types import SimpleNamespace

    from moe_lightning.parallel.pipeline import _forward_only, schedule_class
    kind = schedules._ComputationType
    order = get_schedule_ops(schedule_class(schedule), 2, 4, stages_per_rank, with_comms=True)
    cut = SimpleNamespace(pipeline_order_with_comms={r: [a for a in acts if a is not None]
                                                     for r, acts in enumerate(order)})
    _forward_only(cut)
    for rank, actions in cut.pipeline_order_with_comms.items():
        forwards = [str(a) for acts in order[rank] if acts is not None
                    for a in (acts.sub_actions or [acts]) if a.computation_type == kind.FORWARD]
        assert [str(a) for a in actions if a.computation_type == kind.FORWARD] == forwards
        gathered = {}
        for action in actions:
            if action.computation_type == kind.UNSHARD:
                gathered[action.stage_index] = False
            elif action.computation_type == kind.FORWARD:
                gathered[action.stage_index] = True
            elif action.computation_type == kind.RESHARD:
                assert gathered.pop(action.stage_index), f"rank {rank}: {action} without a forward"


def _checkpoint_keys(folder) -> set[str]:
    """The model's and the optimizer state's keys (parameter groups are keyed by name under stages, by index
    without: ``MoEFSDPStrategy.optimizer_state``)."""
    keys = FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    return {k for k in keys if k.startswith(("state_dict.", "optimizer_0.state."))}


@pytest.mark.slow
def test_an_interleaved_checkpoint_has_the_keys_of_one_stage_and_resumes_without_stages(tmp_path, without_stages):
    """3 steps under Interleaved1F1B saved at step 3: the checkpoint's keys (the model's and the optimizer
    state's: 54 and 153) are those written without stages, and resumed without stages for 2 more steps its losses equal the uninterrupted
    run's steps 4 and 5 (1e-6 relative, fp32)."""
    staged = _fit(tmp_path, "interleaved", "--pp", "2", "--schedule", "Interleaved1F1B", "--stages-per-rank", "2",
                  "--microbatches", "2", "--batch", "8", "--save-at", "3")
    saved = staged["dir"] / "step=3.ckpt"
    keys = _checkpoint_keys(saved)
    assert len(keys) == 54 + 153 and keys == _checkpoint_keys(without_stages["dir"] / "step=3.ckpt")
    resumed = _fit(tmp_path, "resumed", "--pp", "1", "--batch", "4", "--steps", "5", "--ckpt", str(saved))
    assert resumed["losses"] == pytest.approx(without_stages["losses"][3:], rel=1e-6)
