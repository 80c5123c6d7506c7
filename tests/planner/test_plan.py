"""`moe-lightning plan`: memory and throughput formulas against hand counts and measured saved tensors."""

import contextlib
import dataclasses
import io
import json
import math

import pytest
import torch
import yaml

from moe_lightning.commands.main import run
from moe_lightning.planner.flops import training_flops_per_token
from moe_lightning.model import MoEConfig, MoETransformer
from moe_lightning.planner.plan import GiB, Cluster, Workload, count_parameters, plan
from tests.support.distributed import REPO_ROOT

TINY = MoEConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=16, ffn_hidden=48,
                 n_dense_layers=1, num_experts=4, top_k=2, expert_hidden=16, n_shared_experts=1)
# By hand: embedding and head 64·32 each; norms 2·32 per block + 32 final; attention wq, wo 32·32 and wk, wv
# 32·16; dense FFN 3·32·48; router 32·4; routed experts 3·4·32·16; shared expert 3·32·16.
ATTENTION = 2 * 32 * 32 + 2 * 32 * 16
ROLES = {"embedding": 2048, "head": 2048, "norm": 2 * 64 + 32, "router": 128, "expert_stack": 6144,
         "hidden_matrix": 2 * ATTENTION + 4608 + 1536}
TOTAL = sum(ROLES.values())
ONE_T = str(REPO_ROOT / "configs" / "1t.yaml")
SIXTEEN_B = str(REPO_ROOT / "configs" / "16b.yaml")


def tiny_plan(**workload):
    cluster = Cluster(nodes=2, gpus_per_node=2, gpu_memory_gib=1.0, expert_parallel_size=2)
    return plan(TINY, cluster, Workload(micro_batch=2, seq_len=8, **workload))


def test_parameter_counts_by_role_and_unit():
    roles, units = count_parameters(TINY)
    assert roles == ROLES and TOTAL == 22816
    # the head a unit of its own, the final norm in the root; under expert parallelism the experts are a unit
    dense_block, moe_block = 64 + ATTENTION + 4608, 64 + ATTENTION + 128 + 1536
    assert [(u.name, u.stage, u.numel) for u in units] == [
        ("tok_embeddings", 0, 2048), ("layers.0", 1, dense_block), ("layers.1", 2, moe_block + 6144),
        ("output", 3, 2048), ("", None, 32)]
    _, units = count_parameters(TINY, expert_parallel=True)
    assert [(u.name, u.stage, u.experts, u.numel) for u in units][2:4] == [
        ("layers.1.ffn.experts", 2, True, 6144), ("layers.1", 2, False, moe_block)]


