"""One mechanism per concern (issue 23): no import circles, one tokenizer identity, one dtype table."""

import ast
import json
import re
from pathlib import Path

import pytest
import torch

from moe_lightning import TextDataModule
from moe_lightning.commands.main import run
from moe_lightning.data.tokenize.files import write_token_file
from moe_lightning.training.strategy import MoEFSDPStrategy

PACKAGE = Path(__file__).resolve().parent.parent / "moe_lightning"


def import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports, anywhere in the file (imports inside functions too)."""
    root = PACKAGE.parent
    files = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(root).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [base, *(f"{base}.{alias.name}" for alias in node.names)]
            else:
                continue
            edges |= {t for t in targets if t in files and t != name}
        graph[name] = edges
    return graph


def test_the_package_has_no_import_circle():
    """Before: cli <-> commands (a compatibility re-export) and loading <-> hf.convert."""
    graph, state, circles = import_graph(), {}, []

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                circles.append(" -> ".join(path[path.index(nxt):] + [node, nxt]))
            elif nxt not in state:
                visit(nxt, path + [node])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    assert len(graph) > 40 and not circles


LAYERS = ["run", "model", "optim", "checkpoint", "parallel", "data", "hf", "planner", "training", "commands"]
LIGHTNING_USERS = ("moe_lightning.training", "moe_lightning.data.module", "moe_lightning.commands.cli")


def test_each_folder_imports_only_the_folders_listed_above_it():
    """README's Layout: the folders are layers in this order (``dtypes`` is a leaf any of them may use). Before:
    run -> checkpoint -> hf -> checkpoint (loading sat in checkpoint/, convert in hf/)."""
    assert sorted(LAYERS) == sorted(p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__")
    upward = []
    for module, targets in import_graph().items():
        folder = module.split(".")[1] if module.count(".") >= 1 else None
        if folder not in LAYERS:
            continue
        for target in targets:
            other = target.split(".")[1] if target.count(".") >= 1 else None
            if other in LAYERS and other != folder and LAYERS.index(other) > LAYERS.index(folder):
                upward.append(f"{module} -> {target}")
    assert upward == []


def test_only_training_the_data_module_and_the_cli_import_lightning():
    """So ``plan``, ``tokenize``, ``convert`` and ``generate`` start without Lightning (seconds to import).
    Before: optim/muon.py imported it for one log line."""
    users = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            if any(n.split(".")[0] in ("lightning", "pytorch_lightning", "lightning_fabric") for n in names):
                users.append(module)
    assert users and all(u.startswith(LIGHTNING_USERS) for u in users), sorted(set(users))


def test_the_tests_have_one_folder_per_package_folder():
    """README's Layout: a package folder's tests are in the tests/ folder of its name (a new folder without one, or
    tests filed outside the mirror, fail here); four folders hold no package's tests."""
    helpers = {"launchers", "support", "integration", "benchmarks"}
    tests = Path(__file__).resolve().parent
    folders = {p.name for p in tests.iterdir() if p.is_dir() and not p.name.startswith((".", "_"))}
    assert folders - helpers == set(LAYERS) and helpers <= folders


def names_in(path: Path, calls_only: bool = False) -> set[str]:
    """The names a file uses (``dist.new_group(...)`` gives ``new_group`` and ``dist``), or only those it calls."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if calls_only:
            node = node.func if isinstance(node, ast.Call) else None
        if isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif isinstance(node, ast.Name):
            names.add(node.id)
    return names


def test_one_module_makes_meshes_and_groups_and_one_applies_the_parallelisms():
    """Issue 41: the layout is one object. Before: new_group loops in mesh.py, expert_parallel.py, the preemption
    callback and the sharded checkpointer; parallelize_moe called by the strategy and the LightningModule, which
    read the model's shard object to scale its loss."""
    makers, parallelizers = set(), set()
    for path in sorted(PACKAGE.rglob("*.py")):
        called, module = names_in(path, calls_only=True), ".".join(path.relative_to(PACKAGE).with_suffix("").parts)
        if called & {"new_group", "new_subgroups", "split_group", "init_device_mesh", "DeviceMesh"}:
            makers.add(module)
        if "parallelize_moe" in called:
            parallelizers.add(module)
    assert makers == {"parallel.mesh"}
    assert parallelizers == {"training.strategy"}
    read_by_module = names_in(PACKAGE / "training" / "module.py")
    assert not read_by_module & {"sequence_shard", "device_mesh", "_device_mesh", "get_group", "parallel", "layout"}


