"""What else composes with pipeline stages inside ``fit``: FSDP over 2 ranks within a stage, 4 stages, MLA with
document masking and MTP, and ``ActivationOffload``; each a fit of configs/tiny-fsdp.yaml's model (seq 128, 3 steps)
on gloo processes against the same fit without stages over the same 8 sequences a step, compared per step by
tests/parallel/test_pipeline_ep_cp.py's ``_check_same_steps`` (losses to 1e-6 relative, gradient norms to 1e-5,
balancing biases equal, held-out loss to 1e-6: the tolerances are justified there)."""

import json

import pytest
import torch
import yaml

from moe_lightning import TextDataModule
from moe_lightning.model import MoEConfig
from moe_lightning.parallel.pipeline import keep_stage, resolve_pipeline, stage_layout
from moe_lightning.planner.pipeline import stage_parameters
from moe_lightning.training.callbacks import ActivationOffload
from tests.parallel.test_pipeline_ep_cp import _check_same_steps, _fit
from tests.support.distributed import REPO_ROOT
from tests.support.pipeline_model import SHAPE as PIPELINE_SHAPE, build

SHAPE = yaml.safe_load((REPO_ROOT / "configs" / "tiny-fsdp.yaml").read_text())["model"]["init_args"]["config"]
NEWLINE = 10  # the byte-level tokenizer's "\n": the documents of the MLA case (see there)


def _planned_bytes(config: MoEConfig, stages: int) -> list[int]:
    """fp32 bytes of each stage's parameters as ``plan``'s stage rows count them."""
    return [4 * n for n in stage_parameters(config, stage_layout(config, stages))]


@pytest.mark.extended
def test_fit_at_two_stages_with_fsdp_over_two_ranks_within_each_equals_one_stage(tmp_path):
    """4 processes, 2 stages of 2 ranks, each stage's parameters sharded by FSDP over its 2 ranks (ranks {0, 1} hold
    stage 0, {2, 3} stage 1) and 2 data replicas of 4 sequences a step as 2 micro-batches of 2, against FSDP over 2
    ranks without stages, 4 sequences each.

    Resharding across micro-batches, as it runs (the strategy's ``reshard_after_forward=True``, 1F1B): each block
    unit frees its gathered parameters after every micro-batch's forward and all-gathers them again for that
    micro-batch's backward; torch's ``PipelineStage`` turns resharding after backward and gradient sync off for every
    micro-batch's backward, so a unit stays gathered from a backward until the next forward frees it, its gradients
    accumulate unsharded over the micro-batches, and ``perform_reduce_grad`` (after the stage's last backward)
    reshards and reduce-scatters them once. The head and root units keep their parameters gathered
    (``keep_gathered``)."""
    staged = _fit(tmp_path, "pp2", 4, "--pp", "2", "--microbatches", "2", "--batch", "4")
    flat = _fit(tmp_path, "pp1", 2, "--pp", "1", "--batch", "4")
    _check_same_steps(staged, flat)
    held = [rank["parameters"] for rank in staged[0]["held"]]  # sharded: the stage's two ranks hold it once
    assert [held[0] + held[1], held[2] + held[3]] == _planned_bytes(MoEConfig(**SHAPE), 2)
    assert all(0 < h < max(_planned_bytes(MoEConfig(**SHAPE), 2)) for h in held)


@pytest.mark.slow
def test_fit_at_four_stages_equals_one_stage_and_holds_the_planned_parameters(tmp_path):
    """4 processes, configs/tiny-fsdp.yaml's 4 blocks as 4 stages of one (shard size 1, one data replica), 1F1B over 4
    micro-batches of 2 sequences, against FSDP over 2 ranks without stages, 4 sequences each. Each rank holds
    exactly the parameters ``plan``'s stage rows count for its stage (fp32)."""
    staged = _fit(tmp_path, "pp4", 4, "--pp", "4", "--microbatches", "4", "--batch", "8")
    flat = _fit(tmp_path, "pp1", 2, "--pp", "1", "--batch", "4")
    _check_same_steps(staged, flat)
    assert [rank["parameters"] for rank in staged[0]["held"]] == _planned_bytes(MoEConfig(**SHAPE), 4)


