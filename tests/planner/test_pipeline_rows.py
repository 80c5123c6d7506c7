"""``plan``'s pipeline rows (planner/pipeline.py) under context parallelism."""

import contextlib
import io
import json

import pytest

from moe_lightning.commands.main import run
from tests.support.distributed import REPO_ROOT

ONE_T = str(REPO_ROOT / "configs" / "1t.yaml")


def _pipeline(*flags: str) -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        run(["plan", "--config", ONE_T, "--gpu", "H100", "--pipeline-parallel-size", "4",
             "--pipeline-microbatches", "4", "--json", *flags])
    return json.loads(out.getvalue())["pipeline"]


def test_a_stage_under_context_parallelism_sends_and_holds_its_share_of_the_sequence():
    """Under CP 2 each stage's hidden states are ``[b, S / 2, D]`` (``StageTransformer``): at the same micro-batch
    ``b`` every rank's P2P bytes, boundary activations in flight and one send's time are half of CP 1's."""
    one, two = (_pipeline("--context-parallel-size", cp, "--no-activation-offload") for cp in ("1", "2"))
    assert one["micro_batch_sequences"] == two["micro_batch_sequences"]
    for rank_one, rank_two in zip(one["ranks"], two["ranks"], strict=True):
        assert rank_one["p2p_bytes"] > 0 and rank_two["p2p_bytes"] * 2 == rank_one["p2p_bytes"]
        boundary_one = rank_one["bytes"]["boundary activations (in flight)"]
        assert boundary_one > 0 and abs(rank_two["bytes"]["boundary activations (in flight)"] * 2 - boundary_one) <= 1
    assert two["p2p_seconds"] * 2 == pytest.approx(one["p2p_seconds"], rel=1e-12)


def test_the_rows_price_each_ranks_sends_and_the_expert_exchange_per_micro_batch():
    """P2P time per step is each rank's bytes over InfiniBand (the ends send one way, the middle both: 1F1B at P = 4,
    M = 4 sends 4 and 8 hidden-state hops), and the expert exchange the plan exposes without stages, at the stage's
    expert_parallel_size, is taken in M pieces of a quarter each (the same tokens over the same links)."""
    from moe_lightning.planner.pipeline import format_rows
    rows = _pipeline()
    hop = rows["p2p_seconds"]
    assert [r["p2p_bytes"] / rows["ib_bytes_per_s"] for r in rows["ranks"]] == pytest.approx(
        [4 * hop, 8 * hop, 8 * hop, 4 * hop], rel=1e-12)
    assert rows["exchange_seconds"] > 0
    printed = "\n".join(format_rows(rows))
    assert f"{rows['exchange_seconds']:.2f} s exposed a step, {rows['exchange_seconds'] / 4:.3f} s a micro-batch" \
        in printed
    assert "P2P time per step (s, sends over IB)" in printed
