"""MoEFSDPStrategy with real processes on CPU (gloo), compared against a one-process run.

Tolerances: the distributed runs reduce gradients in a different order than one process, so fp32
results differ by rounding (observed: equal to ~1e-7). ``RTOL = 1e-5`` leaves room for that over a
few AdamW steps while any real error shows: e.g. expert gradients off by the ``ep`` factor, a missed
gradient sync, or one lost balancing-bias update each move the loss by more than 1e-3. A resumed run
repeats exactly the same arithmetic as the uninterrupted one, so it must match to 1e-6.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moe_lightning import MoEConfig, MoELanguageModel, MoETransformer
from moe_lightning.parallel import MeshError, MeshLayout
from moe_lightning.loading import export_checkpoint
from moe_lightning.strategy import MoEFSDPStrategy
from tests.distributed import REPO_ROOT, clean_env, run_ranks

RUN = Path(__file__).with_name("strategy_run.py")
RTOL, RESUME_ATOL = 1e-5, 1e-6
# 4 optimizer steps of 2 micro-batches, global batch 4, gradients clipped to norm 1 (the first steps clip)
COMMON = ("--accumulate", "2", "--max-steps", "4", "--clip", "1.0")


def launch(tmp: Path, name: str, world_size: int, *args: str) -> dict:
    out = tmp / f"{name}.json"
    if world_size == 1:
        run_ranks(RUN, 1, *COMMON, *args, "--out", str(out))
    else:
        run_ranks(RUN, world_size, *COMMON, "--batch-size", str(4 // world_size), *args, "--out", str(out))
    return json.loads(out.read_text())


def losses(run: dict, first_batch: int = 0) -> list[float]:
    return [row["loss"] for row in run["batches"] if row["batch"] >= first_batch]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every multi-process run once; the tests below only compare what they recorded."""
    tmp = tmp_path_factory.mktemp("strategy")
    results = {"dir": tmp}
    results["single"] = launch(tmp, "single", 1, "--strategy", "single", "--batch-size", "4")
    results["fsdp"] = launch(tmp, "fsdp", 2, "--ckpt-dir", str(tmp / "fsdp_ckpt"))
    with pytest.raises(RuntimeError, match=r"rank 1 \(exit -9\)"):  # SIGKILL while committing step 4
        launch(tmp, "ep_killed", 2, "--ep", "2", "--ckpt-dir", str(tmp / "ep_ckpt"), "--kill-at-save", "3")
    results["ep_killed"] = json.loads((tmp / "ep_killed.json").read_text())
    results["ep_last_after_kill"] = torch.load(tmp / "ep_ckpt" / "last.ckpt" / "meta.pt", weights_only=False)
    results["ep_partial_left"] = (tmp / "ep_ckpt" / "step=4.ckpt.partial").is_dir()
    results["ep_resumed"] = launch(tmp, "ep_resumed", 2, "--ep", "2", "--resume", str(tmp / "ep_ckpt" / "last.ckpt"))
    results["one_from_two"] = launch(tmp, "one_from_two", 1, "--batch-size", "4",
                                     "--resume", str(tmp / "ep_ckpt" / "step=2.ckpt"))
    results["meta"] = launch(tmp, "meta", 2, "--ep", "2", "--meta-init", "--max-steps", "1", "--every", "1",
                             "--ckpt-dir", str(tmp / "meta_ckpt"))
    results["hsdp"] = launch(tmp, "hsdp", 4, "--replicate", "2",  # and the other sharding options
                             "--offload", "--keep-gathered", "--async-op", "--prefetch", "2")
    return results


def assert_all_close(records: list[dict], reference: list[dict], **tolerance) -> None:
    """Per-step norm dicts equal within tolerance; a missing record fails (zip alone would pass on [])."""
    assert len(records) == len(reference) > 0
    for record, expected in zip(records, reference):
        assert record == pytest.approx(expected, **tolerance)


def test_fsdp_two_processes_match_one_process(runs):
    assert losses(runs["fsdp"]) == pytest.approx(losses(runs["single"]), rel=RTOL)
    assert_all_close(runs["fsdp"]["grad_norms"], runs["single"]["grad_norms"], rel=RTOL)


def test_hsdp_2x2_with_offload_and_async_unshard_matches_one_process(runs):
    assert losses(runs["hsdp"]) == pytest.approx(losses(runs["single"]), rel=RTOL)
    assert_all_close(runs["hsdp"]["grad_norms"], runs["single"]["grad_norms"], rel=RTOL)


def test_expert_parallel_matches_ep1_losses_and_gradients(runs):
    """Gradient norms catch a wrong expert-gradient scale that AdamW's normalisation would hide in losses."""
    assert losses(runs["ep_killed"]) == pytest.approx(losses(runs["fsdp"]), rel=RTOL)
    assert_all_close(runs["ep_killed"]["grad_norms"], runs["fsdp"]["grad_norms"], rel=RTOL)
    assert all(row["calls"].get("all_to_all_single", 0) > 0 for row in runs["ep_killed"]["batches"])