def test_test_only_code_is_not_in_the_package():
    assert not (PACKAGE / "parallel" / "comm.py").exists()
    import moe_lightning.commands.generate as generate
    assert not hasattr(generate, "complete")


def _tokenizer_folder(folder: Path, eos: str) -> Path:
    """A small BPE ``tokenizer.json`` with two special tokens, declaring ``eos`` its end-of-sequence token."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    folder.mkdir()
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=280, special_tokens=["<a>", "<b>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(["one two three four five six seven"] * 20, trainer)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": eos}))
    return folder / "tokenizer.json"


def test_a_token_file_written_with_another_eos_token_is_refused(tmp_path):
    """The same tokenizer JSON with another EOS token joins documents with another id. Before: the data check
    compared the kind and content hash only (the checkpoint check compared the EOS too), and accepted it."""
    pytest.importorskip("tokenizers")
    written_with, other_eos = _tokenizer_folder(tmp_path / "a", "<a>"), _tokenizer_folder(tmp_path / "b", "<b>")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("one two three four five six seven eight nine ten\n" * 200)
    tokens = write_token_file([str(corpus)], str(tmp_path / "tokens.npy"), str(written_with))

    def setup(tokenizer: Path) -> None:
        TextDataModule(source=str(tokens), tokenizer=str(tokenizer), seq_len=8, batch_size=2).setup("fit")

    setup(written_with)
    with pytest.raises(ValueError, match=r"was tokenized with .*'eos_token': '<a>'.* but data.tokenizer is "
                                         r".*'eos_token': '<b>'"):
        setup(other_eos)


@pytest.mark.parametrize("spelling, dtype", [("bf16", torch.bfloat16), ("bfloat16", torch.bfloat16),
                                             ("fp32", torch.float32), ("float16", torch.float16)])
def test_every_dtype_field_takes_both_spellings(spelling, dtype, tmp_path):
    """Before: the strategy took only bf16/fp16/fp32, the commands only bfloat16/float16/float32."""
    strategy = MoEFSDPStrategy(param_dtype=spelling, reduce_dtype=spelling)
    assert strategy._dtype(strategy.param_dtype, None) is dtype
    for command in (["generate", "missing.ckpt"], ["export", "missing.ckpt", "--out", str(tmp_path / "out.pt")],
                    ["convert", "missing.ckpt", "--out", str(tmp_path / "hf")]):
        with pytest.raises(FileNotFoundError, match="missing.ckpt"):  # past the parser: the file is what is missing
            run([*command, "--dtype", spelling])


def test_every_private_lightning_name_outside_lightning_internals_is_listed_there():
    """A Lightning upgrade that renames a private name must break in a place the table in
    ``lightning_internals.py`` names: imported ``_names`` and ``trainer._x``-style reads elsewhere must be listed."""
    from moe_lightning.training import lightning_internals
    listed = set(re.findall(r"``(?:[\w.]+\.)?(_\w+)", lightning_internals.__doc__))
    used = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "lightning_internals.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "lightning":
                used += [(path.name, a.name) for a in node.names if a.name.startswith("_")]
            elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                owner = node.value.id if isinstance(node.value, ast.Name) else getattr(node.value, "attr", None)
                if owner in ("trainer", "strategy", "fit_loop", "epoch_loop", "validate_loop", "_logger_connector"):
                    used.append((path.name, node.attr))
    assert used  # the scan sees something (console.py's _update_n, at least)
    assert [(name, attr) for name, attr in used if attr not in listed] == []