@pytest.mark.extended
def test_fit_at_two_stages_with_mla_documents_and_mtp_equals_one_stage(tmp_path):
    """MLA attention, document masking and one MTP depth (the last stage holds the embedding's copy, MTP and the
    head: blocks [3, 1]), 2 processes at 2 stages x 2 micro-batches of 4 against one process without stages, 8
    sequences a step in both. Documents end at "\\n" (token 10): the corpus's own separator (256) occurs once in the
    3 steps' 24 sequences, a newline 2 to 8 times in each, so every sequence is cut into at least 3 masked
    documents (checked below on the very batches both fits read: one data replica of 8 sequences a step).

    One process, not 2 data replicas of 4: MTP's targets that cross a document end are ignored, so sequences have
    different target counts, and a loss that is each replica's mean, averaged over 2 replicas (FSDP's gradient
    average), is not the mean over the 8 sequences that one replica of 8 takes (measured at step 1: loss 1.9e-6
    and gradient norm 4.4e-4 apart). Each is what data parallelism computes at its size: compare equal sizes."""
    model = dict(attention="mla", kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16,
                 document_masking=True, eod_token_id=NEWLINE, mtp_layers=1)
    data = TextDataModule(source="stdlib", seq_len=128, batch_size=8, max_tokens=40000)  # the launcher's
    data.setup("fit")
    ends_per_sequence = [(batch_BS1[:, :-1] == NEWLINE).sum(1).tolist()
                         for _, batch_BS1 in zip(range(3), data.train_dataloader())]
    assert min(min(step) for step in ends_per_sequence) >= 2, ends_per_sequence  # measured 2 to 8
    assert stage_layout(MoEConfig(**{**SHAPE, **model}), 2) == [3, 1]
    staged = _fit(tmp_path, "pp2", 2, "--pp", "2", "--microbatches", "2", "--batch", "8",
                  "--model-json", json.dumps(model))
    flat = _fit(tmp_path, "pp1", 1, "--pp", "1", "--batch", "8", "--model-json", json.dumps(model))
    _check_same_steps(staged, flat)
    embedding_copy = 4 * SHAPE["vocab_size"] * SHAPE["dim"]  # fp32, on the last stage for MTP
    assert sum(r["parameters"] for r in staged[0]["held"]) == flat[0]["held"][0]["parameters"] + embedding_copy


@pytest.mark.parametrize("stage, blocks, offloaded", [
    (1, [0, 2], ["layers.2"]), (1, [-1], ["layers.3"]), (1, [0, 1], []), (0, [-1], []),
    (0, None, ["layers.0", "layers.1"]), (1, None, ["layers.2"])])
def test_activation_offload_names_the_whole_models_blocks_on_a_stage(stage, blocks, offloaded):
    """``ActivationOffload(blocks=...)`` on either of 2 stages (blocks 0-1 and 2-3, float64) offloads the inputs of
    the blocks its indices name in the whole model, as without stages (it read them as places within the stage:
    ``[0]`` offloaded block 2, ``[2]`` was refused, ``[-1]`` offloaded each stage's last block whatever the model's
    is). ``None``: every block but the model's last, so the first stage, whose micro-batches wait for their
    backward, offloads all of its blocks (it kept its last one's input on the device)."""
    config = MoEConfig(**PIPELINE_SHAPE)
    part = keep_stage(build(config).model, stage, resolve_pipeline(config, 2))
    names = [f"layers.{key}" for key in part.layers._modules]
    assert names == [["layers.0", "layers.1"], ["layers.2", "layers.3"]][stage]
    offload = ActivationOffload(min_offload_bytes=0, blocks=blocks)
    offload.wrap(part)
    x = torch.randint(0, config.vocab_size, (2, 16)) if stage == 0 else \
        torch.randn(2, 16, config.dim, dtype=torch.float64, requires_grad=True)
    part(x, torch.randint(0, config.vocab_size, (2, 17))).float().sum().backward()
    assert [names[i] for kind, i in offload.order if kind == "offload"] == offloaded
    assert offload.tensors_offloaded == offload.tensors_copied_in == len(offloaded)


@pytest.mark.parametrize("blocks, words", [
    ([4], r"blocks=\[4\]\): index 4 is outside the model's n_layers=4 blocks; use indices in \[-4, 3\]"),
    (3, r"blocks=3\): must be a list of block indices"), ([True], r"blocks=\[True\]\): must be a list"),
    (["0"], r"blocks=\['0'\]\): must be a list")])
def test_activation_offload_refuses_blocks_that_name_no_block_in_one_line(blocks, words):
    """The type at construction (``--print_config`` time), the range against the whole model's blocks on a stage."""
    config = MoEConfig(**PIPELINE_SHAPE)
    with pytest.raises(ValueError, match=words) as refused:
        ActivationOffload(blocks=blocks).wrap(keep_stage(build(config).model, 1, resolve_pipeline(config, 2)))
    assert "\n" not in str(refused.value)


