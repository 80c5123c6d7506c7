"""The README's paths as a new user runs them: start from a released model with a shipped config, export and
read back the byte tokenizer, one set of sampling flags for generate and predict, load_model as documented."""

import contextlib
import io
import re
from pathlib import Path

import pytest
import transformers  # the test extra provides it: a skip would hide the README's reference checks
import yaml

from moe_lightning import hf
from moe_lightning.commands import main as commands
from moe_lightning.hf.tokenizer_files import byte_tokenizer_json

from tests.commands.test_cli_imports import byte_run_checkpoint
from tests.hf.test_mapping import build_reference

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3"])
def test_readme_fit_from_a_released_model_with_the_tiny_config(family, tmp_path, lightning_log):
    """``moe-lightning fit --config configs/tiny.yaml --model.init_args.pretrained <HF folder>``: tiny.yaml sizes a
    GQA model of dim 128; the folder's shape (dim 32, and MLA for DeepSeek-V3) replaces it, tiny's training
    settings (max_seq_len 128) stay, the folder's tokenizer.json is the data's, and the log names every replaced
    field."""
    path = tmp_path / family
    build_reference(family).save_pretrained(path)
    (path / "tokenizer.json").write_text(byte_tokenizer_json())  # a released folder ships its tokenizer
    run = commands.run(["fit", "--config", str(CONFIGS / "tiny.yaml"), "--model.init_args.pretrained", str(path),
                   "--trainer.max_steps=2", f"--trainer.logger.init_args.save_dir={tmp_path}",
                   "--data.init_args.batch_size=2", "--data.init_args.max_tokens=50000",
                   "--trainer.enable_progress_bar=false"])
    assert run.trainer.global_step == 2
    assert run.model.config.max_seq_len == 128  # tiny's training setting
    assert run.datamodule.tokenizer_path == str(path / "tokenizer.json")
    shape = hf.load_config(path)
    assert run.model.config.dim == shape.dim == 32 and run.model.config.attention == shape.attention
    # tiny's training settings (max_seq_len, its balancing rate) apply; every other field is the checkpoint's
    assert run.model.config == shape.__class__(**{**shape.__dict__, "max_seq_len": 128, "bias_update_rate": 0.01})
    replaced = next(m for m in lightning_log if "gives the model's shape; replaced from the config" in m)
    assert "dim=128 -> 32" in replaced and "ffn_hidden=384 -> 48" in replaced and "max_seq_len" not in replaced


def test_export_hf_of_a_byte_run_reads_back_in_tokenizers_transformers_and_generate(tmp_path, capsys):
    tokenizers = pytest.importorskip("tokenizers")
    ckpt = byte_run_checkpoint(tmp_path)
    commands.run(["export", str(ckpt), "--hf", "--out", str(tmp_path / "hf")])
    text = "héllo wörld\n\tdef f(x):  return x ✓ 日本"
    ids = list(text.encode("utf-8"))  # the byte tokenizer's ids

    tok = tokenizers.Tokenizer.from_file(str(tmp_path / "hf" / "tokenizer.json"))
    assert tok.encode(text).ids == ids and tok.decode(ids) == text
    assert tok.token_to_id("<|endoftext|>") == 256 and tok.decode([*ids, 256]) == text

    auto = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert auto(text)["input_ids"] == ids  # no BOS or other token added
    assert auto.eos_token_id == 256 and auto.decode(ids) == text
    assert auto.decode([*ids[:3], 256], skip_special_tokens=True) == text[:2]  # "h", "é" (2 bytes)

    capsys.readouterr()
    continuations = []
    for source in (ckpt, tmp_path / "hf"):  # the export continues a prompt exactly as the checkpoint does
        commands.run(["generate", str(source), "--prompt", "def ", "--max-new-tokens", "12", "--temperature", "0"])
        continuations.append(capsys.readouterr().out)
    assert continuations[0] == continuations[1] and continuations[0].startswith("def ")


def test_load_model_unpacks_as_the_readme_writes(tmp_path):
    from moe_lightning.commands.loading import load_model

    ckpt = byte_run_checkpoint(tmp_path)
    model, tokenizer = load_model(ckpt)
    loaded = load_model(ckpt)
    assert not model.training and tokenizer.eos_id == 256 and loaded.kind == "lightning"
    assert all(p.equal(q) for p, q in zip(model.parameters(), loaded.model.parameters()))


def test_test_and_predict_do_not_create_training_run_folders(tmp_path):
    """After ``fit`` wrote ``tiny/version_0``, ``test`` logs to ``tiny-test/``: the README's ``version_0`` paths
    keep naming the training run."""
    common = ["--config", str(CONFIGS / "tiny.yaml"), f"--trainer.logger.init_args.save_dir={tmp_path}",
              "--data.init_args.batch_size=2", "--data.init_args.max_tokens=50000",
              "--trainer.enable_progress_bar=false"]
    fit = commands.run(["fit", *common, "--trainer.max_steps=1"])
    ckpt = next(Path(fit.trainer.log_dir, "checkpoints").glob("*.ckpt"))
    commands.run(["test", *common, f"--ckpt_path={ckpt}", "--trainer.limit_test_batches=1"])
    assert sorted(p.name for p in (tmp_path / "tiny").iterdir()) == ["version_0"]
    assert (tmp_path / "tiny-test" / "version_0" / "metrics.csv").is_file()


# ---- every flag and config field the README and docs/ name exists --------------------------------------------

REPO = CONFIGS.parent
DOC_FILES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)


def fenced(text: str, language: str) -> list[str]:
    return [body for lang, body in FENCE.findall(text) if lang == language]


