"""Using a trained model: one loader for every checkpoint kind, generate, export, predict, test, help."""

import json
import random
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.nn.functional as F
import yaml

from moe_lightning import MoEConfig, MoELanguageModel, MoETransformer, TextDataModule
from moe_lightning.commands.main import COMMANDS, EXTRA_COMMANDS, run
from moe_lightning.commands.generate import encode_prompt, stream_text
from moe_lightning.model.sampling import Sampling, stream
from moe_lightning.commands.generate import main as generate_main
from moe_lightning.commands.loading import export_checkpoint, load_model, read_checkpoint
from moe_lightning.training.strategy import MoEFSDPStrategy
from moe_lightning.data.tokenizer import ByteTokenizer, HFTokenizer, tokenizer_from_spec

# init_std 0.3: O(1) logits, so greedy text depends on every weight (near-uniform logits would hide a mix-up)
CONFIG = dict(vocab_size=320, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32, ffn_hidden=48,
              n_dense_layers=1, num_experts=4, top_k=2, expert_hidden=16, n_shared_experts=1, init_std=0.3)
GREEDY = Sampling(max_new_tokens=24, temperature=0.0, stop_at_eod=False)
PROMPT = "def main"


def complete(model: MoETransformer, tokenizer, prompt: str, sampling: Sampling) -> str:
    """The whole continuation of one prompt, as text."""
    device = next(model.parameters()).device
    return tokenizer.decode(list(stream(model, encode_prompt(tokenizer, prompt, device), sampling, tokenizer.eos_id)))


def train_bpe(path: Path, corpus: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers, decoders

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    bpe = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train([str(corpus)], bpe)
    tokenizer.save(str(path))


def fit(root: Path, tokenizer: str, strategy="auto") -> tuple[L.Trainer, TextDataModule]:
    torch.manual_seed(0)
    data = TextDataModule(source=str(root / "corpus.txt"), seq_len=16, batch_size=4, val_fraction=0.25,
                          tokenizer=tokenizer)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=3, strategy=strategy, logger=False,
                        default_root_dir=root, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, num_sanity_val_steps=0)
    trainer.fit(MoELanguageModel(MoEConfig(**CONFIG)), data)
    return trainer, data


def synthetic_code(lines: int = 6000, seed: int = 0) -> str:
    """~170 KB of code-like lines from a fixed generator: the same text whatever torch or Python is installed (the
    corpus was once torch's own source files, whose length, and so the held-out split, changed with the version)."""
    words = ["def", "main", "return", "self", "tensor", "import", "torch", "x", "y", "shape", "for", "in", "range",
             "if", "else", "None", "value", "out"]
    rng = random.Random(seed)
    return "".join("    " * rng.randrange(3) + " ".join(rng.choice(words) for _ in range(rng.randrange(2, 9)))
                   + ("():\n" if rng.random() < 0.2 else "\n") for _ in range(lines))


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> dict:
    """One single-file and one sharded checkpoint of the same tiny run, with a BPE tokenizer whose file is then
    deleted (so reuse can only come from what the checkpoints recorded)."""
    root = tmp_path_factory.mktemp("run")
    corpus = root / "corpus.txt"
    corpus.write_text(synthetic_code())
    train_bpe(root / "bpe.json", corpus)
    trainer, data = fit(root, str(root / "bpe.json"))
    trainer.save_checkpoint(root / "single.ckpt")
    sharded_trainer, _ = fit(root, str(root / "bpe.json"), strategy=MoEFSDPStrategy())
    sharded_trainer.save_checkpoint(root / "sharded.ckpt")
    reference = {name: t.detach().clone() for name, t in trainer.lightning_module.model.state_dict().items()}
    tokenizer_json = (root / "bpe.json").read_text()
    (root / "bpe.json").rename(root / "bpe.moved.json")
    return {"root": root, "model": trainer.lightning_module.model.eval(), "tokenizer": data.tokenizer,
            "reference": reference, "tokenizer_json": tokenizer_json,
            "sharded_model": sharded_trainer.lightning_module.model}


