"""Pipeline parallelism: the stage layout, the refusals, stages built from a model with its names kept, the stages
chained in one process, and torch's schedules on real gloo ranks (tests/launchers/pipeline_run.py), each against
one model's loss and gradients (float64, O(1) weights)."""

import copy
import itertools
import json
import math

import pytest
import torch
import yaml

from moe_lightning.model import MoEConfig
from moe_lightning.parallel import pipeline
from moe_lightning.parallel.pipeline import (PipelineError, PipelineLoss, balanced_layout, keep_stage,
                                             resolve_pipeline, stage_layout)
from moe_lightning.planner.pipeline import schedule_actions, simulate, stage_parameters
from moe_lightning.training.module import MoELanguageModel
from tests.support.distributed import LAUNCHERS, REPO_ROOT, run_nodes, run_ranks
from tests.support.pipeline_model import SHAPE, build



def _brute_force_peak(costs, stages, first, last):
    best = float("inf")
    for cuts in itertools.combinations(range(1, len(costs)), stages - 1):
        bounds = [0, *cuts, len(costs)]
        loads = [sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])]
        loads[0] += first
        loads[-1] += last
        best = min(best, max(loads))
    return best


@pytest.mark.parametrize("stages", [2, 3, 4])
def test_balanced_layout_reaches_the_lowest_peak_with_a_block_on_every_stage(stages):
    g = torch.Generator().manual_seed(stages)
    costs = (torch.rand(7, generator=g) + 0.5).tolist()
    first, last = 1.3, 2.1
    sizes = balanced_layout(costs, stages, first, last)
    assert sum(sizes) == 7 and min(sizes) >= 1 and len(sizes) == stages
    bounds = list(itertools.accumulate([0, *sizes]))
    loads = [sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])]
    loads[0] += first
    loads[-1] += last
    assert max(loads) == pytest.approx(_brute_force_peak(costs, stages, first, last))


def test_first_and_last_stages_hold_fewer_blocks_and_mtp_moves_blocks_off_the_last():
    """Vocabulary 1024 at dim 128: the embedding and the head each cost about 1.5 blocks' FLOPs."""
    shape = {**SHAPE, "vocab_size": 1024, "dim": 128, "n_layers": 12}
    assert stage_layout(MoEConfig(**shape), 4) == [2, 4, 4, 2]
    assert stage_layout(MoEConfig(**shape, mtp_layers=2), 4) == [3, 4, 4, 1]  # 2 depths: 2 blocks and 2 heads more


@pytest.mark.parametrize("kwargs, words", [
    (dict(size=4, microbatches=2), r"pipeline_microbatches=2 is fewer than pipeline_parallel_size=4.*at least 4"),
    (dict(size=3, schedule="Interleaved1F1B", stages_per_rank=2),
     r"pipeline_parallel_size=3 x pipeline_stages_per_rank=2 = 6 stages.*n_layers=4.*at most 4"),
    (dict(size=5), r"pipeline_parallel_size=5 x pipeline_stages_per_rank=1 = 5 stages"),
    (dict(size=2, schedule="Interleaved1F1B", stages_per_rank=1), r"needs several stages per rank.*set it to 2"),
    (dict(size=2, schedule="ZBVZeroBubble", stages_per_rank=3), r"exactly 2 stages per rank"),
    (dict(size=2, schedule="1F1B", stages_per_rank=2), r"one stage per rank.*set it to 1"),
    (dict(size=2, schedule="Zigzag"), r"pipeline_schedule='Zigzag': use one of '1F1B'"),
    (dict(size=0), r"pipeline_parallel_size=0: must be a positive integer"),
    (dict(size=2, schedule="Interleaved1F1B", microbatches=5, stages_per_rank=2),
     r"pipeline_microbatches=5: Interleaved1F1B runs whole rounds of pipeline_parallel_size=2 .*\[2, 3, 4, 6, 8\]"),
    (dict(size=2, schedule="DualPipeV", microbatches=3),
     r"pipeline_microbatches=3: DualPipeV runs at least 2 rounds of pipeline_parallel_size=2 .*\[4, 5, 6, 7, 8\]"),
])
def test_bad_pipeline_arguments_are_refused_in_one_line_naming_the_field(kwargs, words):
    with pytest.raises(PipelineError, match=words) as refused:
        resolve_pipeline(MoEConfig(**SHAPE), **kwargs)
    assert "\n" not in str(refused.value)