def real_units(model: MoETransformer, expert_parallel: bool) -> tuple[dict[str, int], list[list[str]]]:
    """Shard ``model`` (meta device, one gloo rank) with the strategy's own ``apply_fsdp``; return the elements each
    FSDP unit manages, read from FSDP2's own parameter groups (by the unit's module path, ``""`` for the root), and
    the stages ``apply_fsdp`` returns, by path."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import Shard

    from moe_lightning.parallel.fsdp import FSDPPolicy, apply_fsdp

    mesh = init_device_mesh("cpu", (1,))
    policy = FSDPPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, reshard_after_forward=True,
                        cpu_offload=False, expert_placement=Shard(0))
    stages = apply_fsdp(model, mesh, mesh if expert_parallel else None, policy)
    path = {id(m): name for name, m in model.named_modules()}
    managed = {}
    for module in model.modules():
        if isinstance(module, FSDPModule):
            group = module._get_fsdp_state()._fsdp_param_group  # FSDP2's record of the unit's parameters
            managed[path[id(module)]] = sum(p._orig_size.numel() for p in group.fsdp_params) if group else 0
    return managed, [[path[id(m)] for m in stage] for stage in stages]


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("ep", [1, 2])
def test_plan_prices_the_units_fsdp_really_builds(one_rank_group, tied, ep):
    """The all-gather and reduce-scatter rows and the unsharded accumulation come from the units ``apply_fsdp``
    shards, counted by FSDP2 itself: the head apart from the final norm, the MTP module with its block, and a tied
    embedding/head weight once, in the root, gathered the whole step."""
    config = MoEConfig(**{**TINY.__dict__, "tie_embeddings": tied, "mtp_layers": 1})
    with torch.device("meta"):
        model = MoETransformer(config)
    managed, stages = real_units(model, expert_parallel=ep > 1)
    assert sum(managed.values()) == model.num_parameters()  # every parameter in one unit, the tied weight once
    root = managed.pop("")
    assert root == (64 * 32 if tied else 0) + 32  # the final norm (and the shared embedding/head)
    assert ("output" in managed) == ("tok_embeddings" in managed) == (not tied)
    gathered = [sum(managed[name] / (ep if name.endswith("experts") else 1) for name in stage) for stage in stages]
    assert sorted(managed) == sorted(name for stage in stages for name in stage)
    cluster = Cluster(nodes=1, gpus_per_node=2, gpu_memory_gib=1.0, expert_parallel_size=ep)
    gpu = plan(config, cluster, Workload(micro_batch=2, seq_len=8, accumulate_unsharded_grads=True))[
        "memory"]["without_offload"]["gpu_bytes"]
    assert gpu["all-gather buffers (bf16)"] == 2 * 2 * max(gathered) + 2 * root  # current + 1 prefetched, root
    assert gpu["reduce-scatter buffers"] == 6 * max(*gathered, root)
    assert gpu["unsharded grad accumulation (fp32)"] == 4 * (sum(gathered) + root)


def test_plan_prints_units_that_fit_the_model(capsys):
    """configs/tiny.yaml printed "total 0.00 B" parameters and "0.0 GFLOP per token" (issue 33, 7)."""
    from moe_lightning.planner.flops import parameter_counts
    from moe_lightning.planner.run_config import load_model_config

    tiny = str(REPO_ROOT / "configs" / "tiny.yaml")
    counts = parameter_counts(load_model_config(tiny))
    run(["plan", "--config", tiny])
    lines = capsys.readouterr().out.splitlines()
    assert 1e6 <= counts["total"] < 1e7 and 1e5 <= counts["active"] < 1e6
    assert lines[0] == f"parameters        total {counts['total'] / 1e6:.2f} M   active {counts['active'] / 1e3:.2f} K"
    flops = training_flops_per_token(load_model_config(tiny), 128)
    assert 1e6 <= flops < 1e9 and lines[1] == f"training FLOPs    {flops / 1e6:.1f} MFLOP per token at seq_len 128"
    assert "per-GPU memory (MiB)" in lines[lines.index("") + 1]  # its rows would all read 0.00 or 0.01 GiB
    boundary = 4 * 16 * 128 * 128 * 2  # layers · batch · seq · dim · bf16
    assert f"boundary activations {boundary / 2**20:.1f} MiB per GPU (in host memory with activation offload)" in lines


def test_memory_formulas_adamw_and_muon():
    adamw, muon = tiny_plan(optimizer="adamw"), tiny_plan(optimizer="muon")
    assert adamw["parameters"]["active"] == TOTAL - 6144 + 6144 * 2 // 4
    gpu = adamw["memory"]["without_offload"]["gpu_bytes"]
    shard = 4  # 2 nodes x 2 GPUs, one replica
    assert gpu["sharded parameters (fp32)"] == gpu["gradients (fp32)"] == 4 * TOTAL // shard
    assert gpu["optimizer state (adamw)"] == 8 * TOTAL // shard
    muon_params = ROLES["hidden_matrix"] + ROLES["expert_stack"]  # one momentum; the rest keep AdamW's two
    assert muon["memory"]["without_offload"]["gpu_bytes"]["optimizer state (muon)"] == \
        (4 * muon_params + 8 * (TOTAL - muon_params)) // shard
    assert gpu["boundary activations"] == 2 * 2 * 8 * 32 * 2  # layers · micro-batch · seq · dim · bf16
    largest_unit = 64 + ATTENTION + 128 + 1536 + 6144 // 2  # the MoE block, experts split over ep=2
    assert gpu["all-gather buffers (bf16)"] == 2 * 2 * largest_unit + 2 * 32  # current + one prefetched, root
    assert gpu["reduce-scatter buffers"] == 6 * largest_unit
    assert gpu["loss working set"] == 12 * 64 * 16


def test_peak_counted_by_hand_from_the_config():
    """The peak against a number counted from the config, not from plan's own rows (issue 41, item 6). TINY with a
    4,096-word vocabulary, so the loss's working set (unchunked) is the larger transient and the block's drops out;
    AdamW, one FSDP group of 2 x 2 GPUs, no expert parallelism, micro-batch 2 x 8 tokens, no reserve:
    - parameters 22,816 - 2 x 64·32 + 2 x 4,096·32 = 280,864: sharded fp32 4·P/4, gradients 4·P/4, AdamW 8·P/4;
    - boundary activations: 2 layers x 16 tokens x 32 x 2 B = 2,048;
    - loss: 12 B x 4,096 x 16 tokens = 786,432;
    - all-gather: the largest unit is the embedding (4,096·32 = 131,072; the MoE block holds 10,944), gathered in
      bf16, with one prefetched: 2 x 2 x 131,072, and the root's final norm 2 x 32: 524,352;
    - reduce-scatter: 6 x 131,072 = 786,432."""
    config = MoEConfig(**{**TINY.__dict__, "vocab_size": 4096})
    result = plan(config, Cluster(nodes=2, gpus_per_node=2, gpu_memory_gib=1.0),
                  Workload(micro_batch=2, seq_len=8, reserve_gib=0))["memory"]["without_offload"]
    assert result["gpu_bytes"]["block recompute working set"] < result["gpu_bytes"]["loss working set"]
    P = 280_864
    assert result["gpu_peak_bytes"] == P + P + 2 * P + 2_048 + 786_432 + 524_352 + 786_432 == 3_222_720


def pinned_shards(shard: int) -> int:
    """Pinned host bytes of TINY's fp32 parameter shards (dim 0 split ``shard`` ways), a power-of-two block each."""
    with torch.device("meta"):
        shards = [math.ceil(p.shape[0] / shard) * p[0].numel() * 4 for p in MoETransformer(TINY).parameters()]
    pinned = sum(2 ** math.ceil(math.log2(b)) for b in shards)
    assert pinned > sum(shards)  # the rounding shows at this size
    return pinned