def test_every_checkpoint_kind_gives_the_same_greedy_text(run_dir):
    root, tokenizer = run_dir["root"], run_dir["tokenizer"]
    prompt_1S = torch.tensor([[tokenizer.eos_id, *tokenizer.encode(PROMPT).tolist()]])
    def uncached_greedy(model) -> str:  # the reference: no loader, no KV cache
        ids_1S = model.generate(prompt_1S, GREEDY.max_new_tokens, temperature=0, use_cache=False)
        return tokenizer.decode(ids_1S[0, prompt_1S.shape[1]:].tolist())

    reference_text = uncached_greedy(run_dir["model"])
    texts = {}
    for kind, path in [("lightning", root / "single.ckpt"),
                       ("export", export_checkpoint(root / "single.ckpt", root / "single.pt")),
                       ("sharded", root / "sharded.ckpt"),
                       ("export", export_checkpoint(root / "sharded.ckpt", root / "sharded.pt"))]:
        loaded = load_model(path)
        assert loaded.kind == kind
        texts[path.name] = complete(loaded.model, loaded.tokenizer, PROMPT, GREEDY)
    assert len(reference_text) > 10
    assert texts["single.ckpt"] == texts["single.pt"] == reference_text
    # the sharded run trained the same model on the same data (same seed): its own greedy text, from both kinds
    assert texts["sharded.ckpt"] == texts["sharded.pt"] == uncached_greedy(run_dir["sharded_model"])


def test_hugging_face_folder_gives_the_same_greedy_text(run_dir, tmp_path):
    from moe_lightning.hf import save_pretrained

    torch.manual_seed(0)  # a shape Mixtral can hold: every layer MoE, no shared expert
    model = MoETransformer(MoEConfig(**{**CONFIG, "n_dense_layers": 0, "n_shared_experts": 0})).eval()
    save_pretrained(model, tmp_path / "hf")
    (tmp_path / "hf" / "tokenizer.json").write_text(run_dir["tokenizer_json"])
    loaded = load_model(tmp_path / "hf")
    tokenizer = run_dir["tokenizer"]
    prompt_1S = torch.tensor([[tokenizer.eos_id, *tokenizer.encode(PROMPT).tolist()]])
    expected = model.generate(prompt_1S, GREEDY.max_new_tokens, temperature=0, use_cache=False)
    assert loaded.kind == "hf" and loaded.tokenizer.vocab_size == tokenizer.vocab_size
    assert complete(loaded.model, loaded.tokenizer, PROMPT, GREEDY) == \
        tokenizer.decode(expected[0, prompt_1S.shape[1]:].tolist())


def test_loaded_weights_equal_the_trained_ones(run_dir):
    for path in ("single.ckpt", "single.pt"):
        weights = read_checkpoint(run_dir["root"] / path).state_dict
        assert weights.keys() == run_dir["reference"].keys()
        for name, tensor in run_dir["reference"].items():
            assert torch.equal(weights[name], tensor), name


def test_tokenizer_is_recorded_and_reused_without_its_file(run_dir):
    root = run_dir["root"]
    assert not (root / "bpe.json").exists()
    for path in ("single.ckpt", "sharded.ckpt", "single.pt"):
        spec = read_checkpoint(root / path).tokenizer
        assert spec["kind"] == "tokenizers" and spec["json"] == run_dir["tokenizer_json"]
        tokenizer = load_model(root / path).tokenizer
        assert isinstance(tokenizer, HFTokenizer) and tokenizer.vocab_size == run_dir["tokenizer"].vocab_size
        assert tokenizer.encode(PROMPT).tolist() == run_dir["tokenizer"].encode(PROMPT).tolist()
        assert len(tokenizer.encode(PROMPT)) < len(PROMPT)  # BPE merged bytes: not the byte tokenizer
    assert TextDataModule(source=str(root / "corpus.txt")).state_dict() == {"tokenizer": {"kind": "bytes"}}
    assert torch.load(root / "single.pt", weights_only=True)["tokenizer"]["kind"] == "tokenizers"  # plain data


