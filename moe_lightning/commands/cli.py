"""LightningCLI's fit/validate/test/predict for ``moe-lightning`` (the entry point, the command table and the other
commands: ``moe_lightning.commands.main``, which imports this module only for these four)."""

import dataclasses
import errno
import importlib
import inspect
import json
import logging
import os
import re
import sys
import warnings
from functools import partial
from pathlib import Path

import torch
import yaml
from jsonargparse import DefaultHelpFormatter, Namespace
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI, SaveConfigCallback
from lightning.pytorch.trainer.states import TrainerStatus
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only

from moe_lightning.data import TextDataModule
from moe_lightning.run.durable import write_text
from moe_lightning.commands.generate import add_sampling_arguments, encode_prompt, read_prompts, sampling_from, warn_long_prompts
from moe_lightning.commands.loading import checkpoint_tokenizer
from moe_lightning.training.module import MoELanguageModel
from moe_lightning.checkpoint.compat import check_checkpoint
from moe_lightning.data.tokenizer import load_tokenizer, tokenizer_identity
from moe_lightning.checkpoint.commit import remove_unfinished_saves
from moe_lightning.run.folders import remove_empty_run_folder
from moe_lightning.run.refusals import in_multi_process_run, say_refusal, traceback_requested
from moe_lightning.training.callbacks.preemption import exit_if_stopped_by_max_time
from moe_lightning.training.callbacks.resume import resolve_last
from moe_lightning.training.callbacks.run_folders import ReleaseLocks, allocate_run_folder, lock_run_folders



TOKENIZER_FILE_HINTS = ("token", "vocab", "merges", ".model", "tiktoken", "spm")  # names tokenizer files carry


def pretrained_tokenizer(pretrained: str | Path) -> str:
    """The ``tokenizer.json`` of a pretrained folder, for a run that names no tokenizer. Without one (a Kimi K2
    folder ships tiktoken files only) the data would fall back to byte ids, which are not the model's vocabulary:
    refused, naming the tokenizer files the folder does hold."""
    folder = Path(pretrained)
    if not folder.is_dir():
        state = "is a file, not a folder" if folder.exists() else "does not exist"
        raise ValueError(f"model.pretrained={str(pretrained)!r} {state}: pass the Hugging Face model's folder "
                         f"(config.json and its safetensors).")
    if (folder / "tokenizer.json").is_file():
        return str(folder / "tokenizer.json")
    found = sorted(p.name for p in folder.iterdir() if any(h in p.name.lower() for h in TOKENIZER_FILE_HINTS))
    raise ValueError(f"model.pretrained={str(pretrained)!r} has no tokenizer.json (tokenizer files found: "
                     f"{', '.join(found) or 'none'}), so the data would be byte ids, not this model's vocabulary: "
                     f"produce a tokenizer.json from them (e.g. convert the tokenizer with its own tools) and put it "
                     f"in the folder or pass --data.init_args.tokenizer=<that tokenizer.json>.")


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


def default_precision(accelerator, cuda_available: bool, bf16_supported: bool) -> str:
    """``trainer.precision`` when the config leaves it unset: bf16 mixed precision on CUDA GPUs that have
    bf16 (grouped-mm experts and fused attention kernels need it; fp32 takes slow fallbacks), fp32 elsewhere."""
    name = str(getattr(accelerator, "class_path", accelerator)).lower()
    on_cuda = cuda_available and (name in ("auto", "gpu", "cuda") or "cudaaccelerator" in name)
    return "bf16-mixed" if on_cuda and bf16_supported else "32-true"


def root_cause(error: BaseException) -> BaseException:
    """The deepest exception in ``error``'s chain that was not raised by jsonargparse itself: the one that
    says what is wrong (jsonargparse wraps it in "Does not validate against any of the Union subtypes")."""
    chain, seen = [], set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        chain.append(error)
        error = error.__cause__ or error.__context__
    ours = [e for e in chain if not _raised_in(e, "jsonargparse")]
    return ours[-1] if ours else chain[0]


def _raised_in(error: BaseException, package: str) -> bool:
    tb = error.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    return f"{package}/" in tb.tb_frame.f_code.co_filename.replace("\\", "/")


_PARSE_NOISE = ("Does not validate", "Subtypes:", "Errors:", "Given value", "Expected a <class 'NoneType'>",
                "Problem with given class_path", "Parser key")


