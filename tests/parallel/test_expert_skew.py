"""The exchange is dropless, so its receive buffers grow with routing skew; `plan` prices them at an imbalance of
``PLANNED_IMBALANCE``. A rank receiving more warns once, naming the layer and the factor."""

import dataclasses
import json

import pytest

from moe_lightning.parallel.expert_parallel import PLANNED_IMBALANCE
from moe_lightning.planner.plan import Workload
from tests.support.distributed import LAUNCHERS, run_ranks


def test_the_warning_threshold_is_the_imbalance_plan_prices():
    default = {f.name: f.default for f in dataclasses.fields(Workload)}["ep_imbalance"]
    assert default == PLANNED_IMBALANCE == 1.5


@pytest.mark.slow  # 2 processes (~25 s on 2 loaded cores); the main suite is at its time limit
def test_a_rank_receiving_more_rows_than_planned_warns_once_naming_the_layer_and_factor():
    """EP 2: every token of both ranks routed to rank 0's two experts: rank 0 receives 256 rows for its 64 tokens x
    top-2, 2.00x (> 1.5x): one warning over two forwards; rank 1 (no rows) and the balanced forward none."""
    outputs = run_ranks(LAUNCHERS / "ep_skew_run.py", 2, timeout=300)
    results = {r["rank"]: r for r in (json.loads(o.strip().splitlines()[-1]) for o in outputs)}
    assert results[0]["balanced"] == results[1]["balanced"] == 0
    assert results[1]["warnings"] == []
    (said,) = results[0]["warnings"]
    assert "MoE layer 0 received 256 rows on rank 0, 2.00x its 64 tokens x top-2" in said
    assert "above the 1.5x imbalance plan prices" in said and "--ep-imbalance 2.00" in said
