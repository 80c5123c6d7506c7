"""``moe-lightning``: LightningCLI's fit/validate/test/predict, plus generate, tokenize, plan, export."""

import importlib
import json
import re
import sys
from pathlib import Path

import torch
from jsonargparse import DefaultHelpFormatter
from lightning.pytorch.cli import LightningCLI, SaveConfigCallback

from .data import TextDataModule
from .generate import Sampling, encode_prompt
from .module import MoELanguageModel

# Every command with one line, for `moe-lightning --help` (LightningCLI's own listing shows only its four).
COMMANDS = {
    "fit": "train a model from a YAML config (--config configs/tiny.yaml)",
    "validate": "loss on the validation split, from a config and --ckpt_path",
    "test": "loss and perplexity on the held-out split (or another --data.init_args.source)",
    "predict": "continue every prompt of a JSONL file (--prompts in.jsonl --out out.jsonl)",
    "generate": "continue a prompt from any checkpoint, streaming the text (CKPT --prompt TEXT)",
    "tokenize": "pre-tokenize a corpus into a memory-mapped .npy token file",
    "plan": "memory and speed plan of a config on a cluster, without GPUs",
    "export": "write any checkpoint as one inference file that records its tokenizer",
    "convert": "Hugging Face folder <-> single-file checkpoint",
}


class SaveConfigBesideLogs(SaveConfigCallback):
    """Save the resolved config in the logger's folder; without a logger (or in ``fast_dev_run``) skip it
    rather than drop ``config.yaml`` into the working directory, where a second run would refuse to start."""

    def setup(self, trainer, pl_module, stage: str) -> None:
        if trainer.logger is not None and not trainer.fast_dev_run:
            super().setup(trainer, pl_module, stage)


class PlainHelpFormatter(DefaultHelpFormatter):
    """Help text without the reStructuredText of Lightning's docstrings (``x``, :class:`~a.b.C`, `x`)."""

    def _strip(self, text: str) -> str:
        text = re.sub(r":\w+:`~?([^`]*?)`", lambda m: m.group(1).rsplit(".", 1)[-1] if "~" in m.group(0)
                      else m.group(1), text)
        return re.sub(r"``([^`]*)``|`([^`]*)`", lambda m: m.group(1) or m.group(2) or "", text)

    def _split_lines(self, text: str, width: int) -> list[str]:
        return super()._split_lines(self._strip(text), width)

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return super()._fill_text(self._strip(text), width, indent)

    def start_section(self, heading: str | None) -> None:
        super().start_section(heading and self._strip(heading))