@pytest.mark.extended
def test_fit_at_two_stages_with_activation_offload_equals_one_stage_and_offloads_every_stage(tmp_path):
    """``ActivationOffload(min_offload_bytes=0)`` at 2 stages x 2 micro-batches of 4 (2 processes) against the same
    callback without stages (FSDP over 2 ranks, 4 sequences each): the same steps, and every stage offloads.

    The callback's rule: it checkpoints every block and offloads each one's input except the model's last block's
    (``blocks=None``), whose backward follows its forward at once. So stage 0 (blocks 0 and 1), whose micro-batches
    wait for their backward, offloads both its blocks' inputs, 2 per micro-batch forward, 4 a step; stage 1 (blocks
    2 and 3) offloads block 2's, 2 a step; each is copied back once in backward (``tensors_copied_in``), each a
    micro-batch's hidden states ``[4, 128, 128]`` fp32. Without stages, 3 of the 4 blocks' inputs ``[4, 128, 128]``
    a step. The MTP-free model has no other checkpointed block."""
    staged = _fit(tmp_path, "pp2", 2, "--pp", "2", "--microbatches", "2", "--batch", "8", "--offload")
    flat = _fit(tmp_path, "pp1", 2, "--pp", "1", "--batch", "4", "--offload")
    _check_same_steps(staged, flat)
    hidden_bytes = 4 * 128 * SHAPE["dim"] * 4  # a micro-batch's (2 stages) or a rank's (none) [4, 128, D] fp32
    assert stage_layout(MoEConfig(**SHAPE), 2) == [2, 2]  # ranks 0 and 1 hold blocks 0-1 and 2-3
    for name, blocks_of_rank, forwards in (("pp2", [range(0, 2), range(2, 4)], 2), ("pp1", [range(4)] * 2, 1)):
        for rank, blocks in enumerate(blocks_of_rank):
            rows = json.loads((tmp_path / name / f"offload.rank{rank}.json").read_text())
            offloaded = [i for i in blocks if i != 3]  # every block's input but the model's last block's
            want = forwards * len(offloaded)
            assert [(r["out"], r["in"], r["bytes"]) for r in rows] == [(want, want, want * hidden_bytes)] * 3, \
                (name, rank, rows)
            assert rows[-1]["offloaded"] == [f"layers.{i}" for i in offloaded], (name, rank, rows[-1])
            assert rows[-1]["kept"] == (["layers.3"] if 3 in blocks else []), (name, rank, rows[-1])


@pytest.mark.extended
def test_activation_offload_with_two_stages_per_rank_offloads_all_but_the_models_last_block(tmp_path):
    """Interleaved1F1B, 2 processes x 2 stages of one block (rank 0 blocks 0 and 2, rank 1 blocks 1 and 3), the
    callback on the rank's union of stages: the same steps as without stages, and rank 0 offloads both its blocks'
    inputs (4 a step over 2 micro-batches), rank 1 block 1's and keeps block 3's, the model's last (2 a step)."""
    staged = _fit(tmp_path, "v2", 2, "--pp", "2", "--schedule", "Interleaved1F1B", "--stages-per-rank", "2",
                  "--microbatches", "2", "--batch", "8", "--offload")
    flat = _fit(tmp_path, "pp1", 2, "--pp", "1", "--batch", "4", "--offload")
    _check_same_steps(staged, flat)
    hidden_bytes = 4 * 128 * SHAPE["dim"] * 4  # a micro-batch's [4, 128, D] fp32
    for rank, offloaded, kept in ((0, ["layers.0", "layers.2"], []), (1, ["layers.1"], ["layers.3"])):
        rows = json.loads((tmp_path / "v2" / f"offload.rank{rank}.json").read_text())
        want = 2 * len(offloaded)
        assert [(r["out"], r["in"], r["bytes"]) for r in rows] == [(want, want, want * hidden_bytes)] * 3, rows
        # the probe's names come from the callback's last generation of inputs, which here holds one micro-batch's
        # stage only (the counts above are the whole step's): what it shows is a part of the expected split
        assert set(rows[-1]["offloaded"]) <= set(offloaded) and set(rows[-1]["kept"]) <= set(kept), rows[-1]


@pytest.mark.extended
def test_fit_under_gpipe_equals_one_stage(tmp_path):
    """GPipe (every forward, then every backward) at 2 stages x 2 micro-batches of 4 on 2 processes against the
    same fit without stages: the schedule changes the order, not the sums."""
    staged = _fit(tmp_path, "gpipe", 2, "--pp", "2", "--schedule", "GPipe", "--microbatches", "2", "--batch", "8")
    flat = _fit(tmp_path, "pp1", 2, "--pp", "1", "--batch", "4")
    _check_same_steps(staged, flat)
