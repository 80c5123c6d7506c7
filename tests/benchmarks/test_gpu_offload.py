"""The GPU offload benchmark stays runnable: its --dry-run runs every mode on CPU with tiny shapes."""

import pytest
import torch

from tests.support.benchmark_script import load_benchmark


@pytest.fixture(scope="module")
def gpu_offload():
    return load_benchmark("gpu_offload")


def test_dry_run_measures_every_mode(gpu_offload):
    report = gpu_offload.main(["--dry-run"])
    results = report["results"]
    assert list(results) == ["off", "checkpoint", "prefetch0", "prefetch1", "prefetch2"]
    assert len({r["loss"] for r in results.values()}) == 1  # same forward in every mode
    boundary = 1 * 32 * gpu_offload.DRY_CONFIG.dim * 4
    for mode, result in results.items():
        moved = mode.startswith("prefetch")
        assert result["bytes_offloaded_per_step"] == (3 * boundary if moved else 0)
        assert result["tensors_out_per_step"] == result["tensors_in_per_step"] == (3 if moved else 0)
        assert result["tokens_per_s"] > 0 and result["peak_gib"] is None
    assert results["prefetch2"]["copy_order"][4:7] == ["copy_in 2", "copy_in 1", "use 3"]
    assert set(report["summary"]["prefetch1"]) == {"throughput_vs_off", "throughput_vs_checkpoint"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without CUDA")
def test_full_run_without_cuda_says_what_to_do(gpu_offload, capsys):
    with pytest.raises(SystemExit):
        gpu_offload.main([])
    assert "--dry-run" in capsys.readouterr().err
