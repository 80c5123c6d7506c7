"""``moe-lightning export``: one parser for both targets (a ``.pt``, or ``--hf`` a Hugging Face folder), and a
checkpoint holding inf or NaN refused in one line naming the tensor, whatever the target."""

import dataclasses
import subprocess
import sys

import pytest
import torch

from moe_lightning.commands import main as commands
from moe_lightning.commands.loading import write_model_file
from moe_lightning.data.tokenizer import ByteTokenizer
from moe_lightning.model import MoEConfig, MoETransformer

from tests.support.distributed import REPO_ROOT, clean_env

# A model Mixtral can hold (so `--hf` picks a family without --architecture); weights O(1)
CONFIG = MoEConfig(vocab_size=260, dim=32, n_layers=2, n_heads=2, n_kv_heads=1, max_seq_len=32, ffn_hidden=64,
                   num_experts=4, top_k=2, expert_hidden=32, n_shared_experts=0, n_dense_layers=0, bias_update_rate=0.0)


def model_file(path, poison: dict[str, float]) -> str:
    """A ``.pt`` of ``CONFIG`` whose tensors ``name`` hold one ``value`` at their first element."""
    torch.manual_seed(0)
    state = MoETransformer(CONFIG).state_dict()
    for name, value in poison.items():
        state[name].view(-1)[0] = value
    return str(write_model_file(path, dataclasses.asdict(CONFIG), state, ByteTokenizer().spec()))


def refused(capfd, words: list[str]) -> tuple[int, list[str]]:
    capfd.readouterr()
    with pytest.raises(SystemExit) as exit_:
        commands.main(words)
    return exit_.value.code, capfd.readouterr().err.splitlines()


TARGETS = {"pt": ["--out", "{tmp}/out.pt"], "hf": ["--hf", "--out", "{tmp}/out"],
           "hf-fp8": ["--hf", "--fp8-blocks", "--out", "{tmp}/out"]}
POISONS = [("tok_embeddings.weight", float("nan")), ("layers.1.ffn.experts.w2_EDF", float("inf")),
           ("layers.0.attention.wq.weight", float("-inf"))]


@pytest.mark.parametrize("target", list(TARGETS))
@pytest.mark.parametrize("name,value", POISONS, ids=["embedding-nan", "experts-inf", "attention-neg-inf"])
def test_a_non_finite_tensor_is_refused_in_one_line_naming_it(target, name, value, tmp_path, capfd):
    """The embedding, an expert stack and an FP8-quantised projection: exit 2, one line naming our tensor, and
    nothing at --out (the folder is committed only once complete)."""
    src = model_file(tmp_path / "model.pt", {name: value})
    words = [w.format(tmp=tmp_path) for w in TARGETS[target]]
    status, lines = refused(capfd, ["export", src, *words])
    assert status == 2 and len(lines) == 1, lines
    assert f"{name} holds 1 non-finite value(s)" in lines[0], lines
    assert not (tmp_path / "out.pt").exists() and not (tmp_path / "out").exists()


def test_a_finite_checkpoint_still_exports_to_both_targets(tmp_path):
    src = model_file(tmp_path / "model.pt", {})
    commands.run(["export", src, "--out", str(tmp_path / "out.pt")])
    commands.run(["export", src, "--hf", "--fp8-blocks", "--out", str(tmp_path / "out")])
    assert torch.load(tmp_path / "out.pt", weights_only=True)["config"]["dim"] == 32
    assert (tmp_path / "out" / "config.json").is_file()


def test_export_help_lists_the_hugging_face_options_and_a_pt_refuses_them(tmp_path, capfd):
    shown = subprocess.run([sys.executable, "-m", "moe_lightning", "export", "--help"], env=clean_env(),
                           cwd=REPO_ROOT, capture_output=True, text=True, timeout=120).stdout
    assert all(flag in shown for flag in ("--hf", "--fp8-blocks", "--architecture", "--shard-gb", "--dtype"))
    src = model_file(tmp_path / "model.pt", {})
    status, lines = refused(capfd, ["export", src, "--out", str(tmp_path / "out.pt"), "--fp8-blocks"])
    assert status == 2 and "--fp8-blocks only applies when writing a Hugging Face directory" in lines[-1], lines