class MoECLI(LightningCLI):
    """LightningCLI with the MoE model and text data as defaults (subclasses allowed by ``class_path``)."""

    def init_parser(self, **kwargs):
        return super().init_parser(**{"formatter_class": PlainHelpFormatter, **kwargs})

    def add_arguments_to_parser(self, parser) -> None:
        parser.set_defaults({"trainer.precision": "32-true"})

    def _prepare_subcommand_parser(self, klass: type, subcommand: str, **kwargs):
        """``predict`` also takes the prompt file, output file and sampling options (``MoECLI.predict``'s arguments).
        (LightningCLI has no public hook for per-subcommand arguments; this method exists since lightning 1.5.)"""
        parser = super()._prepare_subcommand_parser(klass, subcommand, **kwargs)
        if subcommand == "predict":
            self._subcommand_method_arguments["predict"] += parser.add_method_arguments(
                type(self), "predict", as_group=False, skip={"model", "datamodule", "trainer_kwargs"})
        return parser

    def predict(self, model: MoELanguageModel, datamodule: TextDataModule | None = None, *, prompts: str = "",
                out: str | None = None, max_new_tokens: int = 64, temperature: float = 0.0, top_k: int | None = None,
                top_p: float | None = None, stop: bool = True, seed: int = 0, **trainer_kwargs) -> None:
        """Continue every prompt of a JSONL file; write one JSONL record per prompt with ``completion`` added.

        Args:
            prompts: JSONL file, one record per line with the text to continue under ``prompt``.
            out: Output JSONL (default: ``predictions.jsonl`` in the run's log folder).
            max_new_tokens: Tokens to sample per prompt.
            temperature: Sampling temperature (0 = greedy).
            top_k: Sample among the k most likely tokens.
            top_p: Sample among the most likely tokens holding this probability mass.
            stop: End a continuation at the end-of-document token.
            seed: Sampling seed of the first prompt (prompt i uses seed + i).
        """
        path = Path(prompts)
        if not path.is_file():
            raise FileNotFoundError(f"--prompts={prompts!r}: no such file; pass a JSONL file with a 'prompt' field "
                                    "per line.")
        records = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        for line_no, record in enumerate(records, 1):
            if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
                raise ValueError(f"{prompts}:{line_no}: each record needs a text field 'prompt'.")
        tokenizer = datamodule.tokenizer
        batches = [{"tokens_1S": encode_prompt(tokenizer, r["prompt"], "cpu"), "eod_id": tokenizer.eos_id,
                    "sampling": Sampling(max_new_tokens, temperature, top_k, top_p, stop, seed + i)}
                   for i, r in enumerate(records)]
        loader = torch.utils.data.DataLoader(batches, batch_size=None)
        predictions = self.trainer.predict(model, dataloaders=loader, **trainer_kwargs)
        target = Path(out) if out else Path(self.trainer.log_dir or ".") / "predictions.jsonl"
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(target, "w", encoding="utf-8") as f:
            for record, ids in zip(records, predictions):
                f.write(json.dumps({**record, "completion": tokenizer.decode(ids)}, ensure_ascii=False) + "\n")
        print(f"wrote {len(records)} continuations to {target}")

    def before_instantiate_classes(self) -> None:
        """A pretrained directory's ``tokenizer.json`` becomes the data's tokenizer unless one is set."""
        config = self.config[self.subcommand] if self.subcommand else self.config
        pretrained = config.get("model.init_args.pretrained")
        tokenizer = Path(pretrained or "") / "tokenizer.json"
        if pretrained and "data.init_args.tokenizer" in config and config.get("data.init_args.tokenizer") is None \
                and tokenizer.is_file():
            config["data.init_args.tokenizer"] = str(tokenizer)

    def before_fit(self) -> None:
        vocab = self.datamodule.vocab_size
        if self.model.config.vocab_size < vocab:
            raise ValueError(f"model.config.vocab_size={self.model.config.vocab_size} is smaller than the "
                             f"tokenizer's {vocab} tokens: set model.config.vocab_size >= {vocab}.")
        eos_id = getattr(getattr(self.datamodule, "tokenizer", None), "eos_id", None)
        if self.model.config.document_masking and eos_id is not None and self.model.config.eod_token_id != eos_id:
            raise ValueError(f"model.config.eod_token_id={self.model.config.eod_token_id} is not the tokenizer's "
                             f"end-of-document id {eos_id}: set model.config.eod_token_id: {eos_id}.")


# Commands beside LightningCLI's subcommands: name -> "module:function(argv)", imported only when used.
EXTRA_COMMANDS = {
    "generate": "moe_lightning.generate:main",
    "tokenize": "moe_lightning.data:tokenize_main",
    "plan": "moe_lightning.plan:main",
    "export": "moe_lightning.hf.convert:export_main",  # --hf writes Hugging Face; otherwise loading.export_main
    "convert": "moe_lightning.hf.convert:convert_main",
}


def print_commands() -> None:
    """Every command this install has (``convert`` comes with ``moe_lightning.hf``)."""
    names = [name for name in COMMANDS if name in EXTRA_COMMANDS or name in MoECLI.subcommands()]
    width = max(map(len, names))
    lines = [f"  {name:<{width}}  {COMMANDS[name]}" for name in names]
    print("usage: moe-lightning COMMAND [options]   (moe-lightning COMMAND --help for its options)\n\n"
          "Train Mixture-of-Experts language models with Lightning.\n\ncommands:\n" + "\n".join(lines))


def main(argv: list[str] | None = None) -> None:
    """Console entry point (its return value would become the exit status, so it returns nothing)."""
    run(argv)


def run(argv: list[str] | None = None) -> MoECLI | None:
    """Run a command and return the CLI object (for tests and notebooks); ``argv=None`` reads the command line."""
    if "" not in sys.path and "." not in sys.path:
        sys.path.insert(0, "")  # like `python -m`: class_paths from the user's project resolve from cwd
    words = sys.argv[1:] if argv is None else argv
    if not words or words[0] in ("-h", "--help"):
        print_commands()
        return None
    if words[0] in EXTRA_COMMANDS:
        module_name, function_name = EXTRA_COMMANDS[words[0]].split(":")
        return getattr(importlib.import_module(module_name), function_name)(words[1:])
    descriptions = {name: {"description": COMMANDS[name]} for name in MoECLI.subcommands()}
    return MoECLI(MoELanguageModel, TextDataModule, subclass_mode_model=True, subclass_mode_data=True, args=argv,
                  parser_kwargs=descriptions,
                  save_config_callback=SaveConfigBesideLogs, save_config_kwargs={"overwrite": False})
