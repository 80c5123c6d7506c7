"""``fit --model.init_args.pretrained=<folder>`` takes the folder's ``tokenizer.json``; a folder without one (Kimi K2
ships tiktoken files only) is refused in one line naming what it holds, unless the run names a tokenizer."""

import pytest

from moe_lightning.commands.cli import pretrained_tokenizer
from moe_lightning.commands.main import main

from tests.hf.test_mapping import build_reference
from tests.support.distributed import REPO_ROOT

TINY = str(REPO_ROOT / "configs" / "tiny.yaml")


@pytest.fixture(scope="module")
def kimi_style_folder(tmp_path_factory):
    """A DeepSeek-V3 folder with the tokenizer files a Kimi K2 release ships instead of tokenizer.json."""
    path = tmp_path_factory.mktemp("kimi") / "model"
    build_reference("deepseek_v3").save_pretrained(path)
    (path / "tiktoken.model").write_text("aGVsbG8= 0\n")
    (path / "tokenizer_config.json").write_text('{"tokenizer_class": "TikTokenTokenizer"}')
    (path / "tokenization_kimi.py").write_text("# the release's tokenizer code\n")
    return path


def test_fit_from_a_folder_without_tokenizer_json_is_refused_naming_its_tokenizer_files(kimi_style_folder, capfd,
                                                                                      monkeypatch, tmp_path):
    """Exit 2, one line, before any data is read (no 'tokenize:' line): byte ids would not be the model's ids."""
    monkeypatch.chdir(tmp_path)
    capfd.readouterr()
    with pytest.raises(SystemExit) as exit_:
        main(["fit", "--config", TINY, f"--model.init_args.pretrained={kimi_style_folder}", "--trainer.max_steps=1"])
    lines = capfd.readouterr().err.splitlines()
    ours = [line for line in lines if line.startswith("moe-lightning fit: error:")]
    assert exit_.value.code == 2 and ours == [lines[-1]], lines
    assert "has no tokenizer.json (tokenizer files found: tiktoken.model, tokenization_kimi.py, " \
           "tokenizer_config.json)" in lines[-1] and "--data.init_args.tokenizer=" in lines[-1]
    assert "produce a tokenizer.json" in lines[-1] and "save_pretrained" not in lines[-1]  # it writes none here
    assert not any(line.startswith("tokenize:") for line in lines)


def test_the_folders_tokenizer_json_is_taken_and_a_folder_without_tokenizer_files_says_none(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=r"has no tokenizer.json \(tokenizer files found: none\)"):
        pretrained_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{}")
    assert pretrained_tokenizer(tmp_path) == str(tmp_path / "tokenizer.json")


def test_a_missing_or_mistyped_folder_is_said_to_be_missing(tmp_path):
    """Was: "has no tokenizer.json (tokenizer files found: none)", as if the folder were there."""
    with pytest.raises(ValueError, match=r"pretrained='.*typo' does not exist: pass the Hugging Face model's folder"):
        pretrained_tokenizer(tmp_path / "typo")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=r"config.json' is a file, not a folder"):
        pretrained_tokenizer(tmp_path / "config.json")
