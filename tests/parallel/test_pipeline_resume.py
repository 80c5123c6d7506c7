"""Resume at any stage count (issue 42, item 5; ``checkpoint/state.py``). A checkpoint written without stages
saves its optimizer states per parameter-group index (Lightning's format), a stage's groups are others, and the
load regroups them by parameter name; one written under stages saves them by name, beside the LR schedule of rank
0's stage, which the load rebuilds for the resuming rank's groups. One process pins the state mapping (AdamW and
Muon); gloo fits resume 1, 2 and 4 stages into each other, EP 2 and Muon inside a stage, and a background save."""

import copy
import json
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

from moe_lightning.checkpoint.discovery import checkpoint_metadata
from moe_lightning.checkpoint.sharded import ShardedCheckpointer
from moe_lightning.checkpoint.state import load_state, save_state
from moe_lightning.model import MoEConfig
from moe_lightning.optim import Muon, WarmupCosineLR
from moe_lightning.optim.grouping import ROLES, param_groups
from moe_lightning.parallel.pipeline import keep_stage, resolve_pipeline
from tests.support.distributed import LAUNCHERS, run_nodes
from tests.support.pipeline_model import SHAPE, build


def _adamw(groups: list[dict]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(groups, lr=0.5, betas=(0.9, 0.95), foreach=False)


def _muon(groups: list[dict]) -> torch.optim.Optimizer:
    """Muon with the last two blocks sent to AdamW: at 2 stages the last stage holds no Muon matrix."""
    return Muon(groups, lr=0.5, adamw_lr=0.5, ns_dtype="float32", adamw_patterns=["layers.2.*", "layers.3.*"])


def _save_whole_model(path, groups_of=param_groups, optimizer_of=_adamw):
    """The whole model and its optimizer after two steps of O(1) random gradients (and its schedule), saved as a run
    without stages saves them (by group index); each group a learning rate of its own, so a group matched by index
    would show (the last group's a tensor: DCP saves it as a tensor item, not as bytes)."""
    model = build(MoEConfig(**SHAPE)).model
    optimizer = optimizer_of(groups_of(model, 0.1))
    for index, group in enumerate(optimizer.param_groups):
        group["lr"] = 1e-3 * (index + 1)
    optimizer.param_groups[-1]["lr"] = torch.tensor(optimizer.param_groups[-1]["lr"], dtype=torch.float64)
    scheduler = WarmupCosineLR(optimizer, warmup_steps=30)
    g = torch.Generator().manual_seed(0)
    for _ in range(2):
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=g, dtype=p.dtype)
        optimizer.step()
        scheduler.step()
    checkpoint = {"state_dict": get_model_state_dict(model), "optimizer_states": [
        get_optimizer_state_dict(model, optimizer)], "lr_schedulers": [scheduler.state_dict()], "global_step": 2}
    save_state(ShardedCheckpointer(), checkpoint, path, model, None, background=False)
    return model, optimizer


def _load_stage(path, stage: int, optimizer_of=_adamw):
    """Stage ``stage`` of 2 (other weights, another optimizer and schedule) loaded from ``path`` as a run with
    stages loads (and Lightning restores the schedule from the plain data after it)."""
    config = MoEConfig(**SHAPE)
    part = keep_stage(build(config, seed=1).model, stage, resolve_pipeline(config, 2))
    optimizer = optimizer_of(param_groups(part, 0.1))
    scheduler = WarmupCosineLR(optimizer, warmup_steps=5)
    checkpoint = checkpoint_metadata(path)
    load_state(ShardedCheckpointer(), path, checkpoint, part, part, [optimizer], None, strict=True,
               flatten_optimizer=True)
    scheduler.load_state_dict(checkpoint["lr_schedulers"][0])
    return part, optimizer, scheduler


