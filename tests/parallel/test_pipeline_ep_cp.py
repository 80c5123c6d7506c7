"""Expert and context parallelism within a pipeline stage: stages under a context-parallel shard against one
process (float64), and ``fit`` at 2 stages x EP 2 or x CP 2 on 4 gloo processes against the same fit without
stages on 2, per step over the same global batch."""

import json

import pytest

from moe_lightning.parallel.mesh import MeshLayout
from tests.support.distributed import LAUNCHERS, run_nodes, run_ranks


def test_expert_and_context_parallelism_compose_with_stages():
    """The layout is accepted (the refusal is gone); a CP group and an EP group are a stage's neighbouring ranks,
    and a pipeline's stages and a CP group read one data replica."""
    MeshLayout.check_arguments(1, "auto", 2, 2, pipeline_parallel_size=2)
    layout = MeshLayout.resolve(8, 1, "auto", 2, 8, 2, seq_len=128, pipeline_parallel_size=2)
    assert (layout.shard, layout.ep, layout.cp, layout.pp, layout.data_parallel) == (4, 2, 2, 2, 2)
    assert [layout.data_parallel_rank(g) for g in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]


@pytest.mark.parametrize("cases", [pytest.param(["mtp2-docs"], marks=pytest.mark.slow), pytest.param(["causal", "mla-mtp1-docs-3stages"],
                                                                  marks=pytest.mark.extended)])
def test_stages_under_context_parallelism_equal_one_process(cases):
    """2 ranks share every sequence; each runs the stages one after another over the micro-batches (hidden states
    between stages ``[b, S / 2, D]``), gradients averaged over the two as FSDP does. Against the whole model on one
    process without context parallelism: MTP 2 depths with document masking at 2 stages over 4 micro-batches (the
    main suite's case); causal GQA at 2 stages, and MLA with MTP and documents at 3 stages (slow). Float64
    gradients to 1e-9 (measured 1.2e-15), except the router weight's, an fp32 sum over tokens by design
    (model/moe.py: measured 6.3e-7); the losses are the head's fp32 cross-entropy sums in another order (1e-6;
    measured 1.0e-7)."""
    out = run_ranks(LAUNCHERS / "pipeline_cp_chain_run.py", 2, *cases, timeout=600)
    results = json.loads([line for line in out[0].splitlines() if line.startswith("{")][-1])
    assert set(results) == set(cases)
    for name, result in results.items():
        assert result["names"], name  # every parameter of the model is on some stage
        assert result["main"][0] == pytest.approx(result["main"][1], rel=1e-6), name
        assert result["total"][0] == pytest.approx(result["total"][1], rel=1e-6), name
        assert result["error"] < 1e-9 and result["router_error"] < 2e-6, (name, result)


def _fit(tmp_path, name: str, devices: int, *args: str) -> tuple[dict, list[dict], str, list[float]]:
    """tests/launchers/pipeline_fit_run.py (configs/tiny-fsdp.yaml's model, seq 128, 3 steps) on ``devices`` gloo
    processes: the probe's record, each step's balancing biases, rank 0's log, and each step's gradient norm
    (clipped at 1e6, far above it: the norm is recorded and every update is left as it is)."""
    out = tmp_path / name / "run.json"
    out.parent.mkdir()
    biases = out.with_name("biases.json")
    logs = run_nodes([str(LAUNCHERS / "pipeline_fit_run.py"), "--out", str(out), "--biases", str(biases),
                      "--clip", "1e6", "--devices", str(devices), *args], 1, devices, cwd=out.parent, timeout=1200)
    norms = json.loads(out.with_name("norms.json").read_text())
    return json.loads(out.read_text()), json.loads(biases.read_text()), logs[0], norms


def _val_loss(log: str) -> float:
    return float([line for line in log.splitlines() if line.startswith("val/loss")][-1].split()[-1])


def _check_same_steps(staged: tuple, flat: tuple) -> None:
    """Per step: the world-mean loss to 1e-6 relative (fp32: the same terms summed in another order, micro-batches
    apart), the gradient norm over every stage to 1e-5 (fp32 squares summed per stage, not per shard; it is what
    catches expert gradients divided by the wrong group size, which AdamW's updates, and so the losses, barely
    show), every layer's balancing bias equal (a step moves each expert's by +-0.01 on its summed count against
    the mean: counts summed over the wrong ranks, one stage's replicas only or a rank twice, would flip some), and
    every rank holding a layer agrees on it; the held-out loss alike."""
    (record, biases, log, norms), (flat_record, flat_biases, flat_log, flat_norms) = staged, flat
    got, want = [r["loss"] for r in record["rows"]], [r["loss"] for r in flat_record["rows"]]
    assert len(got) == len(want) == 3
    assert got == pytest.approx(want, rel=1e-6)
    assert len(norms) == len(flat_norms) == 3 and min(norms) > 0
    assert norms == pytest.approx(flat_norms, rel=1e-5)
    assert all(row["agree"] for row in biases + flat_biases)
    assert [row["biases"] for row in biases] == [row["biases"] for row in flat_biases]
    assert any(any(v != 0 for v in values) for values in biases[-1]["biases"].values())  # the biases did move
    assert _val_loss(log) == pytest.approx(_val_loss(flat_log), rel=1e-6)


@pytest.mark.parametrize("within", [pytest.param(("--ep", "2"), marks=pytest.mark.slow, id="ep2"),
                                    pytest.param(("--cp", "2"), marks=pytest.mark.slow, id="cp2"),
                                    pytest.param(("--ep", "2", "--cp", "2"), marks=pytest.mark.extended, id="ep2-cp2")])
def test_fit_at_two_stages_with_expert_or_context_parallelism_equals_one_stage(tmp_path, within):
    """2 stages on 4 processes, each stage's 2 ranks its EP group (exchanging its MoE layers' tokens; expert counts
    summed over the stage), its CP group (sharing every sequence; hidden states between stages are each rank's
    half), or both, against the same without stages on 2 processes: 4 sequences per data replica a step (2
    replicas under EP alone, 1 under CP), as 2 micro-batches of 2 under stages."""
    staged = _fit(tmp_path, "pp2", 4, "--pp", "2", *within, "--microbatches", "2", "--batch", "4")
    flat = _fit(tmp_path, "pp1", 2, "--pp", "1", *within, "--batch", "4")
    _check_same_steps(staged, flat)