def test_a_schedule_the_installed_torch_lacks_is_refused_naming_those_it_has(monkeypatch):
    monkeypatch.delattr(pipeline.pipelining, "ScheduleDualPipeV")
    with pytest.raises(PipelineError, match=r"has no ScheduleDualPipeV; this torch offers '1F1B'") as refused:
        resolve_pipeline(MoEConfig(**SHAPE), 2, "DualPipeV")
    assert "DualPipeV'" not in str(refused.value).split("offers")[1]


def test_defaults_are_one_micro_batch_per_stage_and_two_stages_per_rank_for_interleaved():
    layout = resolve_pipeline(MoEConfig(**SHAPE), 2, "Interleaved1F1B")
    assert (layout.microbatches, layout.stages_per_rank, layout.num_stages) == (2, 2, 4)
    assert layout.stages_of(0) == [0, 2] and layout.stages_of(1) == [1, 3]
    assert resolve_pipeline(MoEConfig(**SHAPE), 2, "DualPipeV").microbatches == 4  # torch's least: 2 rounds
    v = resolve_pipeline(MoEConfig(**SHAPE), 2, "ZBVZeroBubble")
    assert v.stages_of(0) == [0, 3] and v.stages_of(1) == [1, 2] and v.rank_of(3) == 0


@pytest.mark.parametrize("size, micro", [(2, 2), (4, 4), (4, 8), (8, 16)])
def test_planned_1f1b_bubble_is_the_textbook_fraction(size, micro):
    """Timing the 1F1B order on equal stages gives (P-1)/(M+P-1) idle on every rank, and stage r holds
    min(M, P-r) micro-batches (1F1B's P on the first stage)."""
    timeline = simulate(schedule_actions("1F1B", size, micro, 1), [1.0] * size, 0.0)
    assert timeline["idle_fraction"] == pytest.approx([(size - 1) / (micro + size - 1)] * size)
    assert timeline["in_flight"] == [min(micro, size - r) for r in range(size)]


def test_planned_zero_bubble_schedules_idle_less_than_1f1b():
    """torch's own orders (its schedule classes on mock stages), equal stages, 4 ranks x 8 micro-batches."""
    one = simulate(schedule_actions("1F1B", 4, 8, 1), [1.0] * 4, 0.0)["idle_fraction"][0]
    for name in ("Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble"):
        idle = simulate(schedule_actions(name, 4, 8, 2), [0.5] * 8, 0.0)["idle_fraction"]
        assert max(idle) < one, (name, idle)



@pytest.mark.parametrize("config", [dict(mtp_layers=2, document_masking=True, eod_token_id=3), dict(tie_embeddings=True)])
def test_stages_keep_the_names_and_values_of_one_model(config):
    config = MoEConfig(**{**SHAPE, **config})
    full = build(config).model.state_dict()
    layout = resolve_pipeline(config, 3)
    keys = set()
    for stage in range(3):
        part = keep_stage(copy.deepcopy(build(config).model), stage, layout).state_dict()
        assert set(part) <= set(full)
        assert all(torch.equal(part[k], full[k]) for k in part)
        keys |= set(part)
    assert keys == set(full)
    first_blocks = {k.split(".")[1] for k in keep_stage(build(config).model, 0, layout).state_dict()
                    if k.startswith("layers.")}
    assert first_blocks == {str(i) for i in layout.blocks_of(0)}