@pytest.mark.parametrize("stage", [0, 1])
def test_a_stage_reads_its_parameters_optimizer_states_and_their_saved_groups_lr_by_name(tmp_path, stage):
    """Each stage holds 5 of the 6 groups (no head on the first, no embedding on the last), so their indices differ
    from the saved ones: every state tensor and step equals the saved one bit for bit, every group's learning rate
    is its role's saved group's, the stage keeps its own ``param_names``, and the schedule's per-group entries (a
    list of 6 saved, which torch's ``LambdaLR`` cannot load into 5 groups) are its groups' saved ones."""
    whole, saved = _save_whole_model(tmp_path / "ckpt")
    part, optimizer, scheduler = _load_stage(tmp_path / "ckpt", stage)
    assert len(optimizer.param_groups) == 5 < len(saved.param_groups)
    saved_params = dict(whole.named_parameters())
    saved_lr = {group["role"]: group["lr"] for group in saved.param_groups}
    saved_base_lr = {group["role"]: group["initial_lr"] for group in saved.param_groups}
    assert scheduler.warmup_steps == 30 and scheduler.last_epoch == 2
    assert scheduler.base_lrs == [saved_base_lr[group["role"]] for group in optimizer.param_groups]
    assert scheduler.get_last_lr() == [saved_lr[group["role"]] for group in optimizer.param_groups]
    own_names = [group["param_names"] for group in param_groups(part, 0.1)]
    assert [group["param_names"] for group in optimizer.param_groups] == own_names
    for group in optimizer.param_groups:
        assert group["lr"] == saved_lr[group["role"]] and type(group["lr"]) is type(saved_lr[group["role"]])
        for name, p in zip(group["param_names"], group["params"]):
            torch.testing.assert_close(p, saved_params[name], rtol=0, atol=0)
            want, got = saved.state[saved_params[name]], optimizer.state[p]
            assert set(got) == {"step", "exp_avg", "exp_avg_sq"}
            for key in got:
                torch.testing.assert_close(got[key], want[key], rtol=0, atol=0)
            assert float(got["step"]) == 2


@pytest.mark.parametrize("stage", [0, 1])
def test_muon_momentum_buffers_and_adamw_moments_come_back_under_a_stages_groups(tmp_path, stage):
    """Muon's groups are split by algorithm as well as by role (8 saved: the hidden matrices and the expert stacks
    each in a Muon and an AdamW group, the last two blocks' being AdamW's), so a role no longer names one saved group:
    each stage group takes the saved group listing its parameters (algorithm, learning rate and all), every Muon
    matrix its momentum buffer and every AdamW parameter its moments and step, bit for bit. Each stage holds 5
    groups; stage 1's (blocks 2 and 3 and the head) are all AdamW's."""
    whole, saved = _save_whole_model(tmp_path / "ckpt", optimizer_of=_muon)
    part, optimizer, scheduler = _load_stage(tmp_path / "ckpt", stage, optimizer_of=_muon)
    assert len(saved.param_groups) == 8 and len(optimizer.param_groups) == 5
    assert any(g["algorithm"] == "muon" for g in optimizer.param_groups) == (stage == 0)
    saved_params = dict(whole.named_parameters())
    saved_group = {name: group for group in saved.param_groups for name in group["param_names"]}
    held = {"muon": {"momentum_buffer"}, "adamw": {"step", "exp_avg", "exp_avg_sq"}}
    for group in optimizer.param_groups:
        source = saved_group[group["param_names"][0]]
        assert {k: v for k, v in group.items() if k not in ("params", "param_names")} == \
            {k: v for k, v in source.items() if k not in ("params", "param_names")}
        for name, p in zip(group["param_names"], group["params"]):
            assert saved_group[name] is source
            torch.testing.assert_close(p, saved_params[name], rtol=0, atol=0)
            want, got = saved.state[saved_params[name]], optimizer.state[p]
            assert set(got) == set(want) == held[group["algorithm"]]
            for key in got:
                torch.testing.assert_close(got[key], want[key], rtol=0, atol=0)
    assert scheduler.get_last_lr() == [saved_group[g["param_names"][0]]["lr"] for g in optimizer.param_groups]


ROLE_LR = {role: 1e-3 * (index + 1) for index, role in enumerate(ROLES)}  # a learning rate of its own per role


