"""``moe-lightning``: the command table and its dispatch, kept light on purpose.

``moe-lightning --help`` imports nothing but this module, and the commands that do not train (``generate``,
``tokenize``, ``plan``, ``export``, ``convert``) import only what they use: none of them imports Lightning, which
alone takes seconds. ``fit``/``validate``/``test``/``predict`` import ``moe_lightning.commands.cli`` (LightningCLI).
"""

import importlib
import signal
import sys

from moe_lightning.run.exits import Preempted, say, stopped_word
from moe_lightning.run.refusals import exit_status, is_refusal, say_refusal, take_traceback_flag, \
    traceback_requested
from moe_lightning.run.signals import startup_guard

# Every command with one line, for `moe-lightning --help` (LightningCLI's own listing shows only its four).
COMMANDS = {
    "fit": "train a model from a YAML config (--config configs/tiny.yaml)",
    "validate": "loss on the validation split, from a config and --ckpt_path",
    "test": "loss and perplexity on the held-out split (or another --data.init_args.source)",
    "predict": "continue every prompt of a JSONL file (--prompts in.jsonl --out out.jsonl)",
    "generate": "continue a prompt from any checkpoint, streaming the text (CKPT --prompt TEXT)",
    "tokenize": "tokenize a corpus on every core into .npy token shards and a manifest",
    "plan": "memory and speed plan of a config on a cluster, without GPUs",
    "export": "write any checkpoint as one inference file that records its tokenizer",
    "convert": "Hugging Face folder <-> single-file checkpoint",
    "stalls": "which rank stalled a run, from its stall-report.json and flight-recorder dumps (RUN_DIR)",
}

TRAINER_COMMANDS = ("fit", "validate", "test", "predict")  # LightningCLI's subcommands (moe_lightning.commands.cli)

# Commands beside LightningCLI's subcommands: name -> "module:function(argv)", imported only when used.
EXTRA_COMMANDS = {
    "generate": "moe_lightning.commands.generate:main",
    "tokenize": "moe_lightning.data.tokenize.command:tokenize_main",
    "plan": "moe_lightning.planner.plan:main",
    "export": "moe_lightning.commands.convert:export_main",  # a .pt, or with --hf a Hugging Face folder
    "convert": "moe_lightning.commands.convert:convert_main",
    "stalls": "moe_lightning.commands.stalls:main",
}


def print_commands() -> None:
    names = [name for name in COMMANDS if name in EXTRA_COMMANDS or name in TRAINER_COMMANDS]
    width = max(map(len, names))
    lines = [f"  {name:<{width}}  {COMMANDS[name]}" for name in names]
    print("usage: moe-lightning COMMAND [options]   (moe-lightning COMMAND --help for its options)\n\n"
          "Train Mixture-of-Experts language models with Lightning.\n\ncommands:\n" + "\n".join(lines)
          + "\n\nA refusal (bad config, bad file, folder in use) is one line; --traceback (or "
          "MOE_LIGHTNING_TRACEBACK=1) shows its stack.")


def main(argv: list[str] | None = None) -> None:
    """Console entry point (its return value would become the exit status, so it returns nothing). A refusal
    (``run.refusals``: bad config, bad file, folder in use, unknown format) is one line and exit status 2 (1 for a
    busy folder or a full disk); ``--traceback`` or ``MOE_LIGHTNING_TRACEBACK=1`` shows the stack instead. A run
    stopped by a signal says so in one line (unless it has already) and exits ``128 + signal``."""
    if argv is None:  # the command line itself, edited in place: Lightning relaunches it for the other ranks
        sys.argv[1:] = take_traceback_flag(sys.argv[1:])
        words = sys.argv[1:]
    else:
        words = argv = take_traceback_flag(list(argv))
    try:
        run(argv)
    except Preempted as stopped:
        if not stopped.said:
            say(str(stopped))
        raise
    except Exception as error:
        if traceback_requested() or not is_refusal(error):
            raise
        say_refusal(words[0] if words else "", error)
        raise SystemExit(exit_status(error)) from None


def run(argv: list[str] | None = None):
    """Run a command and return the CLI object of a trainer command (for tests and notebooks); ``argv=None``
    reads the command line."""
    if "" not in sys.path and "." not in sys.path:
        sys.path.insert(0, "")  # like `python -m`: class_paths from the user's project resolve from cwd
    words = sys.argv[1:] if argv is None else argv
    if not words or words[0] in ("-h", "--help"):
        print_commands()
        return None
    with startup_guard(lambda signum: stopped_by(words[0], signum)):  # until the command's own handlers exist
        if words[0] in EXTRA_COMMANDS:
            module_name, function_name = EXTRA_COMMANDS[words[0]].split(":")
            return getattr(importlib.import_module(module_name), function_name)(words[1:])
        from moe_lightning.commands.cli import lightning_cli

        return lightning_cli(argv, {name: COMMANDS[name] for name in TRAINER_COMMANDS})


def stopped_by(command: str, signum: int) -> Preempted:
    """What a stop signal raises before the command has handlers of its own (``run.signals.startup_guard``)."""
    said = f"{stopped_word(signum)} ({signal.Signals(signum).name})"
    if command == "fit":
        return Preempted(128 + signum, f"{said} before the first step: nothing to save")
    return Preempted(128 + signum, f"{said}: moe-lightning {command} stopped before it finished")