def summarize_parse_error(message: str) -> str | None:
    """One line for jsonargparse's nested union report: the keys down to the failing value, and what failed
    there (the report lists every union alternative, ``None`` included, with the whole given value)."""
    keys = re.findall(r'Parser key "([^"]+)"', message)
    leaves = [(len(line) - len(line.lstrip()), line.strip().removeprefix("- ")) for line in message.splitlines()]
    leaves = [(depth, text) for depth, text in leaves if text and not text.startswith(_PARSE_NOISE)]
    if not keys or not leaves:
        return None
    deepest = max(depth for depth, _ in leaves)
    failed = " | ".join(text for depth, text in leaves if depth == deepest)
    given = [g for g in re.findall(r"Given value: (.*)", message) if len(g) < 80 and not g.startswith("NestedArg")]
    shown = f" (given {given[-1]})" if given and "Got value" not in failed else ""
    return f"error: {'.'.join(keys)}{shown}: {failed}"


class MoEArgumentParser(LightningArgumentParser):
    """A parse error is one line (``moe-lightning fit: error: <keys>: <what failed>``) and exit status 2; with
    ``--traceback`` jsonargparse's whole report, ended by that summary."""

    command = "fit"  # the subcommand being parsed (``lightning_cli`` sets it): the error line names it

    def error(self, message: str, ex: Exception | None = None):
        short = summarize_parse_error(message)
        if not self.exit_on_error or traceback_requested():  # a nested parse (jsonargparse handles it) or debugging
            super().error(f"{message}\n{short}" if short else message, ex)
        lines = [line.strip() for line in message.splitlines() if line.strip()]
        said = short.removeprefix("error: ") if short else lines[-1] if lines else "invalid arguments"
        say_refusal(self.command, f"{said} (see moe-lightning {self.command} --help)")
        self.exit(2)


def _import_class(class_path: str):
    module, _, name = class_path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def check_weight_decay(model: Namespace) -> None:
    """``model.init_args.weight_decay`` is the one source (parameter groups carry it, zero for norms, biases and
    embeddings); an optimizer ``weight_decay`` other than its class default or that value would be ignored."""
    init_args = model.get("init_args") if isinstance(model.get("init_args"), Namespace) else model
    optimizer = init_args.get("optimizer")
    if not isinstance(optimizer, Namespace) or "weight_decay" not in init_args or not optimizer.get("init_args"):
        return
    own = optimizer.init_args.get("weight_decay")
    parameter = inspect.signature(_import_class(optimizer.class_path)).parameters.get("weight_decay")
    if own is None or parameter is None or own in (parameter.default, init_args.weight_decay):
        return
    raise ValueError(
        f"model.init_args.optimizer.init_args.weight_decay={own} conflicts with model.init_args.weight_decay="
        f"{init_args.weight_decay}: parameter groups carry model.init_args.weight_decay (decay on matrices, never "
        f"on norms, biases or embeddings), so the optimizer's own value would be ignored. Set "
        f"model.init_args.weight_decay={own} and leave the optimizer's weight_decay unset.")


def check_gradient_clip(trainer: Namespace) -> None:
    value = trainer.get("gradient_clip_val")
    if value is not None and value < 0:  # clipping scales by min(1, value / norm): a negative value flips gradients
        raise ValueError(f"trainer.gradient_clip_val={value}: must be >= 0 (a negative norm would turn every "
                         "gradient around); 0 or null disables clipping.")


def check_tokenizer(config: Namespace, subcommand: str, ckpt_path: str | None) -> None:
    """The data's tokenizer must be the one the checkpoint was trained with: the same ids would mean other text.
    (``predict`` without a tokenizer uses the checkpoint's own.)"""
    if not ckpt_path or not Path(ckpt_path).exists() or "data.init_args.tokenizer" not in config:
        return  # "last"/"best" are resolved by Lightning; a custom DataModule may have no tokenizer argument
    requested = config.get("data.init_args.tokenizer")
    if subcommand == "predict" and requested is None:
        return
    recorded = checkpoint_tokenizer(ckpt_path).spec()
    if tokenizer_identity(load_tokenizer(requested).spec()) == tokenizer_identity(recorded):
        return
    if recorded["kind"] == "tokenizers":
        saved, fix = f"the tokenizers file {recorded['path']}", f"pass --data.init_args.tokenizer={recorded['path']}"
    else:
        saved, fix = "the byte-level tokenizer", "leave data.init_args.tokenizer unset"
    raise ValueError(f"data.init_args.tokenizer={requested!r} is not the tokenizer ckpt_path={str(ckpt_path)!r} was "
                     f"trained with ({saved}): its token ids would stand for other text. {fix}.")