def test_cpu_and_activation_offload_move_bytes_to_host():
    result = tiny_plan(cpu_offload=True, offload_prefetch=0)  # ActivationOffload(prefetch=0)
    without, with_ = result["memory"]["without_offload"], result["memory"]["with_offload"]
    assert "gradients (fp32)" not in without["gpu_bytes"]
    # parameters and gradients pinned: each fp32 shard (dim 0 split 4 ways) in a power-of-two block; AdamW's
    # state pageable
    pinned = pinned_shards(4)
    assert without["host_bytes"] == 2 * pinned + 8 * TOTAL // 4
    assert with_["gpu_bytes"]["boundary activations"] == 2 * 8 * 32 * 2  # only the block in backward
    assert with_["host_bytes"] == 2 * pinned + 8 * TOTAL // 4 + 1 * 2 * 8 * 32 * 2  # the last block's input stays


def test_async_checkpoint_stages_the_sharded_state_in_host_memory(tmp_path, capsys):
    without = tiny_plan()["memory"]["with_offload"]
    staged = tiny_plan(async_checkpoint=True)["memory"]["with_offload"]
    assert staged["host_bytes_by_row"]["async checkpoint staging"] == (4 + 8) * TOTAL // 4  # fp32 shards + AdamW
    assert staged["host_bytes"] == without["host_bytes"] + (4 + 8) * TOTAL // 4
    config = tmp_path / "async.yaml"
    config.write_text(yaml.safe_dump({"trainer": {"strategy": {"class_path": "moe_lightning.training.strategy.MoEFSDPStrategy",
                                                               "init_args": {"async_checkpoint": True}}},
                                      "model": {"init_args": {"config": {"vocab_size": 64}}}}))
    run(["plan", "--config", str(config), "--json"])
    assert json.loads(capsys.readouterr().out)["inputs"]["async_checkpoint"] == [True, "config"]