def _save_as_stages(path, schedule=lambda optimizer: WarmupCosineLR(optimizer, warmup_steps=30)):
    """What 2 stages save: every parameter's weights and AdamW state after two steps, keyed by name (the union of the
    stages' is the whole model's), beside the schedule of rank 0's stage (the plain data only rank 0 writes)."""
    config = MoEConfig(**SHAPE)
    whole = build(config).model
    first = keep_stage(build(config).model, 0, resolve_pipeline(config, 2))
    optimizers = [_adamw([{**g, "lr": ROLE_LR[g["role"]]} for g in param_groups(m, 0.1)]) for m in (whole, first)]
    schedulers = [schedule(o) for o in optimizers]
    g = torch.Generator().manual_seed(0)
    for _ in range(2):
        for p in whole.parameters():
            p.grad = torch.randn(p.shape, generator=g, dtype=p.dtype)
        for optimizer, scheduler in zip(optimizers, schedulers):
            optimizer.step()
            scheduler.step()
    by_name = StateDictOptions(flatten_optimizer_state_dict=True)
    checkpoint = {"state_dict": get_model_state_dict(whole), "optimizer_states": [
        get_optimizer_state_dict(whole, optimizers[0], options=by_name)], "lr_schedulers": [schedulers[1].state_dict()],
        "global_step": 2}
    save_state(ShardedCheckpointer(), checkpoint, path, whole, None, background=False)
    return schedulers[0]


class _Scale:
    """A ``LambdaLR`` factor that is an object with state (torch saves its ``__dict__``): one per role here."""

    def __init__(self, factor: float):
        self.factor = factor

    def __call__(self, step: int) -> float:
        return self.factor ** step


def _per_role(optimizer, scale: float) -> list[float]:
    return [scale * ROLE_LR[group["role"]] for group in optimizer.param_groups]


SCHEDULES = {  # each built for its optimizer's own groups, as configure_optimizers builds it
    "warmup-cosine": lambda o: WarmupCosineLR(o, warmup_steps=5),
    "sequential": lambda o: torch.optim.lr_scheduler.SequentialLR(o, [
        torch.optim.lr_scheduler.LinearLR(o, start_factor=0.5, total_iters=3),
        torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=10)], milestones=[3]),
    "lambdas-per-role": lambda o: torch.optim.lr_scheduler.LambdaLR(
        o, [_Scale(1 - 10 * ROLE_LR[group["role"]]) for group in o.param_groups]),
    "cyclic-per-role": lambda o: torch.optim.lr_scheduler.CyclicLR(o, _per_role(o, 1), _per_role(o, 3), step_size_up=2),
    "linear-then-cyclic": lambda o: torch.optim.lr_scheduler.SequentialLR(o, [  # the cycle's base is not initial_lr
        torch.optim.lr_scheduler.LinearLR(o, start_factor=0.5, total_iters=3),
        torch.optim.lr_scheduler.CyclicLR(o, _per_role(o, 0.1), _per_role(o, 0.5), step_size_up=2)], milestones=[3]),
}


@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("stages, stage", [(4, 0), (2, 1), (1, 0)])
def test_the_schedule_saved_by_rank_0s_stage_resumes_under_any_stage_groups(tmp_path, stages, stage, schedule):
    """The schedule holds rank 0's stage's 5 groups (hidden, expert, router, embedding, norm): the first of 4 stages
    (the embedding and a dense block: 3 groups) could not load it (IndexError in torch's ``LambdaLR``), the second of
    2 took the embedding's learning rate for its head, a run without stages had 5 learning rates for 6 groups, a
    ``SequentialLR``'s children kept rank 0's entries (a crash or another role's rate at the milestone), and
    per-role lambdas or a ``CyclicLR``'s per-role ``max_lr`` were refused. Each group's learning rate is now its
    role's in the uninterrupted schedule (the whole model's, every group a rate of its own), at the resume and for
    six steps on, across the milestone and a cycle's turn."""
    reference = _save_as_stages(tmp_path / "ckpt", SCHEDULES[schedule])
    config = MoEConfig(**SHAPE)
    part = build(config, seed=1).model
    if stages > 1:
        part = keep_stage(part, stage, resolve_pipeline(config, stages))
    optimizer = _adamw([{**g, "lr": ROLE_LR[g["role"]]} for g in param_groups(part, 0.1)])
    scheduler = SCHEDULES[schedule](optimizer)
    checkpoint = checkpoint_metadata(tmp_path / "ckpt")
    load_state(ShardedCheckpointer(), tmp_path / "ckpt", checkpoint, part, part, [optimizer], None, strict=True,
               flatten_optimizer=stages > 1)
    scheduler.load_state_dict(checkpoint["lr_schedulers"][0])
    roles = [group["role"] for group in optimizer.param_groups]
    assert len(roles) == {4: 3, 2: 5, 1: 6}[stages] and scheduler.last_epoch == 2
    for step in range(7):
        last_lr = dict(zip([g["role"] for g in reference.optimizer.param_groups], reference.get_last_lr()))
        assert [group["lr"] for group in optimizer.param_groups] == [last_lr[role] for role in roles], step
        assert scheduler.get_last_lr() == [last_lr[role] for role in roles], step
        for o, s in ((optimizer, scheduler), (reference.optimizer, reference)):
            o.step()
            s.step()