def test_generate_command_streams_the_greedy_text(run_dir, capsys):
    root = run_dir["root"]
    loaded = load_model(root / "single.ckpt")
    generate_main([str(root / "single.ckpt"), "--prompt", PROMPT, "--temperature", "0", "--max-new-tokens", "24",
                   "--no-stop"])
    assert capsys.readouterr().out == PROMPT + complete(loaded.model, loaded.tokenizer, PROMPT, GREEDY) + "\n"
    generate_main([str(root / "single.pt"), "--prompt", PROMPT, "--num-samples", "2", "--top-k", "20",
                   "--top-p", "0.9", "--max-new-tokens", "24", "--seed", "3"])
    samples = capsys.readouterr().out.split("--- sample ")[1:]
    assert [s[:4] for s in samples] == ["1/2 ", "2/2 "] and samples[0][4:] != samples[1][4:]


@pytest.mark.parametrize("flag, value, field", [("--top-p", "1.5", "top_p"), ("--temperature", "-1", "temperature"),
                                                ("--max-new-tokens", "-1", "max_new_tokens")])
def test_generate_rejects_bad_sampling_before_loading(flag, value, field, tmp_path):
    with pytest.raises(ValueError, match=field):
        generate_main([str(tmp_path / "missing.ckpt"), flag, value])  # the checkpoint is never opened


def test_generate_names_a_prompt_file_that_is_not_utf8(tmp_path):
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("café".encode("latin-1"))
    with pytest.raises(ValueError, match=r"--prompt-file=.*latin1.txt.* not UTF-8 text \(byte 0xe9 at offset 3\)"):
        generate_main([str(tmp_path / "missing.ckpt"), "--prompt-file", str(bad)])  # before the checkpoint


@pytest.mark.parametrize("argv, device, dtype", [([], "cpu", torch.float32), ([], "cuda", torch.bfloat16),
                                                 (["--dtype", "float32"], "cuda", torch.float32),
                                                 (["--dtype", "bfloat16"], "cpu", torch.bfloat16)])
def test_generate_dtype_defaults_to_bf16_on_cuda_only(argv, device, dtype, monkeypatch, tmp_path):
    import moe_lightning.commands.loading

    def record(checkpoint, device, dtype):
        raise RuntimeError(f"load_model({device}, {dtype})")

    monkeypatch.setattr(moe_lightning.commands.loading, "load_model", record)
    with pytest.raises(RuntimeError, match=rf"load_model\({device}, {dtype}\)"):
        generate_main([str(tmp_path / "x.ckpt"), "--device", device, *argv])


def test_stream_stops_before_the_end_of_document_token():
    torch.manual_seed(0)
    model = MoETransformer(MoEConfig(**CONFIG)).eval()
    prompt_1S = torch.tensor([[0, 5, 9]])
    free = list(stream(model, prompt_1S, GREEDY, eod_id=0))  # id 0 is never the greedy pick here
    assert 0 not in free and len(free) == GREEDY.max_new_tokens
    eod = free[5]  # call a token the model writes the end-of-document token: it must stop right before it
    stopped = list(stream(model, prompt_1S, Sampling(**{**vars(GREEDY), "stop_at_eod": True}), eod_id=eod))
    assert stopped == free[:free.index(eod)]


def test_streamed_text_never_shows_half_a_character():
    text = "héllo € ok"
    pieces = list(stream_text(iter(ByteTokenizer().encode(text).tolist()), ByteTokenizer()))
    assert "".join(pieces) == text and not any("\ufffd" in p for p in pieces)
    assert len(pieces) == len(text)  # one piece per character: the 2- and 3-byte ones arrive whole


def write_config(root: Path) -> Path:
    config = {"trainer": {"accelerator": "cpu", "devices": 1, "logger": False, "enable_progress_bar": False,
                          "default_root_dir": str(root)},
              "model": {"class_path": "moe_lightning.MoELanguageModel", "init_args": {"config": CONFIG}},
              "data": {"class_path": "moe_lightning.TextDataModule",
                       "init_args": {"source": str(root / "corpus.txt"), "seq_len": 16, "batch_size": 4,
                                     "val_fraction": 0.25, "tokenizer": str(root / "bpe.moved.json")}}}
    path = root / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_predict_writes_a_continuation_per_prompt(run_dir):
    root = run_dir["root"]
    prompts = [{"prompt": PROMPT, "id": 7}, {"prompt": "import torch\n"}]
    (root / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))
    # The config says bytes; the checkpoint recorded the BPE it was trained with, and that one must be used.
    run(["predict", "--config", str(write_config(root)), "--ckpt_path", str(root / "single.ckpt"),
         "--data.init_args.tokenizer", "null",
         "--prompts", str(root / "prompts.jsonl"), "--out", str(root / "out.jsonl"),
         "--max-new-tokens", "24", "--temperature", "0", "--no-stop"])  # generate's flags, spelled alike
    records = [json.loads(line) for line in (root / "out.jsonl").read_text().splitlines()]
    loaded = load_model(root / "single.ckpt")
    assert [{k: v for k, v in r.items() if k != "completion"} for r in records] == prompts  # fields kept, in order
    assert [r["completion"] for r in records] == [complete(loaded.model, loaded.tokenizer, p["prompt"], GREEDY)
                                                  for p in prompts]