def test_throughput_from_the_step_time():
    result = tiny_plan(mfu=0.5)
    assert result["flops_per_token"] == training_flops_per_token(TINY, 8)
    assert result["step_time"]["parts"]["compute"] == pytest.approx(16 * result["flops_per_token"] / (0.5 * 989e12))
    assert result["tokens_per_s_per_gpu"] == pytest.approx(16 / result["step_seconds"])
    assert result["step_seconds"] == pytest.approx(sum(result["step_time"]["parts"].values()))


def test_one_trillion_on_384_gh200_matches_the_reference_run():
    out = io.StringIO()
    # GH200: 96 GB HBM3 of which ~95 GiB usable; 120 GB LPDDR5X = 111 GiB of host memory per GPU
    with contextlib.redirect_stdout(out):
        run(["plan", "--config", ONE_T, "--nodes", "96", "--gpus-per-node", "4", "--gpu-memory", "95",
              "--host-memory", "111", "--seq-len", "65536", "--expert-parallel-size", "96", "--cpu-offload",
              "--loss-chunk", "4096", "--optimizer", "muon", "--json"])
    result = json.loads(out.getvalue())
    assert abs(result["boundary_activations_bytes"] / GiB / 55 - 1) < 0.10  # 61 · 65,536 · 7168 · 2 B = 53.4 GiB
    memory = result["memory"]
    assert memory["with_offload"]["fits"]
    # Offloading moves all but (1 + prefetch) of the 61 boundary activations (53.4 GiB) off the GPU.
    saved = memory["without_offload"]["gpu_peak_bytes"] - memory["with_offload"]["gpu_peak_bytes"]
    assert saved == 59 * 65536 * 7168 * 2
    # each offloaded boundary activation (896 MiB) is a pinned block of 1 GiB: 60 GiB, not 52.5
    assert memory["with_offload"]["host_bytes_by_row"]["boundary activations (pinned)"] == 60 * GiB
    assert abs(result["parameters"]["total"] / 951.9e9 - 1) < 0.01


def test_table_output_and_clear_errors(capsys):
    run(["plan", "--config", ONE_T, "--gpu-memory", "95", "--host-memory", "111"])
    table = capsys.readouterr().out
    assert "total 948.35 B   active 37.60 B" in table
    assert "96 x 4 GPUs = 384" in table and "ep=96" in table  # trainer.num_nodes, devices and the strategy's ep
    assert "boundary activations 53.4 GiB per GPU" in table
    rows = ["boundary activations", "block recompute working set", "loss working set", "all-gather buffers (bf16)",
            "reduce-scatter buffers", "runtime reserve", "peak (larger working set only)",
            "host: sharded params (fp32, pinned)", "host: gradients (fp32, pinned)", "host: optimizer state (muon)",
            "host: boundary activations (pinned)", "host memory per GPU", "fits"]
    assert all(any(line.startswith(row + " ") for line in table.splitlines()) for row in rows)
    # 1t.yaml runs ActivationOffload with FSDP CPU offload: that column is the verdict, and it fits
    assert "act. offload*" in table and "verdict           fits as configured" in table
    assert "tokens/s per GPU" in table
    with pytest.raises(SystemExit):
        run(["plan", "--config", ONE_T, "--expert-parallel-size", "5"])
    assert "strategy.expert_parallel_size=5 must divide strategy.shard_size=384" in capsys.readouterr().err