def test_validation_from_a_checkpoint_of_stages_restores_the_weights_without_an_optimizer(tmp_path):
    """``validate`` and ``test`` restore the model only (no optimizer exists outside ``fit``): the schedules are
    left as saved (it raised IndexError reading the first optimizer's groups)."""
    reference = _save_as_stages(tmp_path / "ckpt")
    expected = {name: p for group in reference.optimizer.param_groups
                for name, p in zip(group["param_names"], group["params"])}  # the weights saved after two steps
    config = MoEConfig(**SHAPE)
    part = keep_stage(build(config, seed=1).model, 1, resolve_pipeline(config, 2))
    checkpoint = checkpoint_metadata(tmp_path / "ckpt")
    saved = copy.deepcopy(checkpoint["lr_schedulers"])
    load_state(ShardedCheckpointer(), tmp_path / "ckpt", checkpoint, part, part, [], None, strict=True,
               flatten_optimizer=True)
    assert all(torch.equal(p, expected[name]) for name, p in part.named_parameters())
    assert checkpoint["lr_schedulers"] == saved


def test_schedulers_beside_several_optimizers_are_refused_in_one_line_before_the_load(tmp_path):
    """Lightning saves the schedulers as one list: which optimizer's groups each one's entries follow is not saved."""
    _save_as_stages(tmp_path / "ckpt")
    config = MoEConfig(**SHAPE)
    part = keep_stage(build(config, seed=1).model, 0, resolve_pipeline(config, 2))
    before = [p.detach().clone() for p in part.parameters()]
    optimizers = [_adamw(param_groups(part, 0.1)) for _ in range(2)]
    with pytest.raises(ValueError, match=r"this run has 2 optimizers.*configure_optimizers returns one") as refused:
        load_state(ShardedCheckpointer(), tmp_path / "ckpt", checkpoint_metadata(tmp_path / "ckpt"), part, part,
                   optimizers, None, strict=True, flatten_optimizer=True)
    assert "\n" not in str(refused.value)
    assert all(torch.equal(a, b) for a, b in zip(before, part.parameters()))  # refused before anything loaded


def test_a_stage_group_spanning_two_saved_groups_is_refused_in_one_line(tmp_path):
    """Saved groups that split one role (alternate hidden matrices, each half its own learning rate) give a stage's
    group two sets of hyper-parameters: refused, naming the field and the fix, not resolved by picking one."""
    def split_hidden(model, weight_decay):
        groups = param_groups(model, weight_decay)
        hidden = next(g for g in groups if g["role"] == "hidden_matrix")
        halves = [{**hidden, "params": hidden["params"][i::2], "param_names": hidden["param_names"][i::2]}
                  for i in (0, 1)]
        return [g for g in groups if g is not hidden] + halves
    _save_whole_model(tmp_path / "ckpt", split_hidden)
    words = r"optimizer_0\.param_groups was saved by group index.*group 0 \(hidden_matrix\).*listed by 2 groups"
    with pytest.raises(ValueError, match=words + ".*resume it at pipeline_parallel_size=1") as refused:
        _load_stage(tmp_path / "ckpt", 0)
    assert "\n" not in str(refused.value)


def test_a_saved_group_entry_nested_deeper_is_refused_in_one_line(tmp_path):
    """A group value DCP splits into several items (a dict holding a tensor) has no one name to regroup by."""
    def with_nested_entry(model, weight_decay):
        return [{**g, "extra": {"scale": torch.tensor(2.0)}} for g in param_groups(model, weight_decay)]
    _save_whole_model(tmp_path / "ckpt", with_nested_entry)
    with pytest.raises(ValueError, match=r"optimizer_0\.param_groups\.0\.extra\.scale nests inside a parameter group"
                                         r".*resume it at pipeline_parallel_size=1") as refused:
        _load_stage(tmp_path / "ckpt", 0)
    assert "\n" not in str(refused.value)


