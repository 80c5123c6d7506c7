"""MoEFSDPStrategy with real processes on CPU (gloo), compared against a one-process run.

Tolerances: the distributed runs reduce gradients in a different order than one process, so fp32
results differ by rounding (observed: equal to ~1e-7). ``RTOL = 1e-5`` leaves room for that over a
few AdamW steps while any real error shows: e.g. expert gradients off by the ``ep`` factor, a missed
gradient sync, or one lost balancing-bias update each move the loss by more than 1e-3. A resumed run
repeats exactly the same arithmetic as the uninterrupted one, so it must match to 1e-6.
"""

import json
import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from moe_lightning import MoEConfig, MoELanguageModel, MoETransformer
from moe_lightning.parallel import MeshError, MeshLayout
from moe_lightning.parallel.mesh import ParallelMesh
from moe_lightning.commands.loading import export_checkpoint
from moe_lightning.checkpoint.safe_load import CheckpointError
from moe_lightning.checkpoint.sharded import ShardedCheckpointer
from moe_lightning.parallel.clip import clip_grads_
from moe_lightning.training.strategy import MoEFSDPStrategy
from tests.support.distributed import LAUNCHERS, REPO_ROOT, clean_env, run_ranks
from tests.launchers.strategy_modes_run import CONFIG as MODES_CONFIG