def check_writable_folder(folder: Path, flag: str) -> None:
    """Refuse, before the work that fills it, a file whose folder cannot be made or written (its nearest existing
    ancestor must be a writable folder)."""
    existing = next(p for p in (folder, *folder.parents) if p.exists())
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        why = "is not a folder" if not existing.is_dir() else "is not writable"
        raise PermissionError(f"{flag}: cannot write into {folder} ({existing} {why}); pass a path in a writable "
                              "folder.")


class MoECLI(LightningCLI):
    """LightningCLI with the MoE model and text data as defaults (subclasses allowed by ``class_path``)."""

    def init_parser(self, **kwargs):
        return super().init_parser(**{"formatter_class": PlainHelpFormatter, **kwargs})

    def _parse_ckpt_path(self) -> None:
        """Replaces LightningCLI's re-parse of the checkpoint's hyperparameters (which silently beat the command
        line): the command line wins, and ``_check_resume`` refuses a checkpoint of another model or data."""

    def _check_resume(self, data=None) -> None:
        """The resume guard (``compat.check_checkpoint``), after ``last`` is resolved and before the model is built
        or the run writes anything: the model for every subcommand, the data's position for ``fit``. (What the CLI
        cannot see has one backup each: ``MoELanguageModel.on_load_checkpoint``, ``compat.check_position``.)"""
        ckpt_path = self.config_init[self.subcommand].get("ckpt_path")
        if not ckpt_path:
            return
        model = self.config[self.subcommand].model
        init_args = model.init_args if isinstance(model.get("init_args"), Namespace) else model
        tokenizer = partial(check_tokenizer, self.config[self.subcommand], self.subcommand, ckpt_path)
        for line in check_checkpoint(ckpt_path, init_args.as_dict(), data, tokenizer, self.subcommand == "fit"):
            rank_zero_info(line)

    def before_instantiate_classes(self) -> None:
        """Checks and defaults that need the whole parsed config: one weight decay, precision from the device, and
        a pretrained directory's ``tokenizer.json`` as the data's tokenizer unless one is set."""
        config = self.config[self.subcommand] if self.subcommand else self.config
        check_weight_decay(config.model)
        if self.subcommand != "fit" and config.get("ckpt_path") == "last":  # Lightning would only warn, then run
            raise ValueError(f"--ckpt_path last is for fit (continuing a run); {self.subcommand} would use untrained "
                             f"weights: pass --ckpt_path=<checkpoint file> (e.g. <run>/checkpoints/last.ckpt).")
        # Each run has its own folder, so every resume restores a ModelCheckpoint whose dirpath was another run's,
        # and Lightning warns "The dirpath has changed" each time (the log already says what was resumed).
        warnings.filterwarnings("ignore", message="The dirpath has changed from")
        # Lightning 2.6 with torch >= 2.12 warns from its own code at every fit: nothing a user can act on.
        warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")
        logger_args = config.trainer.get("logger")
        logger_args = logger_args.get("init_args") if isinstance(logger_args, Namespace) else None
        if self.subcommand != "fit" and isinstance(logger_args, Namespace) and "name" in logger_args:
            # validate/test/predict log beside the training runs (<name>-test/version_N), never as a new run folder
            logger_args.name = f"{logger_args.name or 'lightning_logs'}-{self.subcommand}"
        pretrained = config.get("model.init_args.pretrained")
        if pretrained and "data.init_args.tokenizer" in config and config.get("data.init_args.tokenizer") is None:
            config["data.init_args.tokenizer"] = pretrained_tokenizer(pretrained)
        check_gradient_clip(config.trainer)
        self._precision_defaulted = config.trainer.precision is None
        if self._precision_defaulted:
            cuda = torch.cuda.is_available()
            config.trainer.precision = default_precision(config.trainer.accelerator, cuda,
                                                         cuda and torch.cuda.is_bf16_supported())

    def instantiate_classes(self) -> None:
        try:
            super().instantiate_classes()
        except (ValueError, TypeError) as error:
            cause = root_cause(error)
            if cause is error:
                raise
            raise cause from None  # our message last, not jsonargparse's namespace dump

    def instantiate_trainer(self, **kwargs):
        """The trainer, writing single-file checkpoints beside and renaming them (unless a plugin says otherwise),
        with the step progress bar and the summary without FLOPs unless the config names its own."""
        from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
        from lightning.pytorch.callbacks import ModelSummary, ProgressBar
        from moe_lightning.training.callbacks.console import StepProgressBar, SummaryWithoutFlops
        from moe_lightning.training.checkpoint_io import FileCheckpointIO

        config = self._get(self.config_init, "trainer", default={})
        callbacks = kwargs.get("callbacks", config.get("callbacks"))
        callbacks = [] if callbacks is None else list(callbacks) if isinstance(callbacks, (list, tuple)) \
            else [callbacks]
        for kind, ours, flag in ((ProgressBar, StepProgressBar, "enable_progress_bar"),
                                 (ModelSummary, SummaryWithoutFlops, "enable_model_summary")):
            if config.get(flag) is not False and not any(isinstance(c, kind) for c in callbacks):
                callbacks.append(ours())
        trainer = super().instantiate_trainer(**{**kwargs, "callbacks": callbacks})
        if type(trainer.strategy.checkpoint_io) is TorchCheckpointIO:  # Lightning's default
            trainer.strategy.checkpoint_io = FileCheckpointIO()
        return trainer

    def after_instantiate_classes(self) -> None:
        how = " (the default on this accelerator; set trainer.precision to change it)" if self._precision_defaulted else ""
        rank_zero_info(f"precision: {self.trainer.precision}{how}")

    def _check_model_fits_data(self) -> None:
        config, data = self.model.config, self.datamodule
        if config.vocab_size < data.vocab_size:
            raise ValueError(f"model.config.vocab_size={config.vocab_size} is smaller than the tokenizer's "
                             f"{data.vocab_size} tokens: set model.config.vocab_size >= {data.vocab_size}.")
        if data.seq_len > config.max_seq_len:
            raise ValueError(f"data.seq_len={data.seq_len} exceeds model.config.max_seq_len={config.max_seq_len}: "
                             f"lower data.seq_len or raise model.config.max_seq_len.")
        eos_id = getattr(getattr(data, "tokenizer", None), "eos_id", None)
        if config.document_masking and eos_id is not None and config.eod_token_id != eos_id:
            raise ValueError(f"model.config.eod_token_id={config.eod_token_id} is not the tokenizer's "
                             f"end-of-document id {eos_id}: set model.config.eod_token_id: {eos_id}.")

    def _prepare_subcommand_parser(self, klass: type, subcommand: str, **kwargs):
        """``predict`` also takes the prompt file, output file and sampling options (``MoECLI.predict``'s arguments).
        (LightningCLI has no public hook for per-subcommand arguments; this method exists since lightning 1.5.)"""
        parser = super()._prepare_subcommand_parser(klass, subcommand, **kwargs)
        if subcommand == "predict":
            self._subcommand_method_arguments["predict"] += parser.add_method_arguments(
                type(self), "predict", as_group=False, skip={"model", "datamodule", "trainer_kwargs", "sampling"})
            self._subcommand_method_arguments["predict"] += add_sampling_arguments(parser)  # generate's, alike
        return parser

    def predict(self, model: MoELanguageModel, datamodule: TextDataModule | None = None, *, prompts: str = "",
                out: str | None = None, **trainer_and_sampling_kwargs) -> None:
        """Continue every prompt of a JSONL file; write one JSONL record per prompt with ``completion`` added.
        The sampling flags are ``generate``'s (``generate.add_sampling_arguments``); prompt i uses seed + i.

        Args:
            prompts: JSONL file, one record per line with the text to continue under ``prompt``.
            out: Output JSONL (default: ``predictions.jsonl`` in the run's log folder).
        """
        sampling_keys = {"max_new_tokens", "temperature", "top_k", "top_p", "stop", "seed"}
        sampling = sampling_from(**{k: v for k, v in trainer_and_sampling_kwargs.items() if k in sampling_keys})
        trainer_kwargs = {k: v for k, v in trainer_and_sampling_kwargs.items() if k not in sampling_keys}
        if self.trainer.world_size > 1:  # the distributed sampler would split the prompts across processes
            raise ValueError(f"predict runs in one process (trainer.world_size={self.trainer.world_size}): pass "
                             "--trainer.devices=1 --trainer.num_nodes=1, or use `moe-lightning generate`.")
        records = read_prompts(prompts)
        target = Path(out) if out else Path(self.trainer.log_dir or ".") / "predictions.jsonl"
        check_writable_folder(target.parent, "--out" if out else "trainer.logger.init_args.save_dir")
        ckpt_path = trainer_kwargs.get("ckpt_path")  # the checkpoint's own tokenizer beats the config's
        recorded = ckpt_path and Path(ckpt_path).exists()  # not "last"/"best", which Lightning resolves
        tokenizer = checkpoint_tokenizer(ckpt_path) if recorded else datamodule.tokenizer
        batches = [{"tokens_1S": encode_prompt(tokenizer, r["prompt"], "cpu"), "eod_id": tokenizer.eos_id,
                    "sampling": dataclasses.replace(sampling, seed=sampling.seed + i)}
                   for i, r in enumerate(records)]
        warn_long_prompts([b["tokens_1S"].shape[1] for b in batches], model.config.max_seq_len, prompts)
        loader = torch.utils.data.DataLoader(batches, batch_size=None)
        predictions = self.trainer.predict(model, dataloaders=loader, **trainer_kwargs)
        write_text(target, "".join(json.dumps({**record, "completion": tokenizer.decode(ids)}, ensure_ascii=False)
                                   + "\n" for record, ids in zip(records, predictions, strict=True)))
        print(f"wrote {len(records)} continuations to {target}")

    def before_fit(self) -> None:
        self._check_model_fits_data()
        config = self.config_init[self.subcommand]
        last = config.get("ckpt_path") == "last"
        if last:  # any earlier run of this command, not only this version
            config["ckpt_path"] = resolve_last(self.trainer)
        self._check_resume(self._data_to_check())  # reads only: a refused resume leaves nothing behind
        # one run per checkpoint folder (and one continuation of a run), before cleaning it
        lock_run_folders(self.trainer, resumed=config["ckpt_path"] if last else None)
        self._remove_stale_partial_checkpoints()

    def _data_to_check(self) -> TextDataModule | None:
        """The datamodule, attached to the trainer as ``trainer.fit`` will (so ``setup`` maps the run's tokenized
        folders), unless describing it would tokenize text first (``awaits_tokenizing``): the restore checks that
        data instead (``TextDataModule._restore``)."""
        data = self.datamodule
        data.trainer = self.trainer
        return None if isinstance(data, TextDataModule) and data.awaits_tokenizing() else data

    def before_validate(self) -> None:
        self._check_model_fits_data()
        self._check_resume()

    before_test = before_validate
    before_predict = _check_resume

    def after_fit(self) -> None:
        exit_if_stopped_by_max_time(self.trainer)  # a distinct exit status: the run is not finished

    def _remove_stale_partial_checkpoints(self) -> None:
        """A run killed while saving leaves ``<name>.partial``: never loadable, so the next run of the folder
        (resuming from it, or saving into it again) removes it, if our checkpointer's marker says it wrote it."""
        if rank_zero_only.rank != 0:
            return
        ckpt_path = self.config_init[self.subcommand].get("ckpt_path")
        folders = {Path(ckpt_path).parent} if ckpt_path and Path(ckpt_path).exists() else set()
        folders |= {Path(cb.dirpath) for cb in self.trainer.checkpoint_callbacks if getattr(cb, "dirpath", None)}
        remove_unfinished_saves(folders, keep=Path(ckpt_path) if ckpt_path else None, say=rank_zero_info)

    def _allocate_run_folder(self) -> Path | None:
        """This run's log folder; one that cannot be written (a read-only working directory, say) is one line
        naming the folder and the setting to change, before anything is built."""
        try:
            return allocate_run_folder(self.trainer.logger)
        except OSError as error:
            if error.errno not in (errno.EROFS, errno.EACCES, errno.EPERM):
                raise
            folder = Path(error.filename or self.trainer.logger.root_dir).resolve()
            raise PermissionError(f"cannot create the run's log folder {folder} ({error.strerror}): set "
                                  "trainer.logger.init_args.save_dir to a writable folder (e.g. "
                                  "--trainer.logger.init_args.save_dir=$SCRATCH/logs).") from None

    def _run_subcommand(self, subcommand: str) -> None:
        # This run's version_N, created exclusively (run/folders.py): only a folder created here may be removed.
        log_dir = None if self.trainer.fast_dev_run else self._allocate_run_folder()
        if log_dir is not None:  # created empty here: what the logger finds in it is this run's own lock and config
            warnings.filterwarnings("ignore", message=rf"Experiment logs directory (.*{os.sep})?"
                                    rf"{re.escape(os.sep.join(log_dir.parts[-2:]))} exists and is not empty")
        try:
            super()._run_subcommand(subcommand)
        except BaseException as error:
            if self.trainer.world_size > 1 and self.trainer.state.status != TrainerStatus.INITIALIZING:
                in_multi_process_run(error, rank_zero_only.rank)  # the stack is the clue, unless a refusal before
                # the process group exists: every rank made the same check
            saved = any(getattr(cb, "best_model_path", "") or getattr(cb, "last_model_path", "")
                        for cb in self.trainer.checkpoint_callbacks)  # its config.yaml is what resumes them
            release = [cb for cb in self.trainer.callbacks if isinstance(cb, ReleaseLocks)]
            try:  # the run has unwound (Lightning's teardown included): its folder goes, then its locks
                if log_dir is not None and not saved and remove_empty_run_folder(
                        log_dir, release=lambda: [cb.release() for cb in release]):
                    rank_zero_info(f"removed {log_dir}: the run stopped before writing anything but its config")
            except OSError:
                pass  # what could not be removed stays: the error that stopped the run is the one to report
            finally:
                for callback in release:
                    callback.release()
            raise