def _run(folder: Path, layout: tuple[int, tuple[str, ...]], *args: str) -> list[tuple[int, float]]:
    """tests/launchers/pipeline_fit_run.py at ``layout`` (processes, its flags), clipping at 0.5 deciding every
    step: each step's number and world-mean loss."""
    devices, flags = layout
    folder.mkdir()
    run_nodes([str(LAUNCHERS / "pipeline_fit_run.py"), "--out", str(folder / "run.json"), "--devices", str(devices),
               "--clip", "0.5", *flags, *args], 1, devices, cwd=folder, timeout=1500)
    return [(row["step"], row["loss"]) for row in json.loads((folder / "run.json").read_text())["rows"]]


# The same global batch of 8 sequences a step at every stage count: without stages FSDP over 2 ranks of 4
# sequences; 2 stages on 2 processes, 2 micro-batches of 4; 4 stages on 4 processes, 4 micro-batches of 2.
WITHOUT_STAGES = (2, ("--pp", "1", "--batch", "4"))
TWO_STAGES = (2, ("--pp", "2", "--microbatches", "2", "--batch", "8"))
FOUR_STAGES = (4, ("--pp", "4", "--microbatches", "4", "--batch", "8"))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> tuple[Path, list[tuple[int, float]]]:
    """5 steps without stages saved at step 3: a checkpoint without stages, and the steps every resume must give."""
    folder = tmp_path_factory.mktemp("resume") / "pp1"
    return folder / "step=3.ckpt", _run(folder, WITHOUT_STAGES, "--steps", "5", "--save-at", "3")


def _check_resumed(resumed: list[tuple[int, float]], uninterrupted: list[tuple[int, float]]) -> None:
    """Steps 4 and 5, their losses the uninterrupted run's to 1e-6 relative: fp32, the same terms summed in another
    order (per stage, per micro-batch); the data order and the optimizer state of another run would be far off (a
    step's loss moves by ~1e-2). That the next sequences are read is in the losses: another batch moves them alike."""
    assert [step for step, _ in resumed] == [4, 5]
    assert [loss for _, loss in resumed] == pytest.approx([loss for _, loss in uninterrupted[3:]], rel=1e-6)


@pytest.mark.slow
def test_a_checkpoint_without_stages_resumes_at_two_stages_with_the_same_losses(tmp_path, uninterrupted):
    """3 steps without stages saved at step 3, resumed at 2 stages for 2 more: its optimizer groups, saved by index,
    are regrouped by parameter name (and the LR schedule's per-group entries with them)."""
    checkpoint, losses = uninterrupted
    _check_resumed(_run(tmp_path / "pp2", TWO_STAGES, "--steps", "5", "--ckpt", str(checkpoint)), losses)


@pytest.mark.extended
def test_a_checkpoint_without_stages_resumes_at_four_stages_with_the_same_losses(tmp_path, uninterrupted):
    """Each of the 4 stages (the embedding with block 0, blocks 1 and 2 alone, block 3 with the head) takes the saved
    groups listing its parameters."""
    checkpoint, losses = uninterrupted
    _check_resumed(_run(tmp_path / "pp4", FOUR_STAGES, "--steps", "5", "--ckpt", str(checkpoint)), losses)


@pytest.mark.extended
def test_a_two_stage_checkpoint_written_in_the_background_resumes_at_four_two_and_one_stages(tmp_path,
                                                                                              uninterrupted):
    """``async_checkpoint=True`` at 2 stages: the save of step 3 goes to the background writer (the launcher records
    that it did; whether its write overlapped step 4 is not forced), and is committed at the next batch. The run
    itself goes on as the one without stages; its checkpoint (optimizer states keyed by parameter name) resumes at 4
    stages, at 2 and without stages with the same losses."""
    checkpoint, losses = uninterrupted
    written = _run(tmp_path / "pp2", TWO_STAGES, "--steps", "5", "--save-at", "3", "--async-checkpoint")
    assert [step for step, _ in written] == [1, 2, 3, 4, 5]
    assert [loss for _, loss in written] == pytest.approx([loss for _, loss in losses], rel=1e-6)
    assert json.loads((tmp_path / "pp2" / "saves.json").read_text()) == [True]  # the save of step 3, in the background
    saved = tmp_path / "pp2" / "step=3.ckpt"
    for name, layout in (("pp4", FOUR_STAGES), ("pp2-again", TWO_STAGES), ("pp1", WITHOUT_STAGES)):
        _check_resumed(_run(tmp_path / name, layout, "--steps", "5", "--ckpt", str(saved)), losses)