@pytest.mark.parametrize("stages, micro, extra, chunk", [
    (2, 2, dict(), None),
    (3, 4, dict(mtp_layers=2, document_masking=True, eod_token_id=3), None),
    (2, 2, dict(tie_embeddings=True), 8),
    (4, 4, dict(mtp_layers=1, attention="mla", kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
                document_masking=True, eod_token_id=3), 16),
])
def test_chained_stages_give_one_models_loss_and_gradients(stages, micro, extra, chunk):
    """Stages run one after another in one process over ``micro`` micro-batches, each micro-batch's loss weighted
    by ``PipelineLoss`` and the balancing losses' gradient by 1 / micro: the summed loss and every gradient equal
    the one-process module's over the whole batch (``MoELanguageModel._loss``), the embedding copy's gradient
    summed into the first stage's. Float64 except what the model keeps fp32 by design: the router's matmul
    (model/moe.py; its weight gradient is an fp32 sum over tokens, so summed per micro-batch it rounds
    differently: 2e-6 relative; so is the chunked loss's head gradient) and the head's cross-entropy (the loss
    values: 1e-6); every other gradient 1e-9."""
    config = MoEConfig(**{**SHAPE, **extra})
    g = torch.Generator().manual_seed(1)
    batch_BS1 = torch.randint(0, config.vocab_size, (8, 17), generator=g)
    reference = build(config)
    reference.loss_chunk_size = chunk
    reference.train()
    loss = reference._loss(batch_BS1)
    loss.backward()
    expected = {n: p.grad for n, p in reference.model.named_parameters()}

    layout = resolve_pipeline(config, stages, microbatches=micro)
    parts = [keep_stage(build(config).model, s, layout, loss_chunk_size=chunk).train() for s in range(stages)]
    for part in parts:
        for moe in part.moe_layers():
            moe.aux_loss_grad_scale = 1 / micro
    loss_fn = PipelineLoss(config)
    loss_fn.set_batch(batch_BS1)
    total = 0
    for mb_BS1 in batch_BS1.chunk(micro):
        x = mb_BS1
        for part in parts:
            x = part(x, mb_BS1)
        mb_loss = loss_fn(x, mb_BS1)
        mb_loss.backward()
        total = total + mb_loss.detach()
    losses = loss_fn.losses()
    main = reference._main_loss if config.mtp_layers else loss
    # the head's cross-entropy sums are fp32 by design (OutputHead): summed in another order, fp32 rounding
    assert losses[0].item() == pytest.approx(main.item(), rel=1e-6)
    assert total.item() == pytest.approx(loss.item(), rel=1e-6)
    grads: dict[str, torch.Tensor] = {}
    for part in parts:
        for name, p in part.named_parameters():
            grads[name] = grads[name] + p.grad if name in grads else p.grad.clone()
    assert set(grads) == set(expected)
    errors = {name: ((grad - expected[name]).abs().max() / expected[name].abs().max().clamp(min=1e-12)).item()
              for name, grad in grads.items()}
    head = "tok_embeddings.weight" if config.tie_embeddings else "output.weight"
    fp32_sums = {n for n in errors if n.endswith("router.gate.weight") or chunk and n == head}
    for name, error in errors.items():  # an fp32 sum over the tokens: fp32 eps 1.2e-7 times a few
        assert error < (2e-6 if name in fp32_sums else 1e-9), (name, error)


def _pipeline_run(*args: str) -> dict:
    out = run_ranks(LAUNCHERS / "pipeline_run.py", 2, *args, timeout=600)
    return json.loads([line for line in out[0].splitlines() if line.startswith("{")][-1])


def _check_against_one_process(result: dict) -> None:
    """Loss values: the head's fp32 sums in another order (1e-6); gradients as in the chained test."""
    assert result["names"]  # every parameter of the model is on some stage
    assert result["main"][0] == pytest.approx(result["main"][1], rel=1e-6)
    assert result["total"][0] == pytest.approx(result["total"][1], rel=1e-6)
    for name, error in result["errors"].items():
        assert error < (2e-6 if name.endswith("router.gate.weight") else 1e-9), (name, error)