def test_gradient_clipping_uses_one_global_norm_across_dense_and_expert_meshes(runs):
    """Lightning's own clipping (one process) is the reference; the strategy's norm spans both meshes."""
    for name in ("fsdp", "ep_killed", "hsdp"):
        assert_all_close(runs[name]["clipped_norms"], runs["single"]["clipped_norms"], rel=RTOL)
    first = runs["ep_killed"]["clipped_norms"][0]
    assert (first["other"] ** 2 + first["experts"] ** 2) ** 0.5 == pytest.approx(1.0, rel=1e-4)


def test_accumulation_reduce_scatters_only_on_the_last_micro_batch(runs):
    per_batch = [row["calls"].get("reduce_scatter_single", 0) + row["calls"].get("reduce_scatter_tensor", 0)
                 for row in runs["fsdp"]["batches"]]
    fsdp_units = 5  # embedding, 3 blocks, final norm + head
    assert per_batch == [0, fsdp_units] * 4


def test_sigkill_while_writing_keeps_last_good_checkpoint_and_resume_continues_exactly(runs):
    assert runs["ep_partial_left"]  # the interrupted write stayed in its .partial directory
    assert runs["ep_last_after_kill"]["global_step"] == 2  # last.ckpt still the complete step-2 checkpoint
    killed, resumed = runs["ep_killed"]["batches"], runs["ep_resumed"]["batches"]
    assert [r["batch"] for r in resumed] == [4, 5, 6, 7]  # same data order: the next unseen batches
    assert losses(runs["ep_resumed"]) == pytest.approx(losses(runs["ep_killed"], 4), abs=RESUME_ATOL)
    assert_all_close(runs["ep_resumed"]["grad_norms"], runs["ep_killed"]["grad_norms"][2:], abs=RESUME_ATOL)
    assert len(killed) == 8


def test_resume_two_processes_with_ep2_onto_one_process(runs):
    assert losses(runs["one_from_two"]) == pytest.approx(losses(runs["ep_killed"], 4), rel=RTOL)


def test_export_consolidates_a_sharded_checkpoint_for_inference(runs, tmp_path):
    out = export_checkpoint(runs["dir"] / "ep_ckpt" / "step=2.ckpt", tmp_path / "model.pt")
    exported = torch.load(out, weights_only=False)
    model = MoETransformer(MoEConfig(**exported["config"]))
    model.load_state_dict(exported["state_dict"], strict=True)
    assert exported["state_dict"]["layers.1.ffn.experts.w1_EFD"].shape[0] == model.config.num_experts
    with pytest.raises(FileExistsError, match="--overwrite"):
        export_checkpoint(runs["dir"] / "ep_ckpt" / "step=2.ckpt", out)


def test_meta_init_materialises_distinct_shards_with_the_model_initialisation(runs, tmp_path):
    """Built on meta and initialised shard by shard: shards (and ep ranks' experts) are not copies."""
    exported = torch.load(export_checkpoint(runs["dir"] / "meta_ckpt" / "step=1.ckpt", tmp_path / "m.pt"))
    weights = exported["state_dict"]  # after one AdamW step (lr 5e-3), small next to the init
    experts, embedding = weights["layers.1.ffn.experts.w1_EFD"], weights["tok_embeddings.weight"]

    def correlation(a, b):
        return torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1].abs().item()

    assert correlation(experts[0], experts[2]) < 0.2 and correlation(experts[1], experts[3]) < 0.2  # ep rank 0 vs 1
    assert correlation(embedding[:160], embedding[160:]) < 0.2  # shard 0 vs shard 1
    assert experts.std().item() == pytest.approx(0.02, rel=0.1)  # MoEConfig.init_std
    assert embedding.std().item() == pytest.approx(1.0, rel=0.1)
    assert losses(runs["meta"])[0] == pytest.approx(losses(runs["single"])[0], rel=0.05)


