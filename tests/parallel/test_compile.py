"""Per-block ``torch.compile``: whole-graph (no breaks), same loss and gradients as eager, composes with offload.

Compiling is slow on 2 cores, so these tests use the ``aot_eager`` backend: Dynamo captures each block as one
graph (``fullgraph=True`` fails on any break) and AOTAutograd traces forward and backward through the fake
kernels (where fp32 ``_grouped_mm`` used to fail); only Inductor's code generation is left out.
``benchmarks/compile_cpu.py`` runs Inductor and compares its loss too.
"""

import json
from functools import partial
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

from moe_lightning.parallel import parallelize as parallelize_lib
from moe_lightning.training.callbacks import ActivationOffload
from moe_lightning.model import MoEConfig, MoETransformer
from moe_lightning.model.transformer import Block
from moe_lightning.parallel.compile import compile_blocks
from moe_lightning.training.module import MoELanguageModel
from tests.support.distributed import LAUNCHERS, run_ranks

CONFIG = MoEConfig(vocab_size=64, dim=32, n_layers=3, n_heads=4, n_kv_heads=2, max_seq_len=32, ffn_hidden=64,
                   n_dense_layers=1, num_experts=4, top_k=2, expert_hidden=16, init_std=0.3, aux_loss_coef=0.01)
RUN = LAUNCHERS / "compile_run.py"


def loss_and_grads(model: MoETransformer, tokens: torch.Tensor):
    model.zero_grad()
    loss = F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


def assert_same(result, reference):
    # aot_eager runs the same kernels in the same order as eager: equal to fp32 rounding.
    torch.testing.assert_close(result[0], reference[0], rtol=1e-6, atol=1e-6)
    assert result[1].keys() == reference[1].keys()
    for name in reference[1]:
        torch.testing.assert_close(result[1][name], reference[1][name], rtol=1e-5, atol=1e-6, msg=name)


def test_compiled_blocks_match_eager_in_fp32_alone_and_under_activation_offload():
    torch.manual_seed(0)
    model = MoETransformer(CONFIG)
    tokens = torch.randint(0, 64, (2, 16))
    eager = loss_and_grads(model, tokens)
    names = [name for name, _ in model.named_parameters()]

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compile_blocks(model.layers, backend="aot_eager")
    assert all(isinstance(block, Block) and type(block).__name__ == "CompiledBlock" for block in model.layers)
    assert [name for name, _ in model.named_parameters()] == names  # in place: checkpoints keep their keys
    assert_same(loss_and_grads(model, tokens), eager)
    # One graph for the dense block, one shared by the two MoE blocks: all three ran compiled.
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2

    offload = ActivationOffload(prefetch=1, min_offload_bytes=0)
    offload.apply(model.layers)
    try:
        assert_same(loss_and_grads(model, tokens), eager)
        assert ("copy_in", 0) in offload.order  # checkpointed and offloaded around the compiled forward
    finally:
        offload.remove()
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2  # recompute reuses the graphs


def test_compiling_blocks_already_wrapped_by_offload_is_refused():
    model = MoETransformer(CONFIG)
    offload = ActivationOffload(prefetch=1, min_offload_bytes=0)
    offload.apply(model.layers)
    try:
        with pytest.raises(RuntimeError, match=r"model.layers\[0\].*compile the blocks before applying ActivationOffload"):
            compile_blocks(model.layers, backend="aot_eager")
    finally:
        offload.remove()
    assert all(type(block) is Block for block in model.layers)  # refused before any block changed


def test_compile_flag_compiles_the_blocks_the_module_builds():
    with mock.patch.object(parallelize_lib, "compile_blocks", partial(compile_blocks, backend="aot_eager")):
        compiled = MoELanguageModel(CONFIG, compile=True)
        compiled.configure_model()
    assert all(type(block).__name__ == "CompiledBlock" for block in compiled.model.layers)
    eager = MoELanguageModel(CONFIG)
    eager.configure_model()
    assert all(type(block) is Block for block in eager.model.layers)


@pytest.mark.slow  # a 2-process compiled fit
def test_compiled_blocks_under_the_fsdp_strategy_with_offload_match_eager(tmp_path):
    """Two gloo processes, MoEFSDPStrategy(ep=2) + ActivationOffload, compiled vs eager (each rank runs both).
    The dense block compiles whole under FSDP's hooks; the MoE blocks around the eager all-to-all dispatch."""
    out = tmp_path / "compile.json"
    run_ranks(RUN, 2, "--ep", "2", "--out", str(out))
    result = json.loads(out.read_text())
    assert len(result["eager"]) == len(result["compiled"]) == 2
    assert result["compiled"] == pytest.approx(result["eager"], rel=1e-5)
    assert result["compiled_classes"] == ["FSDPCompiledBlock"] * CONFIG.n_layers
    assert result["offloaded"] > 0
