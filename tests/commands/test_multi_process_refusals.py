"""Issue 45, item 12: a layout that does not fit, refused on 2 processes, is one line (it was a 43-line traceback
per rank: the refusal is raised inside the trainer's run, where errors keep their stack, though no process group
exists yet and every rank made the same check). Rank 0 says it; rank 1 exits with the same status silently."""

import subprocess
import sys

import pytest

from tests.commands.test_refusals import LIGHTNING_INFO
from tests.support.distributed import REPO_ROOT, clean_env

TINY_FSDP = str(REPO_ROOT / "configs" / "tiny-fsdp.yaml")  # 2 devices, expert_parallel_size 2, seq_len 128


def fit_on_two_processes(tmp_path, *words: str) -> tuple[int, list[str]]:
    done = subprocess.run([sys.executable, "-m", "moe_lightning", "fit", "--config", TINY_FSDP,
                           "--trainer.max_steps=1", f"--trainer.logger.init_args.save_dir={tmp_path}", *words],
                          cwd=REPO_ROOT, env=clean_env(), capture_output=True, text=True, timeout=300)
    lines = [line for line in done.stderr.splitlines() if not line.removeprefix("[rank: 1] ").startswith(LIGHTNING_INFO)]
    return done.returncode, lines


@pytest.mark.extended  # 2 processes; the in-process refusals stay in the main suite
def test_a_context_parallel_size_that_does_not_fit_is_one_line_on_two_processes(tmp_path):
    status, lines = fit_on_two_processes(tmp_path, "--trainer.strategy.init_args.context_parallel_size=3")
    assert status == 2 and lines == [
        "moe-lightning fit: error: strategy.context_parallel_size=3 must divide strategy.shard_size=2 (a "
        "context-parallel group is folded into the shard ranks, so it also divides the world): choose it from [1, 2]."]


@pytest.mark.slow
def test_a_seq_len_that_does_not_fit_is_one_line_on_two_processes(tmp_path):
    status, lines = fit_on_two_processes(tmp_path, "--trainer.strategy.init_args.context_parallel_size=2",
                                         "--data.init_args.seq_len=126")
    assert status == 2 and len(lines) == 1 and lines[0].startswith("moe-lightning fit: error: ")
    assert "not a multiple of 4" in lines[0] and "data.seq_len" in lines[0]
