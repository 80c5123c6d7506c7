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