@pytest.mark.extended  # the main suite fits 1F1B with 2 MTP depths (tests/training/test_pipeline_callbacks.py)
def test_1f1b_on_two_ranks_with_mtp_equals_one_process():
    """torch's Schedule1F1B over 2 gloo ranks, 2 micro-batches, MTP (the embedding copy on the last stage, its
    gradient summed with the first stage's) and document masking: one process's loss and gradients."""
    result = _pipeline_run("--schedule", "1F1B", "--config",
                           json.dumps(dict(mtp_layers=2, document_masking=True, eod_token_id=3)))
    assert result["stages"] == [[0], [1]] and result["blocks_per_stage"] == [3, 1]  # MTP lightens the last stage
    _check_against_one_process(result)


@pytest.mark.parametrize("schedule, stages", [  # Lightning fits of each: test_pipeline_virtual.py, _compose.py
    pytest.param("GPipe", [[0], [1]], marks=pytest.mark.extended),
    pytest.param("Interleaved1F1B", [[0, 2], [1, 3]], marks=pytest.mark.extended),
    pytest.param("InterleavedZeroBubble", [[0, 2], [1, 3]], marks=pytest.mark.extended),
    pytest.param("ZBVZeroBubble", [[0, 3], [1, 2]], marks=pytest.mark.extended),
    pytest.param("DualPipeV", [[0, 3], [1, 2]], marks=pytest.mark.extended)])
def test_every_offered_schedule_on_two_ranks_equals_one_process(schedule, stages):
    """4 micro-batches; the V schedules hold the first and the last stage on rank 0 (two embedding copies on one
    rank, MTP on)."""
    result = _pipeline_run("--schedule", schedule, "--microbatches", "4", "--config", json.dumps(dict(mtp_layers=1)))
    assert result["stages"] == stages
    _check_against_one_process(result)


def _fit(tmp_path, name: str, *args: str) -> tuple[dict, str]:
    """tests/launchers/pipeline_fit_run.py on 2 gloo processes: its record and rank 0's log."""
    out = tmp_path / name / "run.json"
    out.parent.mkdir()
    logs = run_nodes([str(LAUNCHERS / "pipeline_fit_run.py"), "--out", str(out), *args], 1, 2, cwd=out.parent,
                     timeout=900)
    return json.loads(out.read_text()), logs[0]


@pytest.mark.extended  # the main suite fits 2 stages with Muon and MTP (tests/training/test_pipeline_callbacks.py)
def test_fit_at_two_stages_equals_one_stage_per_step_and_holds_the_planned_parameters(tmp_path):
    """configs/tiny-fsdp.yaml's model and data (expert parallelism off), 3 steps with gradient clipping at 0.5 (so
    the norm over both stages, the embedding counted once, decides every step), on 2 processes: 2 stages x 2
    micro-batches of 4 sequences against FSDP over 2 ranks of 4 sequences each, the same 8 sequences a step.
    Per-step losses to 1e-6 relative (fp32: the same terms summed in another order; measured: equal to the last
    digit), the held-out loss (one batch of the same 8 sequences) alike. Each rank holds exactly the parameters
    ``plan``'s stage rows count for its stage (fp32, shard size 1)."""
    staged, staged_log = _fit(tmp_path, "pp2", "--pp", "2", "--microbatches", "2", "--batch", "8", "--clip", "0.5")
    flat, flat_log = _fit(tmp_path, "pp1", "--pp", "1", "--batch", "4", "--clip", "0.5")
    got, want = [r["loss"] for r in staged["rows"]], [r["loss"] for r in flat["rows"]]
    assert len(got) == len(want) == 3
    assert got == pytest.approx(want, rel=1e-6)

    def val_loss(log: str) -> float:
        return float([line for line in log.splitlines() if line.startswith("val/loss")][-1].split()[-1])
    assert val_loss(staged_log) == pytest.approx(val_loss(flat_log), rel=1e-6)
    config = MoEConfig(**yaml.safe_load((REPO_ROOT / "configs" / "tiny-fsdp.yaml").read_text())
                       ["model"]["init_args"]["config"])
    planned = stage_parameters(config, stage_layout(config, 2))
    assert [rank["parameters"] for rank in staged["held"]] == [4 * n for n in planned]