RUN = LAUNCHERS / "strategy_run.py"
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
    with pytest.raises(RuntimeError, match=r"exit -9"):  # SIGKILL after writing step 4, before the commit
        launch(tmp, "ep_killed", 2, "--ep", "2", "--ckpt-dir", str(tmp / "ep_ckpt"), "--kill-at-save", "3")
    results["ep_killed"] = json.loads((tmp / "ep_killed.json").read_text())
    results["ep_last_after_kill"] = torch.load(tmp / "ep_ckpt" / "last.ckpt" / "meta.pt", weights_only=True)
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
    total = [(n["other"] ** 2 + n["experts"] ** 2) ** 0.5 for key in ("grad_norms", "clipped_norms")
             for n in runs["ep_killed"][key]]
    before, after = total[:len(total) // 2], total[len(total) // 2:]
    assert any(b > 1.0 for b in before)  # the run clips at least once (max_norm 1.0)
    assert after == pytest.approx([min(b, 1.0) for b in before], rel=1e-4)


def test_accumulation_reduce_scatters_every_micro_batch(runs):
    per_batch = [row["calls"].get("reduce_scatter_single", 0) + row["calls"].get("reduce_scatter_tensor", 0)
                 for row in runs["fsdp"]["batches"]]
    fsdp_units = 6  # embedding, 3 blocks, head, root (the final norm)
    assert per_batch == [fsdp_units, fsdp_units] * 4


def test_accumulated_gradients_stay_sharded_and_equal_plain_autograd_on_the_whole_batch():
    """Issue 27 (1): ``set_requires_gradient_sync(False)`` kept every unit's unsharded fp32 gradient across
    micro-batches (at 1t.yaml ~110 GB per GPU). Now, between micro-batches, every ``.grad`` is the local shard and
    FSDP holds no unsharded gradient; only ``accumulate_unsharded_grads=True`` holds them (4 bytes x every
    parameter here, ep 1). Either way the accumulated gradient of 2 ranks x 2 micro-batches equals plain autograd
    on one model over the 4 rows at once (fp32, sums in another order: observed 4e-7 of each tensor's largest
    entry; a lost or doubled micro-batch is off by 50 % or more)."""
    out = json.loads(run_ranks(REPO_ROOT / "tests" / "launchers" / "strategy_modes_run.py", 2, "accumulate")[0].splitlines()[-1])
    sharded, unsharded = out["sharded"], out["unsharded"]
    assert sharded["local_grads"] == sharded["params"] > 0 and sharded["unsharded_bytes"] == 0
    assert unsharded["local_grads"] == 0 and unsharded["unsharded_bytes"] == 4 * sum(
        p.numel() for p in MoETransformer(MODES_CONFIG).parameters())
    assert sharded["max_error"] < 1e-5 and unsharded["max_error"] < 1e-5


def test_plan_prices_unsharded_accumulation_as_every_dense_and_local_expert_gradient_in_fp32():
    """The bytes the accumulation test above measures at ep 1 (4 x every parameter), with ep 2 splitting experts."""
    from moe_lightning.planner.plan import Cluster, Workload, count_parameters, plan
    config = MoEConfig(vocab_size=64, dim=32, n_layers=3, n_heads=4, n_kv_heads=2, ffn_hidden=48, n_dense_layers=1,
                       num_experts=4, top_k=2, expert_hidden=40, mtp_layers=1)
    roles, _ = count_parameters(config)
    cluster, work = Cluster(nodes=1, gpus_per_node=4, expert_parallel_size=2), Workload(micro_batch=1, seq_len=8)
    row = "unsharded grad accumulation (fp32)"
    assert row not in plan(config, cluster, work)["memory"]["with_offload"]["gpu_bytes"]
    work.accumulate_unsharded_grads = True
    local = sum(roles.values()) - roles["expert_stack"] // 2  # every dense parameter, half the routed experts
    assert plan(config, cluster, work)["memory"]["with_offload"]["gpu_bytes"][row] == 4 * local


def test_validate_then_fit_in_one_process_when_lightning_picks_inference_mode():
    """Issue 27 (2): on NCCL Lightning runs a standalone ``validate`` under ``torch.inference_mode``; FSDP2's
    all-gather buffers became inference tensors and the next training step failed ("Inplace update to inference
    tensor outside InferenceMode"). The run makes Lightning's gloo test fail, validates, then fits (with a
    validation inside fit) on the same trainer."""
    out = json.loads(run_ranks(REPO_ROOT / "tests" / "launchers" / "strategy_modes_run.py", 2, "validate-fit")[0].splitlines()[-1])
    assert out["global_step"] == 3 and out["inference_mode"] == [False, False]  # standalone, then inside fit
    assert 0 < out["validated_loss"] < 10 and 0 < out["train_loss"] < 10  # ln(64) = 4.2 at the start


def test_sigkill_while_writing_keeps_last_good_checkpoint_and_resume_continues_exactly(runs):
    assert runs["ep_partial_left"]  # the interrupted write stayed in its .partial directory
    assert runs["ep_last_after_kill"]["global_step"] == 2  # last.ckpt still the complete step-2 checkpoint
    killed, resumed = runs["ep_killed"]["batches"], runs["ep_resumed"]["batches"]
    assert [r["batch"] for r in resumed] == [4, 5, 6, 7]  # same data order: the next unseen batches
    assert losses(runs["ep_resumed"]) == pytest.approx(losses(runs["ep_killed"], 4), abs=RESUME_ATOL)
    assert_all_close(runs["ep_resumed"]["grad_norms"], runs["ep_killed"]["grad_norms"][2:], abs=RESUME_ATOL)
    assert len(killed) == 8


@pytest.mark.slow  # two more 2-process fits; the synchronous kill and resume stay in the main suite
def test_asynchronous_checkpoints_survive_sigkill_mid_write_and_resume_exactly(tmp_path):
    """SIGKILL while last.ckpt of step 2 is written in the background (training goes on), then resume from the
    step-2 checkpoint, itself saving asynchronously; both against an uninterrupted run (its own, so the slow leg
    does not build the module's runs)."""
    reference = launch(tmp_path, "ep_reference", 2, "--ep", "2")
    ckpt_dir = tmp_path / "async_ckpt"
    with pytest.raises(RuntimeError, match=r"exit -9"):
        launch(tmp_path, "async_killed", 2, "--ep", "2", "--async-checkpoint", "--ckpt-dir", str(ckpt_dir),
               "--kill-at-save", "2")
    async_killed = json.loads((tmp_path / "async_killed.json").read_text())
    # killed while last.ckpt was being written: only the complete step-2 checkpoint is visible
    assert sorted(p.name for p in ckpt_dir.iterdir()) == ["last.ckpt.partial", "step=2.ckpt"]
    killed = async_killed["batches"]
    assert len(killed) >= 4  # trained through step 2 before dying; losses as with synchronous saves
    assert losses(async_killed) == pytest.approx(losses(reference)[:len(killed)], abs=RESUME_ATOL)
    async_resumed = launch(tmp_path, "async_resumed", 2, "--ep", "2", "--async-checkpoint", "--ckpt-dir",
                           str(ckpt_dir), "--resume", str(ckpt_dir / "step=2.ckpt"))
    resumed = async_resumed["batches"]
    assert [r["batch"] for r in resumed] == [4, 5, 6, 7]
    assert losses(async_resumed) == pytest.approx(losses(reference, 4), abs=RESUME_ATOL)
    # fit waited for its last background save: committed, nothing left half-written
    assert sorted(p.name for p in ckpt_dir.iterdir()) == ["last.ckpt", "step=2.ckpt", "step=4.ckpt"]
    assert torch.load(ckpt_dir / "last.ckpt" / "meta.pt", weights_only=True)["global_step"] == 4
    assert (ckpt_dir / "step=4.ckpt" / ".metadata").is_file()


def test_training_steps_issue_no_barrier_and_clipping_reads_nothing_back_to_the_host(runs):
    """The balancing-bias counts are all-reduced without Lightning's barrier; the clip scale stays a tensor
    (the hsdp run clips CPU-offloaded DTensor gradients)."""
    for name in ("fsdp", "ep_killed", "hsdp"):
        assert [row["barriers"] for row in runs[name]["batches"]] == [0] * 8
        assert runs[name]["clip_host_reads"] == 0
    assert runs["ep_killed"]["barriers_total"] > 0  # the counter sees barriers: those of checkpoint saves


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
    (4, dict(context_parallel_size=3), None, r"context_parallel_size=3 must divide strategy.shard_size=4 .*\[1, 2, 4\]"),
    (8, dict(replicate_size=2, context_parallel_size=8), None, r"context_parallel_size=8 must divide .*shard_size=4"),
    (4, dict(context_parallel_size=0), None, r"context_parallel_size=0: must be a positive integer"),
])
def test_invalid_mesh_names_the_argument_and_the_fix(world, kwargs, experts, match):
    args = {"replicate_size": 1, "shard_size": "auto", "expert_parallel_size": 1, "context_parallel_size": 1, **kwargs}
    with pytest.raises(MeshError, match=match):
        MeshLayout.resolve(world, args["replicate_size"], args["shard_size"], args["expert_parallel_size"], experts,
                           args["context_parallel_size"])


