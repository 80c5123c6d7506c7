"""``gpu_all.sh`` run by an interpreter without torch says so in one line (issue 45, item 12): ``--list`` printed a
traceback in the middle of the list, and a run's preflight blamed ``-lcuda`` and Triton."""

import stat
import subprocess
import sys

import pytest

from tests.support.distributed import REPO_ROOT, clean_env


@pytest.mark.parametrize("args", [["--list", "--gpu-memory", "80"], ["--dry-run"]])
def test_an_interpreter_without_torch_is_one_line(tmp_path, args):
    python = tmp_path / "python"  # this Python without its site-packages: no torch
    python.write_text(f"#!/usr/bin/env bash\nexec {sys.executable} -S \"$@\"\n")
    python.chmod(python.stat().st_mode | stat.S_IEXEC)
    assert subprocess.run([str(python), "-c", "import torch"], capture_output=True).returncode != 0
    done = subprocess.run(["bash", str(REPO_ROOT / "benchmarks" / "gpu_all.sh"), *args], capture_output=True,
                          text=True, timeout=120, env=clean_env(PYTHON=str(python), OUT=str(tmp_path / "out")))
    lines = (done.stdout + done.stderr).splitlines()
    assert done.returncode == 2 and lines == [f"gpu_all: {python} cannot import torch: install torch and lightning "
                                              "there, or point PYTHON at an interpreter that has them"]
    assert not (tmp_path / "out").exists()