@pytest.mark.parametrize("world, kwargs, experts, match", [
    (4, dict(replicate_size=3), None, r"replicate_size=3 does not divide the world size 4"),
    (4, dict(shard_size=3), None, r"replicate_size=1 x strategy.shard_size=3 = 3, but the world size"),
    (4, dict(replicate_size=2, shard_size=4), None, r"= 8, but the world size .* is 4"),
    (4, dict(expert_parallel_size=3), None, r"expert_parallel_size=3 must divide strategy.shard_size=4"),
    (8, dict(replicate_size=2, expert_parallel_size=8), None, r"must divide strategy.shard_size=4"),
    (4, dict(expert_parallel_size=4), 6, r"must divide the model's num_experts=6: choose it from \[1, 2\]"),
    (4, dict(expert_parallel_size=0), None, r"expert_parallel_size=0: must be a positive integer"),
    (4, dict(shard_size="half"), None, r"shard_size='half': must be a positive integer or 'auto'"),
])
def test_invalid_mesh_names_the_argument_and_the_fix(world, kwargs, experts, match):
    args = {"replicate_size": 1, "shard_size": "auto", "expert_parallel_size": 1, **kwargs}
    with pytest.raises(MeshError, match=match):
        MeshLayout.resolve(world, args["replicate_size"], args["shard_size"], args["expert_parallel_size"], experts)


def test_default_mesh_is_plain_fsdp_over_all_ranks():
    layout = MeshLayout.resolve(8, 1, "auto", 1, 8)
    assert (layout.replicate, layout.shard, layout.ep) == (1, 8, 1)
    assert MeshLayout.resolve(8, 2, "auto", 2, 8).expert_shard == 2


@pytest.mark.parametrize("world, replicate, ep, experts, placement", [
    (8, 1, 1, 8, 0), (8, 2, 1, 8, 0), (8, 2, 2, 8, 0), (8, 1, 2, 16, 0),  # whole experts per rank
    (4, 1, 1, 6, 1), (8, 1, 2, 6, 1),  # 6 experts over 4 ranks, 3 local experts over 4 / 2 = 2 ranks
])
def test_expert_stacks_shard_on_the_expert_dimension_when_it_divides(world, replicate, ep, experts, placement):
    chosen, message = MeshLayout.resolve(world, replicate, "auto", ep, experts).expert_placement(experts)
    assert chosen.dim == placement
    assert ("fallback" in message) == (placement == 1)


def test_strategy_rejects_bad_arguments_at_construction():
    with pytest.raises(MeshError, match="strategy.expert_parallel_size=3 must divide strategy.shard_size=4"):
        MoEFSDPStrategy(shard_size=4, expert_parallel_size=3)
    with pytest.raises(MeshError, match="strategy.param_dtype='bfloat16'"):
        MoEFSDPStrategy(param_dtype="bfloat16")
    with pytest.raises(MeshError, match="strategy.prefetch_depth=-1"):
        MoEFSDPStrategy(prefetch_depth=-1)
    with pytest.raises(MeshError, match="save_distributed_checkpoint=False gathers .*moe-lightning export"):
        MoEFSDPStrategy(expert_parallel_size=2, save_distributed_checkpoint=False)


def test_trainer_fails_on_mesh_before_building_the_model():
    """With one device, replicate_size=2 cannot fit: the error comes before any process group or model."""
    import lightning as L
    saved_env = dict(os.environ)
    model = MoELanguageModel(MoEConfig(dim=64, n_layers=2, num_experts=4, expert_hidden=32, ffn_hidden=64))
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=MoEFSDPStrategy(replicate_size=2), logger=False,
                        enable_progress_bar=False, enable_checkpointing=False, max_steps=1)
    try:
        with pytest.raises(MeshError, match=r"replicate_size=2 does not divide the world size 1"):
            trainer.fit(model, train_dataloaders=[torch.zeros(2, 9, dtype=torch.long)])
        assert model.model is None and not torch.distributed.is_initialized()
    finally:
        os.environ.clear()
        os.environ.update(saved_env)


def test_gpu_benchmark_dry_run_runs_every_variant_on_cpu():
    """benchmarks/gpu_strategy.py stays runnable without a GPU: --dry-run trains each variant on CPU."""
    out = subprocess.run([sys.executable, str(REPO_ROOT / "benchmarks" / "gpu_strategy.py"), "--dry-run"],
                         env=clean_env(), cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert [(r["unshard_async_op"], r["prefetch_depth"]) for r in rows] == [(False, 1), (False, 2), (True, 1), (True, 2)]
    assert all(r["tokens_per_s"] > 0 for r in rows)


def test_resumable_sampler_keeps_one_global_order_for_any_world_size_and_skips_what_was_consumed():
    from moe_lightning.data import ResumableSampler
    data = list(range(100))
    order = list(ResumableSampler(data, 1, 0, seed=3))
    ranks = [list(ResumableSampler(data, 2, r, seed=3)) for r in (0, 1)]
    assert [i for pair in zip(*ranks) for i in pair] == order and sorted(order) == data
    resumed = ResumableSampler(data, 2, 1, seed=3)
    resumed.resume_epoch, resumed.resume_samples = 0, 40  # 40 samples consumed by all ranks together
    assert list(resumed) == order[41::2]
    resumed.set_epoch(1)  # only the interrupted epoch is shortened
    assert len(list(resumed)) == 50 and list(resumed) != ranks[1]