@pytest.mark.extended
def test_a_two_stage_checkpoint_resumes_at_one_stage_with_the_same_losses(tmp_path):
    """3 steps at 2 stages saved at step 3, resumed without stages for 2 more: steps 4 and 5 equal an uninterrupted
    run without stages (its optimizer states are read by parameter name; measured bitwise equal). The other direction
    is tests/parallel/test_pipeline_resume.py's."""
    flat, _ = _fit(tmp_path, "pp1", "--pp", "1", "--batch", "4", "--steps", "5", "--save-at", "3", "--clip", "0.5")
    _fit(tmp_path, "pp2", "--pp", "2", "--microbatches", "2", "--batch", "8", "--save-at", "3", "--clip", "0.5")
    resumed, _ = _fit(tmp_path, "resumed", "--pp", "1", "--batch", "4", "--steps", "5", "--clip", "0.5",
                      "--ckpt", str(tmp_path / "pp2" / "step=3.ckpt"))
    assert [r["loss"] for r in resumed["rows"]] == pytest.approx([r["loss"] for r in flat["rows"][3:]], rel=1e-6)


def test_fsdp_units_of_a_stage_keep_the_models_block_names_and_skip_what_it_lacks():
    """The FSDP units (parallel/units.py, what plan prices and fsdp.py shards) of a middle and a last stage: the
    blocks under their own indices, each owning its parameters, and no embedding or head unit where there is none."""
    from moe_lightning.parallel.units import fsdp_units
    config = MoEConfig(**SHAPE)
    layout = resolve_pipeline(config, 3)
    for stage in (1, 2):
        part = keep_stage(build(config).model, stage, layout)
        units = {u.name: u for u in fsdp_units(part, expert_parallel=False)}
        blocks = [f"layers.{i}" for i in layout.blocks_of(stage)]
        assert [n for n in units if n.startswith("layers.")] == blocks
        assert all(units[n].numel > 0 for n in blocks)
        assert "tok_embeddings" not in units and ("output" in units) == (stage == 2)


def test_a_stage_built_on_the_meta_device_initialises_what_it_holds():
    """``init_weights`` on a stage cut from a meta-device model (a middle stage: no embedding, norm or head) fills
    its blocks as the whole model's initialisers do (it raised AttributeError on the missing embedding)."""
    config = MoEConfig(**SHAPE)
    from moe_lightning.model import MoETransformer
    with torch.device("meta"):
        whole = MoETransformer(config)
    part = keep_stage(whole, 1, resolve_pipeline(config, 3))
    part.to_empty(device="cpu")
    torch.manual_seed(0)
    part.init_weights()
    assert part.tok_embeddings is None and part.output is None
    queries = [block.attention.wq.weight for block in part.layers]
    assert queries and all(q.std().item() == pytest.approx(config.init_std, rel=0.2) for q in queries)


@pytest.mark.extended  # 2 processes; the seed rule: test_mesh.py, the embedding copy at a release load: test_mapping.py
def test_a_meta_device_build_initialises_each_stage_on_its_own_and_copies_the_first_stages_embedding():
    """``meta_init=True`` at 2 stages with MTP (the last stage holds a copy of the embedding): each rank initialises
    its own stage's blocks from a seed of its own (the rank's place in its replica, so stages differ: with the shard
    rank alone both stages' first blocks drew the same values), the last stage's embedding copy is the first
    stage's, bit for bit (sent at the build; each drew its own), the initialisers' scales hold (``init_std`` 0.2 for
    the query projections, 1 for the embedding), and training runs (finite losses)."""
    results = sorted((json.loads([line for line in out.splitlines() if line.startswith("{")][-1])
                      for out in run_ranks(LAUNCHERS / "pipeline_meta_init_run.py", 2, timeout=600)),
                     key=lambda result: result["rank"])
    first, last = (result["weights"] for result in results)
    assert first["tok_embeddings.weight"] == last["tok_embeddings.weight"]
    embedding = torch.tensor(first["tok_embeddings.weight"])
    assert embedding.std().item() == pytest.approx(1.0, rel=0.1)
    queries = {name: torch.tensor(w) for weights in (first, last) for name, w in weights.items() if "wq" in name}
    assert {n.split(".attention")[0] for n in queries} == {"layers.0", "layers.1", "layers.2", "layers.3",
                                                          "mtp.0.block"}
    assert all(q.std().item() == pytest.approx(0.2, rel=0.15) for q in queries.values())
    a, b = queries["layers.0.attention.wq.weight"], queries["layers.3.attention.wq.weight"]  # each stage's first
    assert torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1].abs().item() < 0.2
    assert len(results[0]["losses"]) == 2 and all(math.isfinite(loss) for loss in results[0]["losses"])