def write_config(tmp_path, **sections) -> str:
    """A LightningCLI YAML around the TINY model, with the given trainer/model/data sections merged in."""
    data = {"trainer": sections.get("trainer", {}),
            "model": {"init_args": {"config": {k: getattr(TINY, k) for k in (
                "vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "max_seq_len", "ffn_hidden",
                "n_dense_layers", "num_experts", "top_k", "expert_hidden", "n_shared_experts")},
                **sections.get("model", {})}},
            "data": {"init_args": sections.get("data", {})}}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def test_cpu_offload_with_muon_prices_the_pinned_staging_ring():
    """Newton–Schulz of host matrices stages them through pinned buffers: two fp32 inputs and two bf16 outputs per
    distinct shape the rank orthogonalizes whole, each a power-of-two block; row-sharded matrices are not staged."""
    host = tiny_plan(cpu_offload=True, optimizer="muon")["memory"]["without_offload"]["host_bytes_by_row"]
    # shard 4, ep 2: one whole local expert per rank, [1, 16, 32] and [1, 32, 16]: 2048 B fp32, 1024 B bf16
    assert host["Muon host staging (pinned)"] == 2 * 2 * (2048 + 1024)
    assert "Muon host staging (pinned)" not in tiny_plan(cpu_offload=True)["memory"]["without_offload"][
        "host_bytes_by_row"]  # AdamW: nothing staged
    unsharded = plan(TINY, Cluster(nodes=1, gpus_per_node=2, gpu_memory_gib=1.0, replicate_size=2, shard_size=1),
                     Workload(micro_batch=2, seq_len=8, cpu_offload=True, optimizer="muon"))
    # shard 1: the hidden matrices are whole too. (elements, fp32 block, bf16 block) per distinct shape:
    # wq/wo (32, 32), wk/wv and the shared expert (16, 32) (32, 16), dense FFN (48, 32) (32, 48), experts
    blocks = [(4096, 2048), (2048, 1024), (2048, 1024), (8192, 4096), (8192, 4096), (8192, 4096), (8192, 4096)]
    assert unsharded["memory"]["without_offload"]["host_bytes_by_row"]["Muon host staging (pinned)"] == \
        sum(2 * (a + b) for a, b in blocks)


def plan_json(capsys, *argv: str) -> dict:
    run(["plan", *argv, "--json"])
    return json.loads(capsys.readouterr().out)


RUN_CONFIG = dict(
    trainer={"num_nodes": 2, "devices": 2,
             "strategy": {"class_path": "moe_lightning.training.strategy.MoEFSDPStrategy",
                          "init_args": {"replicate_size": 2, "expert_parallel_size": 2, "cpu_offload": True,
                                        "prefetch_depth": 2}},
             "callbacks": [{"class_path": "moe_lightning.training.callbacks.MoEThroughputMonitor"},
                           {"class_path": "moe_lightning.training.callbacks.ActivationOffload", "init_args": {"prefetch": 0}}]},
    model={"loss_chunk_size": 5, "optimizer": {"class_path": "moe_lightning.optim.Muon", "init_args": {"lr": 0.02}}},
    data={"batch_size": 3, "seq_len": 12})