def test_predict_on_more_than_one_process_is_refused_before_reading_prompts(tmp_path):
    from types import SimpleNamespace

    from moe_lightning.commands.cli import MoECLI

    cli = SimpleNamespace(trainer=SimpleNamespace(world_size=2))  # the prompts file does not even exist
    with pytest.raises(ValueError, match=r"world_size=2.*--trainer.devices=1.*moe-lightning generate"):
        MoECLI.predict(cli, model=None, prompts=str(tmp_path / "missing.jsonl"))


def test_test_reports_held_out_loss_and_perplexity(run_dir):
    """The mean over every held-out token, with a short last batch (so per-batch weights matter): the batch size is
    chosen from the split's own sequence count, so no corpus or tokenizer version can make it divide evenly."""
    root = run_dir["root"]
    probe = TextDataModule(source=str(root / "corpus.txt"), seq_len=16, batch_size=1, val_fraction=0.25,
                           tokenizer=str(root / "bpe.moved.json"))
    probe.setup("test")
    sequences = len(probe.test_dataloader())
    batch_size = next(b for b in range(4, sequences) if sequences % b)
    cli = run(["test", "--config", str(write_config(root)), "--ckpt_path", str(root / "single.ckpt"),
               f"--data.init_args.batch_size={batch_size}"])
    data = cli.datamodule
    model = run_dir["model"]
    batches = list(data.test_dataloader())
    assert len(batches) >= 2 and batches[-1].shape[0] < batches[0].shape[0]  # a short last batch: weights matter
    held_out = torch.cat(batches)
    with torch.no_grad():  # independent: float64 mean over every held-out token at once
        mean = F.cross_entropy(model(held_out[:, :-1]).flatten(0, 1).double(), held_out[:, 1:].flatten())
    metrics = cli.trainer.callback_metrics
    assert metrics["test/loss"].item() == pytest.approx(mean.item(), rel=1e-5)  # fp32 sums over ~1e3 tokens
    assert metrics["test/perplexity"].item() == pytest.approx(mean.exp().item(), rel=1e-5)


def test_help_lists_every_command_and_renders_plain(capsys):
    run(["--help"])
    lines = capsys.readouterr().out.splitlines()
    for name in ("fit", "validate", "test", "predict", "generate", "tokenize", "plan", "export"):
        assert sum(line.split()[:1] == [name] for line in lines) == 1, name
    assert set(EXTRA_COMMANDS) <= set(COMMANDS)  # a newly registered command needs its help line
    for command in ("fit", "test", "predict"):
        with pytest.raises(SystemExit):
            run([command, "--help"])
        text = capsys.readouterr().out
        assert "``" not in text and ":class:" not in text and ":meth:" not in text
        assert COMMANDS[command] in text.replace("\n", " ")


def test_export_without_a_tokenizer_record_falls_back_to_bytes(run_dir, tmp_path):
    payload = torch.load(run_dir["root"] / "single.pt", weights_only=True)
    del payload["tokenizer"]  # an export from before tokenizers were recorded
    torch.save(payload, tmp_path / "old.pt")
    assert isinstance(load_model(tmp_path / "old.pt").tokenizer, ByteTokenizer)


