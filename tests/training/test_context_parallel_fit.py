"""``fit`` under ``MoEFSDPStrategy(context_parallel_size=N)`` on real gloo ranks equals the CP 1 fit over the same
sequences, per step, and resumes across CP sizes (tests/launchers/cp_fit_run.py).

Tolerance: fp32 throughout (Muon's Newton-Schulz too). The ranks compute the same terms, summed in another order
(attention rows over all keys, the loss as N shard sums, gradients reduce-scattered over dp x cp ranks), so losses
and gradient norms differ by rounding: measured <= 1.6e-7 relative (losses) and <= 3.2e-7 (gradient norms) over
every run below. ``RTOL = 1e-5`` leaves margin while a real error is far larger: a wrong loss scale (N x), a missed
key-side gradient sum or a wrong chunk order moves the first loss or gradient norm by 1e-2 or more.
QK-clip's per-head maxima (logits of 5-9) are compared to 1e-5 absolute (measured 7e-7); the balancing biases move
by +-1e-3 steps of a sign rule, so they must be equal exactly (a count over one rank's tokens only flips signs).
"""

import json
from pathlib import Path

import pytest

from tests.support.distributed import LAUNCHERS, run_ranks

RUN = LAUNCHERS / "cp_fit_run.py"
RTOL = 1e-5
LAYERS, MOE_LAYERS = 3, 2  # strategy_run.TINY; each multi-token prediction depth adds one MoE block
MLA = ("--attention", "mla", "--docs", "--muon", "--qk-clip", "--offload-activations", "--accumulate", "2",
       "--max-steps", "4", "--config", '{"mtp_layers": 2, "aux_loss_coef": 0.1, "z_loss_coef": 0.01}')
# depth 5 > the chunk of 32 / 8 positions: the positions a depth drops lie on two ranks' tail chunks
GQA = ("--config", '{"mtp_layers": 5, "aux_loss_coef": 0.1, "z_loss_coef": 0.01}')


def launch(tmp: Path, name: str, world: int, *args: str) -> dict:
    out = tmp / f"{name}.json"
    run_ranks(RUN, world, *args, "--out", str(out), timeout=900)
    return json.loads(out.read_text())


def losses(run: dict, first_batch: int = 0) -> list[float]:
    return [row["loss"] for row in run["batches"] if row["batch"] >= first_batch]


def assert_same_steps(run: dict, reference: dict, first_batch: int = 0, first_step: int = 0) -> None:
    """Per micro-batch losses and per step gradient norms and balancing biases of ``run`` equal ``reference``'s
    (from ``first_batch`` / ``first_step`` on; a missing record fails)."""
    expected = losses(reference, first_batch)[:len(losses(run))]
    assert len(losses(run)) == len(expected) > 0
    assert losses(run) == pytest.approx(expected, rel=RTOL)
    norms = reference["grad_norms"][first_step:first_step + len(run["grad_norms"])]
    assert len(run["grad_norms"]) == len(norms) > 0
    for got, want in zip(run["grad_norms"], norms):
        assert got == pytest.approx(want, rel=RTOL)
    assert run["biases"] == reference["biases"][first_step:first_step + len(run["biases"])]


@pytest.fixture(scope="module")
def mla(tmp_path_factory):
    """MLA with document masking, 2 multi-token prediction depths (depth k drops the last k positions, on rank 0's
    tail chunk), Muon, QK-clip, ActivationOffload and 2 micro-batches a step: one process (CP 1),
    and 2 ranks at CP 2 with FSDP's cpu_offload, saving a checkpoint every 2 steps."""
    tmp = tmp_path_factory.mktemp("cp_mla")
    return {"dir": tmp, "cp1": launch(tmp, "cp1", 1, *MLA),
            "cp2": launch(tmp, "cp2", 2, *MLA, "--cp", "2", "--cpu-offload",
                          "--ckpt-dir", str(tmp / "ckpt"))}


def test_cp2_mla_documents_mtp_muon_qk_clip_offload_and_accumulation_equal_cp1(mla):
    cp1, cp2 = mla["cp1"], mla["cp2"]
    assert_same_steps(cp2, cp1)
    # it really ran sharded: one all-gather of the latent per block (3 layers, 2 depths) in forward and in the
    # checkpointed recompute, one reduce-scatter of its gradient per block in backward
    assert all(row["calls"]["all_gather_into_tensor"] == 2 * (LAYERS + 2) for row in cp2["batches"])
    assert all(row["calls"]["reduce_scatter_tensor"] == LAYERS + 2 for row in cp2["batches"])
    # QK-clip: the maxima combined over the ranks (each saw half the queries) are the whole sequences' maxima
    for got, want in zip(cp2["max_logits"], cp1["max_logits"]):
        assert got == [pytest.approx(row, abs=1e-5) for row in want]
    assert cp2["clipped_heads"] == cp1["clipped_heads"] and min(cp1["clipped_heads"]) > 0
    # the two ranks of the group share each batch: counted once
    assert cp2["tokens_seen"] == cp1["tokens_seen"] == 4 * 2 * 2 * 32


@pytest.mark.extended
def test_a_cp2_checkpoint_resumes_at_cp1_and_at_cp4_with_ep2_exactly(mla):
    """Same global batch (2 sequences, one data replica at every size): the next sequences, the same losses."""
    ckpt = str(mla["dir"] / "ckpt" / "step=2.ckpt")
    for name, world, extra in (("cp1", 1, ()), ("cp4", 4, ("--cp", "4", "--ep", "2"))):
        resumed = launch(mla["dir"], f"resumed_{name}", world, *MLA, *extra, "--resume", ckpt)
        assert [row["batch"] for row in resumed["batches"]] == [4, 5, 6, 7], name
        assert_same_steps(resumed, mla["cp2"], first_batch=4, first_step=2)


@pytest.mark.extended
def test_cp4_with_ep2_gqa_pipelined_expert_exchange_and_two_cp_groups_equal_cp1(tmp_path):
    """GQA without document masking, 5 multi-token prediction depths, 4 sequences a step: CP 4 x EP 2 with
    ep_overlap_chunks=2 against one process;
    and 4 data-parallel ranks at EP 2 (two expert groups, experts FSDP-sharded across them) with 2 chunks against
    1 chunk and against one process; and 2 data replicas x CP 2 against one process."""
    cp1 = launch(tmp_path, "cp1", 1, *GQA, "--batch-size", "4")
    cp4 = launch(tmp_path, "cp4", 4, *GQA, "--cp", "4", "--ep", "2", "--chunks", "2", "--batch-size", "4")
    assert_same_steps(cp4, cp1)
    assert all(row["calls"]["all_gather_into_tensor"] == LAYERS + 5 for row in cp4["batches"])
    unchunked = launch(tmp_path, "ep2", 4, *GQA, "--ep", "2", "--batch-size", "1")
    chunked = launch(tmp_path, "ep2_chunks", 4, *GQA, "--ep", "2", "--chunks", "2", "--batch-size", "1")
    assert_same_steps(chunked, unchunked)
    assert_same_steps(unchunked, cp1)
    # two CP groups of neighbouring ranks, each reading its data replica's 2 sequences (the sampler's replicas)
    assert_same_steps(launch(tmp_path, "cp2_dp2", 4, *GQA, "--cp", "2", "--batch-size", "2"), cp1)
    # two chunks: one more dispatch and combine exchange per MoE block (2 layers, 5 depths) and pass
    for one, two in zip(unchunked["batches"], chunked["batches"]):
        assert two["calls"]["all_to_all_single"] - one["calls"]["all_to_all_single"] == (MOE_LAYERS + 5) * 2 * 2