def test_plan_of_a_yaml_uses_the_configs_mesh_offload_batch_chunk_and_optimizer(tmp_path, capsys):
    result = plan_json(capsys, "--config", write_config(tmp_path, **RUN_CONFIG))
    c, w = result["cluster"], result["workload"]
    assert (c["nodes"], c["gpus_per_node"], c["replicate_size"], c["shard_size"], c["expert_parallel_size"]) == \
        (2, 2, 2, 2, 2)
    assert (w["micro_batch"], w["seq_len"], w["optimizer"], w["cpu_offload"], w["prefetch_depth"]) == \
        (3, 12, "muon", True, 2)
    assert (w["loss_chunk"], w["activation_offload"], w["offload_prefetch"]) == (5, True, 0)
    assert [name for name, (_, origin) in result["inputs"].items() if origin != "config"] == [
        "gpu", "gpu_memory_gib", "peak_tflops", "shard_size", "context_parallel_size", "offload_mtp",
        "async_checkpoint", "accumulate_unsharded_grads", "ep_overlap_chunks", "dispatch_dtype", "ep_imbalance"]
    # and the numbers follow: shard group of 2, 36 tokens, chunked loss, 1 + 0 boundary blocks kept on the GPU
    gpu, host = result["memory"]["with_offload"]["gpu_bytes"], result["memory"]["with_offload"]["host_bytes"]
    assert gpu["loss working set"] == 8 * 64 * 5 + 6 * 64 * 32
    assert gpu["boundary activations"] == 36 * 32 * 2
    muon = ROLES["hidden_matrix"] + ROLES["expert_stack"]
    # pinned parameter and gradient shards, Muon's state / 2, block 0's input (2304 B) in a 4096 B pinned block,
    # Muon's staging ring: 2 whole local experts [2, 16, 32] and [2, 32, 16], 2 fp32 (4 KiB) + 2 bf16 (2 KiB) each
    assert host == 2 * pinned_shards(2) + (4 * muon + 8 * (TOTAL - muon)) // 2 + 4096 + 2 * 2 * (4096 + 2048)
    largest_unit = 64 + ATTENTION + 128 + 1536 + 6144 // 2
    assert gpu["all-gather buffers (bf16)"] == 3 * 2 * largest_unit + 2 * 32  # prefetch_depth 2; the root's norm
    assert result["configured"] == "with_offload" and result["fits"] == result["memory"]["with_offload"]["fits"]


def test_flags_override_the_config(tmp_path, capsys):
    result = plan_json(capsys, "--config", write_config(tmp_path, **RUN_CONFIG), "--expert-parallel-size", "1",
                       "--micro-batch", "1", "--seq-len", "16", "--no-cpu-offload", "--no-activation-offload",
                       "--loss-chunk", "0", "--optimizer", "adamw", "--prefetch-depth", "0")
    c, w = result["cluster"], result["workload"]
    assert c["expert_parallel_size"] == 1 and c["replicate_size"] == 2  # overridden / still the config's
    assert (w["micro_batch"], w["seq_len"], w["cpu_offload"], w["loss_chunk"], w["optimizer"]) == \
        (1, 16, False, None, "adamw")
    assert result["inputs"]["expert_parallel_size"] == [1, "flag"]
    assert result["inputs"]["replicate_size"] == [2, "config"]
    gpu = result["memory"]["without_offload"]["gpu_bytes"]
    assert gpu["loss working set"] == 12 * 64 * 16  # unchunked over all 16 tokens
    assert gpu["optimizer state (adamw)"] == 8 * TOTAL // 2
    assert result["configured"] == "without_offload"


def test_sixteen_b_config_plans_its_expert_parallelism_and_batch(capsys):
    """Before: ep=1 and micro-batch 1 while the config runs ep=8 and batch 4."""
    result = plan_json(capsys, "--config", SIXTEEN_B)
    assert result["cluster"]["expert_parallel_size"] == 8 and result["cluster"]["world_size"] == 8
    assert (result["workload"]["micro_batch"], result["workload"]["seq_len"]) == (4, 4096)
    assert result["workload"]["loss_chunk"] == 4096 and not result["workload"]["activation_offload"]
    run(["plan", "--config", SIXTEEN_B, "--gpu-memory", "40"])
    table = capsys.readouterr().out
    assert "from the config   gpus_per_node=8 expert_parallel_size=8 micro_batch=4" in table
    assert [line for line in table.splitlines() if line.startswith("from flags")] == [
        "from flags        gpu_memory_gib=40.0"]  # the one flag given; the mesh and batch are the config's


def test_an_optimizer_plan_cannot_price_is_refused(tmp_path, capsys):
    path = write_config(tmp_path, model={"optimizer": {"class_path": "torch.optim.SGD"}})
    with pytest.raises(SystemExit):
        run(["plan", "--config", path])
    assert "torch.optim.SGD is neither AdamW nor Muon; pass --optimizer adamw" in capsys.readouterr().err
    assert plan_json(capsys, "--config", path, "--optimizer", "adamw")["workload"]["optimizer"] == "adamw"