class _ParseOnly(MoECLI):
    """Parses like ``fit`` (the same parser, its defaults and merging of several ``--config`` files) and stops."""

    def _set_seed(self) -> None:
        pass

    def _run_subcommand(self, subcommand: str) -> None:
        pass

    def before_instantiate_classes(self) -> None:
        pass

    def instantiate_classes(self) -> None:
        pass

    def after_instantiate_classes(self) -> None:
        pass


def compose_configs(paths: list[str]) -> dict:
    """The values ``fit --config A --config B ...`` runs with that the files set (not the defaults), as plain data:
    composed by fit's own parser, so a later file overrides an earlier one field by field exactly as in ``fit``."""
    args = ["fit", *[word for path in paths for word in ("--config", str(path))]]
    with warnings.catch_warnings():  # "args and command line arguments": sys.argv here is the plan command's
        warnings.simplefilter("ignore")
        cli = _ParseOnly(MoELanguageModel, TextDataModule, subclass_mode_model=True, subclass_mode_data=True,
                         args=args, parser_class=MoEArgumentParser)
    fit = cli._parser("fit")  # LightningCLI's own accessor for a subcommand's parser
    return yaml.safe_load(fit.dump(cli.config.fit, skip_default=True, skip_validation=True)) or {}


def drop_tips(record: logging.LogRecord) -> bool:
    """Lightning's promotional lines ("💡 Tip: ... try installing litlogger"), which no setting turns off, and its
    note that the model summary is already configured (by this CLI: ``SummaryWithoutFlops``)."""
    message = str(record.msg)
    return not (message.startswith("\N{ELECTRIC LIGHT BULB} Tip:") or message.startswith(
        "Trainer already configured with model summary callbacks: [<class 'moe_lightning.training.callbacks.console."))


def lightning_cli(argv: list[str] | None, descriptions: dict[str, str]) -> MoECLI:
    """fit/validate/test/predict (``moe_lightning.commands.main.run`` dispatches here, with each command's line)."""
    logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(drop_tips)
    words = sys.argv[1:] if argv is None else argv
    if argv is not None:  # words given in Python (a notebook, a test) are meant; sys.argv there is the host's
        warnings.filterwarnings("ignore", message="LightningCLI's args parameter is intended to run from within")
    MoEArgumentParser.command = words[0] if words and words[0] in descriptions else "fit"
    return MoECLI(MoELanguageModel, TextDataModule, subclass_mode_model=True, subclass_mode_data=True, args=argv,
                  parser_kwargs={name: {"description": text} for name, text in descriptions.items()},
                  parser_class=MoEArgumentParser,
                  save_config_callback=SaveConfigBesideLogs, save_config_kwargs={"overwrite": False})