@pytest.mark.parametrize("kwargs, words", [
    (dict(cpu_offload=True), r"strategy.cpu_offload=True with pipeline_parallel_size > 1.*set cpu_offload=False"),
    (dict(save_distributed_checkpoint=False),
     r"strategy.save_distributed_checkpoint=False with pipeline_parallel_size > 1.*first stage only"),
])
def test_strategy_settings_stages_cannot_honour_are_refused(kwargs, words):
    """A host-memory gradient summed over the accelerator's group; a single-file save holding stage 0 only."""
    from moe_lightning.training.strategy import _check_pipeline_arguments
    with pytest.raises(PipelineError, match=words) as refused:
        _check_pipeline_arguments(**{"schedule": "1F1B", **kwargs})
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize("schedule, refused", [("ZBVZeroBubble", True), ("InterleavedZeroBubble", True),
                                               ("DualPipeV", True), ("Interleaved1F1B", False), ("1F1B", False)])
def test_activation_offload_is_refused_under_a_split_backward_schedule(schedule, refused):
    """Torch's weight pass takes each parameter group's gradient in a backward of its own; each recomputes the
    checkpointed blocks (non-reentrant checkpointing recomputes once per ``autograd.grad`` call)."""
    from types import SimpleNamespace
    from moe_lightning.training.callbacks import ActivationOffload
    from moe_lightning.training.strategy import _check_pipeline_trainer
    trainer = SimpleNamespace(accumulate_grad_batches=1, datamodule=None, callbacks=[ActivationOffload()])
    layout = resolve_pipeline(MoEConfig(**SHAPE), 2, schedule, 4)
    if not refused:
        _check_pipeline_trainer(trainer, layout)
        return
    with pytest.raises(PipelineError, match=rf"ActivationOffload with strategy.pipeline_schedule='{schedule}'.*"
                                            r"'Interleaved1F1B' or '1F1B'") as refusal:
        _check_pipeline_trainer(trainer, layout)
    assert "\n" not in str(refusal.value)


def test_trainer_and_layout_settings_stages_cannot_run_are_refused_in_one_line():
    """Before any process group: gradient accumulation beside the micro-batches, a per-rank batch the micro-batches
    do not divide (only counts of at least one micro-batch per stage offered), stages not dividing the world."""
    from types import SimpleNamespace
    from moe_lightning.parallel.mesh import MeshError, MeshLayout
    from moe_lightning.training.strategy import _check_pipeline_trainer
    layout = resolve_pipeline(MoEConfig(**SHAPE), 2)
    cases = [
        (dict(accumulate_grad_batches=4, datamodule=None),
         r"trainer.accumulate_grad_batches=4 with pipeline_parallel_size=2.*set it to 1.*pipeline_microbatches"),
        (dict(accumulate_grad_batches=1, datamodule=SimpleNamespace(batch_size=5)),
         r"pipeline_microbatches=2 does not divide the per-rank batch of 5.*choose it from \[5\]"),
        (dict(accumulate_grad_batches=1, datamodule=SimpleNamespace(batch_size=3)),
         r"per-rank batch of 3 sequences \(data.batch_size\): choose it from \[3\]"),
    ]
    for trainer, words in cases:
        with pytest.raises(PipelineError, match=words) as refused:
            _check_pipeline_trainer(SimpleNamespace(callbacks=[], **trainer), layout)
        assert "\n" not in str(refused.value)
    interleaved = resolve_pipeline(MoEConfig(**SHAPE), 2, "Interleaved1F1B", 4)  # 5 is not whole rounds of 2
    with pytest.raises(PipelineError, match=r"batch of 10 sequences \(data.batch_size\): choose it from \[2, 10\]"):
        _check_pipeline_trainer(SimpleNamespace(callbacks=[], accumulate_grad_batches=1,
                                                datamodule=SimpleNamespace(batch_size=10)), interleaved)
    with pytest.raises(PipelineError, match=r"batch of 6 sequences \(data.batch_size\): choose it from \[6\]"):
        _check_pipeline_trainer(SimpleNamespace(callbacks=[], accumulate_grad_batches=1,
                                                datamodule=SimpleNamespace(batch_size=6)),
                                resolve_pipeline(MoEConfig(**SHAPE), 4, microbatches=4))  # 1, 2 and 3 < 4 stages
    with pytest.raises(MeshError, match=r"pipeline_parallel_size=4 does not divide the world size 6.*"
                                        r"from \[1, 2, 3, 6\]"):
        MeshLayout.resolve(6, 1, "auto", 1, 8, 1, pipeline_parallel_size=4)


