"""How MoEFSDPStrategy cuts the model into FSDP2 units, checked with real processes (gloo) on the oldest and the
newest tested torch: units that must complete their forward, what each all-gathers, in which dtype blocks run."""

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moe_lightning import MoEConfig, MoELanguageModel
from moe_lightning.parallel import MeshLayout
from moe_lightning.parallel.mesh import ParallelMesh
from moe_lightning.training.strategy import MoEFSDPStrategy
from tests.support.distributed import REPO_ROOT, clean_env, free_port, run_ranks

CONFIGS = REPO_ROOT / "configs"


@pytest.mark.slow
def test_chunked_loss_fit_survives_validation_and_checkpoint_on_two_processes(tmp_path):
    """Issue 16's scenario: ``tiny-fsdp`` with the chunked loss, a validation and Lightning's checkpoint at its
    end, then more training steps. On torch 2.11 a ``[norm, output]`` unit whose ``output`` never ran forward
    stayed "mid-forward" after the validation; the checkpoint's state-dict hook resharded it and step 5 died in
    ``RMSNorm`` with "mixed torch.Tensor and DTensor" (torch 2.13 completes such units, so it passed there)."""
    command = [sys.executable, "-m", "moe_lightning", "fit", "--config", str(CONFIGS / "tiny-fsdp.yaml"),
               "--trainer.max_steps=5", "--trainer.val_check_interval=4", "--trainer.limit_val_batches=1",
               "--trainer.enable_progress_bar=false", "--data.init_args.max_tokens=200000",
               "--trainer.callbacks=lightning.pytorch.callbacks.ModelCheckpoint",
               "--model.init_args.loss_chunk_size=64"]
    env = clean_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    assert "`max_steps=5` reached" in done.stdout + done.stderr  # trained on after the validation and the save
    assert list(Path(tmp_path).glob("lightning_logs/tiny-fsdp/version_0/checkpoints/*.ckpt"))


def sharded(module: MoELanguageModel, **strategy_args) -> MoEFSDPStrategy:
    """``MoEFSDPStrategy``'s sharding applied to ``module`` in this process (world size 1)."""
    strategy = MoEFSDPStrategy(**strategy_args)
    strategy.parallel_devices = [torch.device("cpu")]
    strategy._lightning_module = module
    strategy.parallel = ParallelMesh(MeshLayout.resolve(1, 1, "auto", 1, module.config.num_experts), "cpu")
    strategy._device_mesh = strategy.parallel.dense
    strategy._parallelize()
    return strategy


def test_blocks_get_fp32_rotary_tables_and_a_bf16_sharded_forward_equals_the_one_device_one(one_rank_group):
    """FSDP2 casts every floating argument of a unit's forward to ``param_dtype`` (``cast_forward_inputs``), the
    rotary tables too: rotations in bf16 under FSDP, fp32 on one device. The reference is the same model with its
    parameters cast to bf16 on one device: an FSDP2 unshard rebuilds exactly those bf16 values (on any number of
    ranks), so the logits must be equal, not merely close."""
    torch.manual_seed(0)
    config = MoEConfig(vocab_size=96, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=128, ffn_hidden=96,
                       n_dense_layers=1, num_experts=4, top_k=2, expert_hidden=32, init_std=0.3)
    module = MoELanguageModel(config)
    module.configure_model()
    reference = copy.deepcopy(module.model).to(torch.bfloat16)
    tokens_BS = torch.randint(0, config.vocab_size, (2, 128))
    sharded(module, param_dtype="bf16")
    seen = []
    for block in module.model.layers:
        block.register_forward_pre_hook(lambda _, args, kwargs: seen.append(kwargs["cos_sin"][0].dtype),
                                        with_kwargs=True)
    with torch.no_grad():
        logits_BSV, expected_BSV = module.model(tokens_BS), reference(tokens_BS)
    assert seen == [torch.float32] * config.n_layers
    assert logits_BSV.dtype == torch.bfloat16 and expected_BSV.abs().max() > 1  # O(1) logits, not a flat output
    torch.testing.assert_close(logits_BSV, expected_BSV, rtol=0, atol=0)


@pytest.mark.slow
def test_expert_parallel_with_recomputed_blocks_gathers_each_unit_once_per_pass():
    """Expert parallelism nests an ``experts`` unit in each MoE block; ActivationOffload recomputes every block in
    backward. Forward gathers every unit once; backward gathers again exactly the units resharded after forward
    (embedding and blocks; the head and the root keep theirs). A recomputed ``experts`` unit that prefetched the
    next block (whose backward is done) would add a gather of that block, and of the head, per MoE block."""
    out = run_ranks(REPO_ROOT / "tests" / "launchers" / "fsdp_gathers_run.py", 2, "1", timeout=900)[0]
    record = json.loads(out.strip().splitlines()[-1])
    units = record["units"]
    assert set(units) == {"<root>", "tok_embeddings", "layers.0", "layers.1", "layers.2", "layers.3", "output"}
    resharded = ["tok_embeddings", "layers.0", "layers.1", "layers.2", "layers.3"]
    assert len(record["steps"]) == 2
    for step in record["steps"]:
        assert step["forward"] == sorted(units.values())
        assert step["backward"] == sorted(units[name] for name in resharded)


@pytest.mark.slow
def test_validation_gathers_only_the_units_it_runs():
    """Issue 27 (6): the last block prefetched the MTP module, which runs in training only: a validation batch
    all-gathered it for nothing and held it. Now a validation batch gathers every other unit once, MTP's none."""
    out = run_ranks(REPO_ROOT / "tests" / "launchers" / "fsdp_gathers_run.py", 2, "1", "validate", timeout=900)[0]
    record = json.loads(out.strip().splitlines()[-1])
    units = record["units"]
    assert {"mtp.0", "mtp.0.block"} <= set(units)
    assert record["steps"] == [{"validation": sorted(size for name, size in units.items()
                                                     if not name.startswith("mtp."))}]
