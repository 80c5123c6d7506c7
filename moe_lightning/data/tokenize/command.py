"""``moe-lightning tokenize SOURCE... --out FOLDER`` (or ``--out FILE.npy``): the command line, and each failure
as one line with its exit status."""

import sys

import numpy as np

from moe_lightning.data.tokenize.errors import Stopped, TokenizeError, one_line
from moe_lightning.data.tokenize.files import write_token_file
from moe_lightning.data.tokenize.folder import tokenize_to_folder
from moe_lightning.data.tokenize.plan import SHARD_TOKENS
from moe_lightning.run.refusals import CommandParser, exit_status, traceback_requested

def tokenize_main(argv: list[str] | None = None) -> None:
    """``moe-lightning tokenize SOURCE... --out FOLDER``: tokenize a corpus into .npy shards and a manifest."""
    parser = CommandParser(prog="moe-lightning tokenize", description=tokenize_main.__doc__)
    parser.add_argument("sources", nargs="+", help="stdlib, text files, folders, globs, .jsonl, .parquet, .arrow")
    parser.add_argument("--out", required=True, help="output folder of shards (or a .npy path: one file, one process)")
    parser.add_argument("--tokenizer", default=None, help="tokenizers JSON file (default: bytes)")
    parser.add_argument("--text-field", default="text", help="JSONL field or Parquet/Arrow column with the text")
    parser.add_argument("--workers", type=int, default=None, help="processes (default: every core)")
    parser.add_argument("--shard-tokens", type=int, default=SHARD_TOKENS, help="tokens per shard (about)")
    parser.add_argument("--resume", action="store_true", help="continue an interrupted run into the same folder")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing .npy output")
    parser.add_argument("--num-tasks", type=int, default=None,
                        help="tasks sharing the work (default: SLURM_ARRAY_TASK_COUNT or WORLD_SIZE, else 1)")
    parser.add_argument("--task-index", type=int, default=None,
                        help="this task's index (default: SLURM_ARRAY_TASK_ID or RANK, else 0)")
    args = parser.parse_args(argv)
    try:
        if args.out.endswith(".npy"):
            out = write_token_file(args.sources, args.out, args.tokenizer, args.text_field, args.overwrite)
            print(f"wrote {len(np.load(out, mmap_mode='r')):,} tokens to {out}")
            return
        manifest = tokenize_to_folder(args.sources, args.out, args.tokenizer, args.text_field, args.workers,
                                      args.shard_tokens, args.resume, args.task_index, args.num_tasks)
    except (TokenizeError, ValueError, KeyError, OSError, ImportError) as error:
        if traceback_requested() and not isinstance(error, Stopped):
            raise
        print(f"moe-lightning tokenize: error: {one_line(error)}", file=sys.stderr)
        raise SystemExit(getattr(error, "exit_code", None) or exit_status(error)) from None
    if manifest is not None:
        nulls = f"; {manifest['null_rows']:,} rows with null text skipped" if manifest["null_rows"] else ""
        print(f"wrote {manifest['tokens']:,} tokens ({manifest['documents']:,} documents{nulls}) in "
              f"{manifest['shard_count']} shard(s) to {args.out}")