@pytest.mark.extended
def test_a_four_stage_checkpoint_resumes_at_two_stages_and_without_with_the_same_losses(tmp_path, uninterrupted):
    """4 stages on 4 processes write one checkpoint (each its own blocks' weights and optimizer states, by name); 2
    stages and a run without stages read it."""
    checkpoint, losses = uninterrupted
    _run(tmp_path / "pp4", FOUR_STAGES, "--steps", "3", "--save-at", "3")
    saved = tmp_path / "pp4" / "step=3.ckpt"
    for name, layout in (("pp2", TWO_STAGES), ("pp1", WITHOUT_STAGES)):
        _check_resumed(_run(tmp_path / name, layout, "--steps", "5", "--ckpt", str(saved)), losses)


@pytest.mark.extended
def test_an_expert_parallel_checkpoint_without_stages_resumes_at_two_stages_with_ep_2(tmp_path):
    """EP 2 over 2 processes (each rank 4 of the 8 experts of every MoE layer; the checkpoint holds the global expert
    stacks) resumed at 2 stages x EP 2 on 4 processes: each stage's two ranks take their experts' weights and AdamW
    moments of their own layers. 4 sequences per data replica a step (2 replicas), 2 micro-batches of 2 under
    stages."""
    losses = _run(tmp_path / "pp1", (2, ("--pp", "1", "--ep", "2", "--batch", "4")), "--steps", "5", "--save-at", "3")
    resumed = _run(tmp_path / "pp2", (4, ("--pp", "2", "--ep", "2", "--microbatches", "2", "--batch", "4")),
                   "--steps", "5", "--ckpt", str(tmp_path / "pp1" / "step=3.ckpt"))
    _check_resumed(resumed, losses)


@pytest.mark.extended
def test_a_muon_checkpoint_without_stages_resumes_at_two_stages_one_of_them_holding_no_muon_matrix(tmp_path):
    """Muon with the last two blocks sent to AdamW (``adamw_patterns``): the saved groups split the hidden matrices
    and expert stacks in a Muon and an AdamW group each, and the last stage holds only AdamW groups. Each stage's
    Muon matrices take their momentum buffers back, its AdamW ones their moments, under the saved group listing
    them."""
    muon = ("--optimizer", "muon", "--adamw-patterns", "layers.2.*", "layers.3.*")
    losses = _run(tmp_path / "pp1", WITHOUT_STAGES, *muon, "--steps", "5", "--save-at", "3")
    resumed = _run(tmp_path / "pp2", TWO_STAGES, *muon, "--steps", "5", "--ckpt", str(tmp_path / "pp1" / "step=3.ckpt"))
    _check_resumed(resumed, losses)


@pytest.mark.extended
def test_an_interleaved_checkpoint_resumes_at_four_stages_of_one_per_rank(tmp_path, uninterrupted):
    """Interleaved1F1B on 2 processes (rank 0 holds stages 0 and 2, rank 1 stages 1 and 3), saved at step 3,
    resumed as 4 stages on 4 processes, one each: every rank reads blocks another layout wrote."""
    checkpoint, losses = uninterrupted
    interleaved = (2, ("--pp", "2", "--schedule", "Interleaved1F1B", "--stages-per-rank", "2", "--microbatches", "2",
                       "--batch", "8"))
    _run(tmp_path / "v2", interleaved, "--steps", "3", "--save-at", "3")
    _check_resumed(_run(tmp_path / "pp4", FOUR_STAGES, "--steps", "5", "--ckpt", str(tmp_path / "v2" / "step=3.ckpt")),
                   losses)


@pytest.mark.extended
def test_a_context_parallel_checkpoint_without_stages_resumes_at_two_stages_with_cp_2(tmp_path):
    """CP 2 without stages (2 processes sharing every sequence: one data replica of 8) saved at step 3, resumed at 2
    stages x CP 2 (4 processes, 2 micro-batches of 4): steps 4 and 5 equal the uninterrupted CP run's."""
    context = ("--cp", "2", "--batch", "8")
    losses = _run(tmp_path / "cp", (2, ("--pp", "1", *context)), "--steps", "5", "--save-at", "3")
    _check_resumed(_run(tmp_path / "pp2-cp", (4, ("--pp", "2", "--microbatches", "2", *context)), "--steps", "5",
                        "--ckpt", str(tmp_path / "cp" / "step=3.ckpt")), losses)
