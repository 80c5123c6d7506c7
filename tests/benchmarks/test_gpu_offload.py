"""The GPU offload benchmark stays runnable: its --dry-run runs every mode on CPU with tiny shapes, checkpointing (the
baseline offload is judged against) first."""

import pytest
import torch

from tests.support.benchmark_script import load_benchmark


@pytest.fixture(scope="module")
def gpu_offload():
    return load_benchmark("gpu_offload")


def test_dry_run_measures_every_mode(gpu_offload):
    report = gpu_offload.main(["--dry-run"])
    results = report["results"]
    assert list(results) == ["checkpoint", "prefetch1", "prefetch2", "prefetch0", "off"]
    assert len({r["loss"] for r in results.values()}) == 1  # same forward in every mode
    boundary = 1 * 32 * gpu_offload.DRY_CONFIG.dim * 4
    for mode, result in results.items():
        moved = mode.startswith("prefetch")
        assert result["bytes_offloaded_per_step"] == (3 * boundary if moved else 0)
        assert result["tensors_out_per_step"] == result["tensors_in_per_step"] == (3 if moved else 0)
        assert result["tokens_per_s"] > 0 and result["peak_gib"] is None
    assert results["prefetch2"]["copy_order"][4:7] == ["copy_in 2", "copy_in 1", "use 3"]
    assert set(report["summary"]["prefetch1"]) == {"throughput_vs_off", "throughput_vs_checkpoint"}  # no memory on CPU
    assert gpu_offload.figure_line(results).startswith("figure: offload | prefetch 1 vs checkpointing: tokens/s x")


def test_targets_are_judged_against_checkpointing(gpu_offload):
    """Offload is checkpointing plus copies: it should run as fast and hold less, by about the bytes it moves out."""
    def mode(tokens_per_s, peak_gib, offloaded_gib=0.0):
        return {"tokens_per_s": tokens_per_s, "peak_gib": peak_gib, "bytes_offloaded_per_step": offloaded_gib * (1 << 30)}
    results = {"checkpoint": mode(100, 10.0), "prefetch1": mode(96, 8.5, 2.0), "prefetch2": mode(90, 8.0, 2.0),
               "off": mode(130, 30.0)}
    summary = gpu_offload.summarize(results)
    assert summary["prefetch1"]["targets_met"] and not summary["prefetch2"]["targets_met"]  # 0.90x is too slow
    assert summary["prefetch1"]["peak_saved_gib"] == pytest.approx(1.5)
    results["prefetch1"] = mode(99, 9.5, 2.0)  # saved 0.5 GiB of 2 offloaded: the copies did not free enough
    assert not gpu_offload.summarize(results)["prefetch1"]["targets_met"]
    assert gpu_offload.figure_line(results).endswith("| FAIL")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without CUDA")
def test_full_run_without_cuda_says_what_to_do(gpu_offload, capsys):
    with pytest.raises(SystemExit):
        gpu_offload.main([])
    assert "--dry-run" in capsys.readouterr().err