def test_muon_qk_clip_and_the_expert_load_monitor_are_accepted_with_stages():
    """They reduce over a stage's ranks, or per layer of the whole model (tests/training/test_pipeline_callbacks.py
    fits them at 2 stages against 1): Muon from the YAML factory and both callbacks pass the stage checks."""
    from types import SimpleNamespace
    from jsonargparse import ArgumentParser
    from moe_lightning.training import callbacks
    from moe_lightning.training.strategy import _check_pipeline_trainer
    parser = ArgumentParser()  # the factory a YAML class_path gives
    parser.add_class_arguments(MoELanguageModel, "model")
    instantiate = getattr(parser, "instantiate", None) or parser.instantiate_classes  # the name before 4.49
    module = instantiate(parser.parse_args(["--model.optimizer", "moe_lightning.optim.Muon"])).model
    trainer = SimpleNamespace(accumulate_grad_batches=1, datamodule=None, lightning_module=module,
                              callbacks=[callbacks.QKClip(), callbacks.ExpertLoadMonitor()])
    _check_pipeline_trainer(trainer, resolve_pipeline(MoEConfig(**SHAPE), 2))


@pytest.mark.parametrize("batch, microbatches, schedule", [(1, 1, "GPipe"), (3, 3, "1F1B"), (4, 2, "1F1B")])
def test_a_short_held_out_batch_runs_with_fewer_micro_batches(batch, microbatches, schedule):
    """The held-out set's last batch may hold fewer sequences than stages: it runs one sequence per micro-batch
    as GPipe (forward only, the same losses; torch's 1F1B refuses fewer micro-batches than stages). That two
    ranks then equal one process: the slow test below; before, a batch of 1 raised mid-fit."""
    layout = resolve_pipeline(MoEConfig(**SHAPE), 2, "1F1B", 2)
    part = keep_stage(build(MoEConfig(**SHAPE)).model, 0, layout)
    runner = pipeline.PipelineRunner([part], layout, None, torch.device("cpu"), torch.float32)
    M = runner.microbatches(batch, training=False)
    assert (M, runner.schedule_name(M, training=False)) == (microbatches, schedule)
    assert runner.schedule_name(2, training=True) == "1F1B"


@pytest.mark.parametrize("batch", [pytest.param(1, marks=pytest.mark.extended), pytest.param(3, marks=pytest.mark.slow)])
def test_a_short_held_out_batch_on_two_ranks_equals_one_process(batch):
    """The held-out loss of a batch shorter than the stages (1: GPipe, one micro-batch) or not divided by the
    micro-batches (3: three) equals one process's; fp32 loss sums, so 1e-6."""
    out = run_ranks(LAUNCHERS / "pipeline_short_eval_run.py", 2, str(batch), timeout=600)
    result = json.loads([line for line in out[0].splitlines() if line.startswith("{")][-1])
    assert result["microbatches"] == batch and result["schedule"] == ("GPipe" if batch == 1 else "1F1B")
    assert result["pipeline"] == pytest.approx(result["one_process"], rel=1e-6)