def our_flags(text: str) -> set[str]:
    """``--flags`` given to ``moe-lightning`` (or ``-m moe_lightning``) in shell blocks, and inline code spans that
    are a flag (`--top-p`, `--trainer.max_time=...`)."""
    flags = set()
    for block in fenced(text, "bash"):
        for line in block.replace("\\\n", " ").splitlines():
            words = line.split("#")[0].split()
            for start in ("moe-lightning", "moe_lightning"):
                if start in words:
                    flags |= {w for w in words[words.index(start) + 1:] if w.startswith("--")}
    spans = re.findall(r"`([^`\n]+)`", FENCE.sub("", text))
    flags |= {span.split()[0] for span in spans if span.startswith("--")}
    flags |= {word for span in spans if span.startswith("moe-lightning ") for word in span.split()
              if word.startswith("--")}
    return {re.split(r"[=\[]", flag)[0].rstrip(",.:") for flag in flags}


def help_flags() -> set[str]:
    """Every option the commands' own parsers print in ``--help``."""
    out = io.StringIO()
    for command in (["fit"], ["predict"], ["generate"], ["tokenize"], ["plan"], ["export"], ["export", "--hf"],
                    ["convert"]):
        with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
            commands.run([*command, "--help"])
    with contextlib.redirect_stdout(out):
        commands.run(["--help"])  # the command table, with the flag every command takes (--traceback)
    return set(re.findall(r"(--[a-z][\w-]*)", out.getvalue())) | {"--no-stop"}


def _parameters(cls) -> set[str]:
    import dataclasses
    import inspect
    if dataclasses.is_dataclass(cls):
        return {f.name for f in dataclasses.fields(cls)}
    return set(inspect.signature(cls.__init__).parameters) - {"self", "args", "kwargs"}


def _known_classes():
    from lightning.pytorch import Trainer
    from lightning.pytorch.loggers import CSVLogger

    from moe_lightning import MoEConfig, MoELanguageModel, TextDataModule
    from moe_lightning.optim import WarmupCosineLR
    from moe_lightning.training.strategy import MoEFSDPStrategy
    # where a key's value is a class (by class_path or the package's default), per parent class and key
    nested = {(Trainer, "strategy"): MoEFSDPStrategy, (Trainer, "logger"): CSVLogger,
              (MoELanguageModel, "config"): MoEConfig, (MoELanguageModel, "lr_scheduler"): WarmupCosineLR}
    return {"trainer": Trainer, "model": MoELanguageModel, "data": TextDataModule}, nested


def check_key(path: list[str], where: str) -> None:
    """``trainer.strategy.init_args.cpu_offload``-style keys: each segment a parameter of the class it is in;
    below a class the package cannot know (a user's optimizer, a callback) nothing is checked."""
    roots, nested = _known_classes()
    cls = roots[path[0]]
    for key in [k for k in path[1:] if k != "init_args"]:
        key = key.rstrip("+")
        assert key in _parameters(cls), f"{where}: {'.'.join(path)}: {cls.__name__} has no {key!r}"
        cls = nested.get((cls, key))
        if cls is None:
            return


def check_yaml(node, cls, where: str, path: list[str]) -> None:
    """A YAML block: keys of a ``class_path`` entry against its class, known sections against theirs."""
    import importlib

    if isinstance(node, list):
        for item in node:
            check_yaml(item, None, where, path)
        return
    if not isinstance(node, dict):
        return
    if "class_path" in node:
        module, _, name = node["class_path"].rpartition(".")
        cls = getattr(importlib.import_module(module), name)
        node = node.get("init_args") or {}
    elif "init_args" in node:
        node = node["init_args"]
    if cls is None:
        return
    _, nested = _known_classes()
    for key, value in node.items():
        key = key.rstrip("+")
        assert key in _parameters(cls), f"{where}: {'.'.join(path + [key])}: {cls.__name__} has no {key!r}"
        check_yaml(value, nested.get((cls, key)), where, path + [key])


def test_every_flag_and_config_field_in_the_readme_and_docs_exists():
    """A flag or field the docs name but the code does not have is a user's first error; found by reading
    README.md and docs/*.md, checked against the commands' parsers and the classes' signatures."""
    roots, _ = _known_classes()
    options = help_flags()
    checked = 0
    for doc in DOC_FILES:
        text, where = doc.read_text(encoding="utf-8"), doc.name
        for flag in our_flags(text):
            name = flag[2:]
            if name.split(".")[0] in roots:
                check_key(name.split("."), where)
            else:
                assert flag in options, f"{where}: {flag} is not an option of any moe-lightning command"
            checked += 1
        spans = re.findall(r"`(trainer\.[\w.+]+|(?:model|data)\.init_args\.[\w.+]+)`", FENCE.sub("", text))
        for span in spans:
            check_key(span.split("."), where)
            checked += 1
        for block in fenced(text, "yaml"):
            config = yaml.safe_load(block)
            for section, cls in roots.items():
                if isinstance(config, dict) and section in config:
                    check_yaml(config[section], cls, where, [section])
                    checked += 1
        for header, rows in re.findall(r"^\| (field|argument) \|[^\n]*\n\|[-| ]+\|\n((?:\|[^\n]*\n)+)", text, re.M):
            cls = roots["model"] if header == "argument" else _known_classes()[1][(roots["model"], "config")]
            for row in rows.splitlines():
                for name in re.findall(r"`(\w+)`", row.split("|")[1]):
                    assert name in _parameters(cls), f"{where}: table of {cls.__name__}: no {name!r}"
                    checked += 1
    assert checked > 100  # the docs name that many; a parser that found none would pass vacuously