def test_declared_eos_token_is_recorded_and_restored(run_dir, tmp_path):
    """A released model's tokenizer ends documents with its own eos token (tokenizer_config.json): the spec
    carries that choice, so the rebuilt tokenizer has the same ids without either file."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(run_dir["tokenizer_json"])
    tok.add_special_tokens(["<|endoftext|>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<|endoftext|>"}}))
    spec = HFTokenizer(str(tmp_path / "tokenizer.json")).spec()
    (tmp_path / "tokenizer.json").unlink()
    (tmp_path / "tokenizer_config.json").unlink()
    restored = tokenizer_from_spec(spec)
    assert restored.eos_id == tok.token_to_id("<|endoftext|>") == tok.get_vocab_size() - 1  # inside the vocab
    assert restored.vocab_size == tok.get_vocab_size()


def predict_argv(root: Path, prompts: Path, out: Path) -> list[str]:
    return ["predict", "--config", str(write_config(root)), "--ckpt_path", str(root / "single.ckpt"),
            "--prompts", str(prompts), "--out", str(out), "--max-new-tokens", "4", "--temperature", "0"]


@pytest.mark.parametrize("content, message", [
    ("", "holds no prompt"),
    ("\n  \n", "holds no prompt"),
    ('{"prompt": "a"}\n{"prompt": \n', r"prompts.jsonl:2: not a JSON record"),
    ('{"text": "a"}\n', r"prompts.jsonl:1: each record needs a text field 'prompt'"),
])
def test_predict_refuses_bad_prompts_before_running_and_keeps_the_previous_output(run_dir, tmp_path, content,
                                                                                   message):
    """Before: an empty prompts file crashed (TypeError) after emptying an existing --out file."""
    previous = '{"prompt": "x", "completion": "kept"}\n' * 40
    (tmp_path / "out.jsonl").write_text(previous)
    (tmp_path / "prompts.jsonl").write_text(content)
    with pytest.raises(ValueError, match=message):
        run(predict_argv(run_dir["root"], tmp_path / "prompts.jsonl", tmp_path / "out.jsonl"))
    assert (tmp_path / "out.jsonl").read_text() == previous
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.jsonl", "prompts.jsonl"]  # no partial left


def test_predict_output_is_replaced_whole_and_a_long_prompt_is_named(run_dir, tmp_path):
    """A prompt longer than max_seq_len (32 here) is continued from its last 32 tokens: said, not silent."""
    (tmp_path / "out.jsonl").write_text("old\n")
    long_prompt = "import torch\n" * 20
    (tmp_path / "prompts.jsonl").write_text(json.dumps({"prompt": "def"}) + "\n" + json.dumps({"prompt": long_prompt}))
    with pytest.warns(UserWarning, match=r"1 prompt\(s\) longer than model.config.max_seq_len=32 tokens.*prompt 2 "
                                         r"\(\d+ tokens\).*last 32 tokens"):
        run(predict_argv(run_dir["root"], tmp_path / "prompts.jsonl", tmp_path / "out.jsonl"))
    records = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [r["prompt"] for r in records] == ["def", long_prompt] and all("completion" in r for r in records)


def test_prompts_may_hold_characters_python_counts_as_line_breaks(tmp_path):
    """JSON strings may hold U+2028/U+2029/U+0085 unescaped; ``str.splitlines`` broke such a record in two."""
    from moe_lightning.commands.generate import read_prompts
    prompts = [{"prompt": "a\u2028b\u2029c\x85d"}, {"prompt": "e"}]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(p, ensure_ascii=False) + "\r\n" for p in prompts),
                                      encoding="utf-8")
    assert read_prompts(str(tmp_path / "p.jsonl")) == prompts


def test_predict_into_a_folder_that_cannot_be_written_is_refused_before_generating(run_dir, tmp_path, monkeypatch):
    """Before: the prompts were generated, then the write failed (NotADirectoryError)."""
    (tmp_path / "prompts.jsonl").write_text(json.dumps({"prompt": "def"}) + "\n")
    (tmp_path / "a_file").write_text("")
    monkeypatch.setattr(MoELanguageModel, "predict_step", lambda *a, **k: pytest.fail("generated before the check"))
    with pytest.raises(PermissionError, match=r"^--out: cannot write into .*a_file/sub \(.*a_file is not a folder\)"):
        run(predict_argv(run_dir["root"], tmp_path / "prompts.jsonl", tmp_path / "a_file" / "sub" / "out.jsonl"))