@pytest.mark.parametrize("cp, overrides, seq_len, match", [
    (4, {}, 36, r"context_parallel_size=4 splits each sequence into 8 .* 36 \(data.seq_len\) .* e\.g\. 40"),
    (1, dict(num_experts=6, expert_hidden=30, dim=40), 32, r"expert_parallel_size=1 leaves 6 experts per rank to shard "
                                                          r"over 4 ranks .*rows \[30, 40\]"),
])
def test_context_parallel_and_expert_shard_layouts_are_refused_before_any_group(cp, overrides, seq_len, match):
    """``resolve_layout`` (the strategy's ``setup_environment``, before process groups and the model): the data's
    sequence length and an expert shard FSDP2 cannot split; the balancing losses with MTP pass."""
    from moe_lightning.parallel.mesh import resolve_layout
    config = MoEConfig(**{"num_experts": 4, **overrides})
    with pytest.raises(MeshError if "seq_len" not in match else ValueError, match=match):
        resolve_layout(4, 1, "auto", 1, cp, config, seq_len)
    balanced = MoEConfig(num_experts=4, mtp_layers=2, aux_loss_coef=0.01, z_loss_coef=1e-3)
    assert resolve_layout(4, 1, "auto", 2, 2, balanced, 32).cp == 2


@pytest.mark.parametrize("cp, pp, replicas", [(2, 1, [0, 0, 1, 1]), (1, 2, [0, 1, 0, 1])])
def test_the_sampler_replicas_are_known_before_setup(cp, pp, replicas):
    """A resume's checks read the sampler's replicas before ``setup_environment`` builds the mesh (raising there
    broke every multi-process --ckpt_path relaunch): the same arithmetic from the arguments. A context-parallel
    group's ranks read one replica; so do a pipeline's stages (stage-major: ranks 0, 1 then 2, 3 are stage 0, 1)."""
    from lightning.fabric.plugins.environments import LightningEnvironment
    strategy = MoEFSDPStrategy(context_parallel_size=cp, pipeline_parallel_size=pp)
    strategy.cluster_environment = LightningEnvironment()
    strategy.cluster_environment.set_world_size(4)
    for rank, replica in enumerate(replicas):
        strategy.cluster_environment.set_global_rank(rank)
        assert strategy.distributed_sampler_kwargs == {"num_replicas": 4 // (cp * pp), "rank": replica}


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
    with pytest.raises(MeshError, match="strategy.param_dtype='bfloat8'"):  # bf16 and bfloat16 are both taken
        MoEFSDPStrategy(param_dtype="bfloat8")
    with pytest.raises(MeshError, match="strategy.prefetch_depth=-1"):
        MoEFSDPStrategy(prefetch_depth=-1)
    with pytest.raises(MeshError, match="save_distributed_checkpoint=False gathers .*moe-lightning export"):
        MoEFSDPStrategy(expert_parallel_size=2, save_distributed_checkpoint=False)
    with pytest.raises(MeshError, match="strategy.context_parallel_size=3 must divide strategy.shard_size=4"):
        MoEFSDPStrategy(shard_size=4, context_parallel_size=3)
    with pytest.raises(ValueError, match="strategy.ep_overlap_chunks=0: must be a positive integer"):
        MoEFSDPStrategy(ep_overlap_chunks=0)
    with pytest.raises(MeshError, match="strategy.dispatch_dtype='fp8': use null .* or 'float8_e4m3fn'"):
        MoEFSDPStrategy(dispatch_dtype="fp8")


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


@pytest.mark.extended
def test_gpu_benchmark_dry_run_runs_every_variant_on_cpu():
    """benchmarks/gpu_strategy.py stays runnable without a GPU: --dry-run trains the default variant on CPU in one
    process, as one GPU runs it (the other variants change nothing at world size 1: FSDP gathers nothing there)."""
    out = subprocess.run([sys.executable, str(REPO_ROOT / "benchmarks" / "gpu_strategy.py"), "--dry-run"],
                         env=clean_env(), cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert [(r["unshard_async_op"], r["prefetch_depth"]) for r in rows] == [(False, 1)]
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


# ---- in one process: clipping, buffer placement, checkpoint I/O ------------------------------------

@pytest.mark.parametrize("max_norm", [0.5, 100.0])  # clips / leaves the gradients as they are
def test_clip_matches_torch_clip_grad_norm_without_reading_back_to_the_host(max_norm, monkeypatch):
    """Reference: ``torch.nn.utils.clip_grad_norm_`` on copies (fp32; same sums in another order: 1e-6)."""
    torch.manual_seed(0)
    grads = [torch.randn(7, 5), torch.randn(3, 4, 2), torch.randn(11)]
    reference = [g.clone().requires_grad_() for g in grads]
    for r, g in zip(reference, grads):
        r.grad = g.clone()
    expected = torch.nn.utils.clip_grad_norm_(reference, max_norm)
    for name in ("item", "tolist", "cpu"):
        monkeypatch.setattr(torch.Tensor, name, lambda *a, _n=name, **k: pytest.fail(f"Tensor.{_n} in the clip"))
    total = clip_grads_(grads, max_norm, torch.device("cpu"))
    monkeypatch.undo()
    assert total.item() == pytest.approx(expected.item(), rel=1e-6) and total.item() > 1.0
    for g, r in zip(grads, reference):
        torch.testing.assert_close(g, r.grad, rtol=1e-6, atol=0)


def test_meta_init_with_cpu_offload_puts_buffers_by_the_compute_and_shards_in_host_memory(one_rank_group):
    """CPU cannot show CUDA vs host, so the meta device stands in for the compute device: buffers (the
    router's ``expert_bias``) must follow the compute device, sharded parameters the offload policy (host)."""
    config = MoEConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, num_experts=4, expert_hidden=32, ffn_hidden=64)
    module = MoELanguageModel(config)
    with torch.device("meta"):
        module.configure_model()
    strategy = MoEFSDPStrategy(meta_init=True, cpu_offload=True)
    strategy.parallel_devices = [torch.device("meta")]  # the stand-in compute device
    strategy._lightning_module = module
    strategy.parallel = ParallelMesh(MeshLayout.resolve(1, 1, "auto", 1, config.num_experts), "cpu")
    strategy._device_mesh = strategy.parallel.dense
    strategy._parallelize()
    buffers = dict(module.model.named_buffers())
    assert any(name.endswith("router.expert_bias") for name in buffers)
    assert {name: b.device.type for name, b in buffers.items()} == {name: "meta" for name in buffers}
    params = dict(module.model.named_parameters())
    assert {name: p.to_local().device.type for name, p in params.items()} == {name: "cpu" for name in params}
    assert strategy.param_device == torch.device("cpu")
    strategy.model_to_device()  # Lightning's next step: the module must report the compute device (batches, metrics)
    assert module.device == torch.device("meta")


class BlockingCheckpointer(ShardedCheckpointer):
    """Each write waits for ``release`` (so a test controls when the background write ends); ``fail`` makes the
    next write raise after waiting."""

    def __init__(self):
        super().__init__()
        self.release, self.started, self.fail = threading.Event(), threading.Event(), False

    def storage_writer(self, partial):
        writer, fail = super().storage_writer(partial), self.fail
        write = writer.write_data

        def blocked(plan, planner):
            self.started.set()
            assert self.release.wait(timeout=60)
            if fail:
                raise OSError("disk full")
            return write(plan, planner)
        writer.write_data = blocked
        return writer


def load_weight(path: Path) -> torch.Tensor:
    state = {"w": torch.zeros(4, 3)}
    dcp.load(state, checkpoint_id=path)
    return state["w"]


def test_async_save_returns_before_writing_and_commits_what_it_staged(tmp_path):
    checkpointer, path = BlockingCheckpointer(), tmp_path / "a.ckpt"
    weight = torch.randn(4, 3)
    staged = weight.clone()
    checkpointer.save({"w": weight}, {"global_step": 1}, path, set(), None, background=True)
    assert checkpointer.started.wait(timeout=60)  # the write runs in the background, blocked...
    assert not path.exists() and checkpointer.pending_path == path  # ...and nothing is visible yet
    weight.add_(1.0)  # training goes on and changes the parameters in place
    checkpointer.poll()
    assert not path.exists()
    checkpointer.release.set()
    checkpointer.wait()
    assert path.is_dir() and not path.with_name("a.ckpt.partial").exists()
    torch.testing.assert_close(load_weight(path), staged, rtol=0, atol=0)  # the state at save time
    assert torch.load(path / "meta.pt", weights_only=True) == {"global_step": 1}


def test_second_async_save_waits_for_the_first(tmp_path):
    checkpointer = BlockingCheckpointer()
    checkpointer.save({"w": torch.ones(4, 3)}, {}, tmp_path / "first", set(), None, background=True)
    second = threading.Thread(target=checkpointer.save, args=({"w": torch.full((4, 3), 2.0)}, {},
                                                              tmp_path / "second", set(), None, True))
    second.start()
    second.join(timeout=1.0)
    assert second.is_alive() and not (tmp_path / "second.partial").exists()  # still waiting for the first
    checkpointer.release.set()
    second.join(timeout=60)
    checkpointer.wait()
    assert load_weight(tmp_path / "first").eq(1).all() and load_weight(tmp_path / "second").eq(2).all()


def test_failed_async_save_raises_at_the_next_poll_and_keeps_the_previous_checkpoint(tmp_path):
    checkpointer, path = BlockingCheckpointer(), tmp_path / "last.ckpt"
    checkpointer.release.set()
    checkpointer.save({"w": torch.ones(4, 3)}, {}, path, set(), None, background=True)
    checkpointer.wait()
    checkpointer.fail = True
    checkpointer.save({"w": torch.zeros(4, 3)}, {}, path, set(), None, background=True)
    with pytest.raises(CheckpointError, match=r"Asynchronous checkpoint .*last.ckpt failed .*disk full"):
        while True:  # what the strategy does at every training batch
            checkpointer.poll()
    checkpointer.poll()  # reported once
    assert load_weight(path).eq(1).all()


class WritesMarker:
    """Unpickling this calls ``open(marker, "w")``, which creates the marker file: code run from a checkpoint."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return open, (str(self.marker), "w")


def test_resume_and_export_refuse_a_checkpoint_that_would_run_code(runs, tmp_path):
    marker = tmp_path / "code_ran"
    evil_dir, evil_file = tmp_path / "evil.ckpt", tmp_path / "evil_single.ckpt"
    shutil.copytree(runs["dir"] / "ep_ckpt" / "step=2.ckpt", evil_dir)
    meta = torch.load(evil_dir / "meta.pt", weights_only=True)
    meta["hyper_parameters"]["extra"] = WritesMarker(marker)
    torch.save(meta, evil_dir / "meta.pt")
    torch.save({"state_dict": {}, "extra": WritesMarker(marker)}, evil_file)
    with pytest.raises(CheckpointError, match=r"Refusing to load .*evil.ckpt/meta.pt.*could run code"):
        export_checkpoint(evil_dir, tmp_path / "out.pt")
    with pytest.raises(RuntimeError) as failed:  # resume through Trainer.fit, in a real (one-rank) run
        launch(tmp_path, "evil", 1, "--resume", str(evil_file))
    # (Lightning 2.6.0's traceback puts a line break after the exception's name; 2.6.6's a space)
    assert re.search(rf"CheckpointError:\s+Refusing to load {re.escape(str(evil_file))}", str(failed.value))
    # Trainer.fit resumes through this call; for a directory it refuses before it needs the model
    with pytest.raises(CheckpointError, match=r"Refusing to load .*evil.ckpt/meta.pt.*it names"):
        MoEFSDPStrategy().load_checkpoint(evil_dir)
    assert not marker.exists() and not (tmp_path / "out.pt").exists()
    torch.load(evil_file, weights_only=False)  # the planted file really would have run code
    assert marker.exists()


def test_single_file_checkpoint_is_plain_data_and_the_cli_resumes_from_it(tmp_path):
    """LightningCLI re-parses the model's hyperparameters from a single file: the config dict must parse."""
    from moe_lightning.commands.main import run
    common = ["--config", str(REPO_ROOT / "configs" / "tiny.yaml"), f"--trainer.default_root_dir={tmp_path}",
              "--trainer.logger=false", "--trainer.limit_val_batches=0", "--trainer.enable_progress_bar=false",
              "--data.init_args.max_tokens=100000", "--data.init_args.batch_size=2",
              "--model.init_args.config.n_layers=2"]
    path = tmp_path / "one.ckpt"
    run(["fit", *common, "--trainer.max_steps=1", "--trainer.enable_checkpointing=false"]).trainer.save_checkpoint(path)
    checkpoint = torch.load(path, weights_only=True)
    config = checkpoint["hyper_parameters"]["config"]
    assert isinstance(config, dict) and config["n_layers"] == 2
    assert MoELanguageModel.load_from_checkpoint(path).config == MoEConfig(**config)
    cli = run(["fit", *common, "--trainer.max_steps=2", f"--ckpt_path={path}"])
    assert cli.trainer.global_step == 2 and cli.model.config == MoEConfig(**config)


def test_saving_metadata_that_is_not_plain_data_fails_before_writing(tmp_path):
    marker = tmp_path / "code_ran"
    with pytest.raises(CheckpointError, match=r"metadata for .*x.ckpt must be plain data .*it names"):
        ShardedCheckpointer().save({"w": torch.ones(2)}, {"extra": WritesMarker(marker)}, tmp_path / "x.ckpt",
                                   set(), None)
    assert list(tmp_path.iterdir()) == []  # no directory, no marker


@pytest.mark.extended
def test_fp8_dispatch_through_the_strategy_stays_near_the_training_dtype_and_sends_fewer_bytes(tmp_path):
    """``MoEFSDPStrategy(dispatch_dtype="float8_e4m3fn")`` reaches the dispatcher: 2 ranks at EP 2, 6 AdamW steps
    against the same run in fp32. e4m3 keeps 3 mantissa bits (a scale per 128 columns), so the dispatched rows
    carry ~3 % error; the losses stay within 1e-2 relative (measured 2.1e-3) yet differ (so FP8 really ran),
    and the exchanges put fewer bytes on the wire (the combine and the gradients stay fp32)."""
    runs = {}
    for name, extra in (("fp32", ()), ("fp8", ("--dispatch-dtype", "float8_e4m3fn"))):
        out = tmp_path / f"{name}.json"
        run_ranks(LAUNCHERS / "cp_fit_run.py", 2, "--ep", "2", "--max-steps", "6", *extra, "--out", str(out))
        runs[name] = json.loads(out.read_text())
    fp32, fp8 = ([row["loss"] for row in runs[n]["batches"]] for n in ("fp32", "fp8"))
    assert len(fp8) == len(fp32) == 6
    assert fp8 == pytest.approx(fp32, rel=1e-2) and fp8 != pytest.approx(fp32, rel=1e-6)
    sent = {n: sum(row["bytes"]["all_to_all_single"] for row in runs[n]["batches"]) for n in runs}
    assert sent["fp8"] < 0.9 * sent["fp32"]