def test_plan_says_which_gpu_it_assumed_and_where_each_default_came_from(capsys):
    run(["plan", "--config", SIXTEEN_B])
    lines = capsys.readouterr().out.splitlines()
    assert "gpu               H100: 80 GiB, 989 TFLOP/s dense bf16 peak (--gpu, --gpu-memory, --peak-tflops)" in lines
    defaults = next(line for line in lines if line.startswith("from defaults"))
    assert "gpu=H100 gpu_memory_gib=80.0 peak_tflops=989.0 " in defaults
    # the auto shard size is reported as the mesh resolves it, as on the cluster line
    assert "shard_size=8 (auto: every GPU of a replica)" in defaults and "None" not in defaults
    assert any(line.startswith("cluster ") and "shard_size=8 " in line for line in lines)
    # 16b.yaml uses no host memory: nothing to check, and no "0.00 GiB not checked"
    verdict = next(line for line in lines if line.startswith("verdict"))
    assert verdict.endswith("GPU peak 40.19 of 80 GiB, no host memory used") and "not checked" not in verdict

    run(["plan", "--config", SIXTEEN_B, "--gpu", "B200", "--gpu-memory", "180", "--activation-offload"])
    lines = capsys.readouterr().out.splitlines()
    assert "gpu               B200: 180 GiB, 2250 TFLOP/s dense bf16 peak (--gpu, --gpu-memory, --peak-tflops)" in lines
    assert any(line.startswith("from flags") and "gpu=B200 gpu_memory_gib=180.0 peak_tflops=2250.0" in line
               for line in lines)
    verdict = next(line for line in lines if line.startswith("verdict"))
    assert verdict.endswith("host 1.62 GiB per GPU not checked (pass --host-memory)")

    run(["plan", "--config", SIXTEEN_B, "--peak-tflops", "500", "--host-memory", "64", "--activation-offload"])
    lines = capsys.readouterr().out.splitlines()
    assert any(line.startswith("from flags") and "peak_tflops=500.0" in line for line in lines)
    assert next(line for line in lines if line.startswith("verdict")).endswith("host 1.62 of 64 GiB")


def test_doc_len_counts_attention_within_documents(capsys):
    """1t.yaml masks documents: at 65,536 tokens of 4,096-token documents attention is a sixteenth of the
    whole-sequence count, and the total falls from ~711 to ~251 GFLOP per token (issue 27: ≈2.5e11)."""
    masked = MoEConfig(**{**TINY.__dict__, "document_masking": True, "eod_token_id": 0})
    cluster = Cluster(nodes=1, gpus_per_node=2, gpu_memory_gib=1.0)
    whole = plan(masked, cluster, Workload(seq_len=16))["flops_per_token"]
    documents = plan(masked, cluster, Workload(seq_len=16, doc_len=4))["flops_per_token"]
    assert documents == training_flops_per_token(masked, 16, doc_len=4) < whole
    table = plan_json(capsys, "--config", ONE_T, "--doc-len", "4096")
    assert table["flops_per_token"] == pytest.approx(2.507e11, rel=1e-3)
    assert plan_json(capsys, "--config", ONE_T)["flops_per_token"] == pytest.approx(7.113e11, rel=1e-3)
    run(["plan", "--config", ONE_T, "--doc-len", "4096"])
    assert "attention within 4,096-token documents" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        run(["plan", "--config", SIXTEEN_B, "--doc-len", "64"])
    assert "document_masking is false" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        run(["plan", "--config", ONE_T, "--doc-len", "0"])
    assert "--doc-len=0" in capsys.readouterr().err


