"""The non-finite check every export and ``convert`` runs on each tensor holds a bounded chunk beside the tensor:
``torch.isfinite`` of a float tensor builds its ``abs()`` (a copy the tensor's size) and two masks, which for a
DeepSeek-V3 expert stack (14 GiB in float32) would be more than the tensor itself again."""

import pytest
import torch

import moe_lightning.hf.mapping as mapping
from moe_lightning.hf import HFFormatError


def test_the_check_sees_a_chunk_at_a_time_and_counts_every_bad_value(monkeypatch):
    monkeypatch.setattr(mapping, "NON_FINITE_CHUNK", 1000, raising=False)
    seen, isfinite = [], torch.isfinite
    monkeypatch.setattr(torch, "isfinite", lambda t: seen.append(t.numel()) or isfinite(t))
    tensor = torch.randn(7, 1001)
    assert mapping.refuse_non_finite(tensor, "w") is tensor
    assert max(seen) <= 1000 and sum(seen) == tensor.numel()  # was: one call over all 7,007 values
    tensor[0, 0], tensor[3, 500], tensor[6, 1000] = float("nan"), float("inf"), -float("inf")  # first, middle, last
    with pytest.raises(HFFormatError, match=r"^w holds 3 non-finite value\(s\) \(inf or NaN\) of 7007"):
        mapping.refuse_non_finite(tensor, "w")
    column = tensor.t()  # not contiguous: checked as it is
    with pytest.raises(HFFormatError, match=r"holds 3 non-finite"):
        mapping.refuse_non_finite(column, "w")
