"""``moe-lightning``: LightningCLI's fit/validate/test/predict, plus ``tokenize``."""

import importlib
import sys
from pathlib import Path

from lightning.pytorch.cli import LightningCLI, SaveConfigCallback

from .data import TextDataModule
from .module import MoELanguageModel


class SaveConfigBesideLogs(SaveConfigCallback):
    """Save the resolved config in the logger's folder; without a logger (or in ``fast_dev_run``) skip it
    rather than drop ``config.yaml`` into the working directory, where a second run would refuse to start."""

    def setup(self, trainer, pl_module, stage: str) -> None:
        if trainer.logger is not None and not trainer.fast_dev_run:
            super().setup(trainer, pl_module, stage)


class MoECLI(LightningCLI):
    """LightningCLI with the MoE model and text data as defaults (subclasses allowed by ``class_path``)."""

    def add_arguments_to_parser(self, parser) -> None:
        parser.set_defaults({"trainer.precision": "32-true"})

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
    "tokenize": "moe_lightning.data:tokenize_main",
    "plan": "moe_lightning.plan:main",
    "export": "moe_lightning.hf.convert:export_main",  # --hf writes Hugging Face; otherwise checkpoint.export_main
    "convert": "moe_lightning.hf.convert:convert_main",
}


def main(argv: list[str] | None = None) -> None:
    """Console entry point (its return value would become the exit status, so it returns nothing)."""
    run(argv)


def run(argv: list[str] | None = None) -> MoECLI | None:
    """Run a command and return the CLI object (for tests and notebooks); ``argv=None`` reads the command line."""
    if "" not in sys.path and "." not in sys.path:
        sys.path.insert(0, "")  # like `python -m`: class_paths from the user's project resolve from cwd
    words = sys.argv[1:] if argv is None else argv
    if words and words[0] in EXTRA_COMMANDS:
        module_name, function_name = EXTRA_COMMANDS[words[0]].split(":")
        return getattr(importlib.import_module(module_name), function_name)(words[1:])
    return MoECLI(MoELanguageModel, TextDataModule, subclass_mode_model=True, subclass_mode_data=True, args=argv,
                  save_config_callback=SaveConfigBesideLogs, save_config_kwargs={"overwrite": False})