def test_mtp_rows_for_both_activation_offload_choices(tmp_path, capsys):
    """ActivationOffload checkpoints the MTP blocks by default (issue 27): the offload column drops their working
    set; ``mtp: false`` (config or --no-offload-mtp) keeps it, and the table prints both figures."""
    from moe_lightning.planner.plan import block_working_set_bytes, mtp_activation_bytes

    mtp = MoEConfig(**{**TINY.__dict__, "mtp_layers": 2})
    cluster = Cluster(nodes=1, gpus_per_node=2, gpu_memory_gib=1.0)
    tokens = 2 * 8
    rows = {choice: plan(mtp, cluster, Workload(micro_batch=2, seq_len=8, offload_mtp=choice))["memory"]
            for choice in (True, False)}
    row = "multi-token prediction activations"
    uncheckpointed = mtp_activation_bytes(mtp, tokens)
    assert rows[False]["with_offload"]["gpu_bytes"][row] == rows[True]["without_offload"]["gpu_bytes"][row] \
        == uncheckpointed
    saved = uncheckpointed - rows[True]["with_offload"]["gpu_bytes"][row]
    assert saved == 2 * block_working_set_bytes(mtp, tokens, moe=True) > 0  # one MoE block per depth
    path = write_config(tmp_path, trainer={"callbacks": [
        {"class_path": "moe_lightning.training.callbacks.ActivationOffload", "init_args": {"mtp": False}}]})
    config = yaml.safe_load(open(path))
    config["model"]["init_args"]["config"]["mtp_layers"] = 1
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    assert plan_json(capsys, "--config", path)["inputs"]["offload_mtp"] == [False, "config"]
    run(["plan", "--config", path, "--offload-mtp"])
    out = capsys.readouterr().out
    assert "with its blocks checkpointed (ActivationOffload mtp: true, configured)" in out


COMPOSED = {  # a second --config over a shipped one: what plan must read exactly as fit composes it
    "tiny.yaml": {"trainer": {"devices": 2, "callbacks": [
        {"class_path": "moe_lightning.training.callbacks.ActivationOffload", "init_args": {"prefetch": 0}}]},
        "model": {"init_args": {"loss_chunk_size": 7, "config": {"dim": 64, "bias_update_rate": "1e-3"}}},
        "data": {"init_args": {"batch_size": 3}}},
    "tiny-fsdp.yaml": {"trainer": {"strategy": {"init_args": {"cpu_offload": True, "expert_parallel_size": 1}}}},
    "1t.yaml": {"trainer": {"num_nodes": 2, "strategy": {"class_path": "lightning.pytorch.strategies.DDPStrategy"}},
                "model": {"init_args": {"optimizer": {"class_path": "torch.optim.AdamW"}}}},
}


@pytest.mark.parametrize("shipped", sorted(COMPOSED))
def test_plan_composes_configs_as_fit_does(tmp_path, shipped):
    """plan composes ``--config`` files without fit's parser (LightningCLI imports Lightning): the inputs it plans,
    defaults included, and the model config equal those of the values fit's own parser composes."""
    from moe_lightning.commands.cli import compose_configs
    from moe_lightning.planner.plan import PLANNED
    from moe_lightning.planner.run_config import load_model_config, read_config, run_inputs

    override = tmp_path / "override.yaml"
    override.write_text(yaml.safe_dump(COMPOSED[shipped]))
    paths = [str(REPO_ROOT / "configs" / shipped), str(override)]
    defaults = {f.name: f.default for f in dataclasses.fields(Cluster) + dataclasses.fields(Workload)
                if f.name in PLANNED}
    fit = compose_configs(paths)
    assert defaults | run_inputs(read_config(paths)) == defaults | run_inputs(fit)
    fit_path = tmp_path / "fit.yaml"
    fit_path.write_text(yaml.safe_dump(fit))
    assert load_model_config(paths) == load_model_config(str(fit_path))
    if shipped == "tiny.yaml":  # the YAML string "1e-3" is a float to fit's parser, and so to plan's
        assert load_model_config(paths).bias_update_rate == 1e-3 and load_model_config(paths).dim == 64


def test_a_misspelt_model_field_is_one_line_naming_it(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({"model": {"init_args": {"config": {"vocab_sise": 64}}}}))
    with pytest.raises(SystemExit):
        run(["plan", "--config", str(path)])
    assert "model.init_args.config" in capsys.readouterr().err.strip().splitlines()[-1]
