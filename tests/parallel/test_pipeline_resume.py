"""A checkpoint written without pipeline stages resumes at 2 stages (issue 42, item 5): its optimizer states are
saved per parameter-group index (Lightning's format), a stage's groups are others, and the load regroups them by
parameter name (``checkpoint/state.py``). The reverse direction is tests/parallel/test_pipeline.py's."""

from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

from moe_lightning.checkpoint.discovery import checkpoint_metadata
from moe_lightning.checkpoint.sharded import ShardedCheckpointer
from moe_lightning.checkpoint.state import _regroup_schedulers, load_state, save_state
from moe_lightning.model import MoEConfig
from moe_lightning.optim import WarmupCosineLR
from moe_lightning.optim.grouping import param_groups
from moe_lightning.parallel.pipeline import keep_stage, resolve_pipeline
from tests.parallel.test_pipeline import _fit
from tests.support.pipeline_model import SHAPE, build


def _save_whole_model(path, groups_of=param_groups):
    """The whole model and its AdamW after two steps of O(1) random gradients (and its schedule), saved as a run
    without stages saves them (by group index); each group a learning rate of its own, so a group matched by index
    would show (the last group's a tensor: DCP saves it as a tensor item, not as bytes)."""
    model = build(MoEConfig(**SHAPE)).model
    optimizer = torch.optim.AdamW(groups_of(model, 0.1), lr=1.0, betas=(0.9, 0.95), foreach=False)
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


def _load_stage(path, stage: int):
    """Stage ``stage`` of 2 (other weights, another optimizer and schedule) loaded from ``path`` as a run with
    stages loads (and Lightning restores the schedule from the plain data after it)."""
    config = MoEConfig(**SHAPE)
    part = keep_stage(build(config, seed=1).model, stage, resolve_pipeline(config, 2))
    optimizer = torch.optim.AdamW(param_groups(part, 0.1), lr=0.5, betas=(0.9, 0.95), foreach=False)
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


def test_schedulers_saved_beside_several_optimizers_are_refused_in_one_line():
    """Lightning saves the schedulers as one list: which optimizer's groups each one's entries follow is not saved."""
    with pytest.raises(ValueError, match=r"lr_schedulers were saved beside 2 optimizers.*pipeline_parallel_size=1"):
        _regroup_schedulers({"lr_schedulers": [{"base_lrs": [0.1, 0.2]}]}, [1], 2, Path("ckpt"))


@pytest.mark.slow
def test_a_checkpoint_without_stages_resumes_at_two_stages_with_the_same_losses(tmp_path):
    """3 steps without stages (FSDP over 2 ranks of 4 sequences) saved at step 3, resumed at 2 stages x 2
    micro-batches of 4 for 2 more: steps 4 and 5 equal the uninterrupted run's, to 1e-6 relative as the fits at 2
    stages and 1 agree (fp32, the same terms summed in another order), with clipping at 0.5 deciding every step."""
    flat, _ = _fit(tmp_path, "pp1", "--pp", "1", "--batch", "4", "--steps", "5", "--save-at", "3", "--clip", "0.5")
    resumed, _ = _fit(tmp_path, "resumed", "--pp", "2", "--microbatches", "2", "--batch", "8", "--steps", "5",
                      "--clip", "0.5", "--ckpt", str(tmp_path / "pp1" / "step=3.ckpt"))
    assert len(resumed["rows"]) == 2
    assert [r["loss"] for r in resumed["rows"]] == pytest.approx([r["loss"] for r in flat["rows"][3:]], rel=1e-6)
