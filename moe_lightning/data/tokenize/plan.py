"""The corpus cut once into units of work, recorded in the folder's plan, and the check that a run continuing a
folder is the same job over the same, unchanged inputs."""

import json
import math
from pathlib import Path

from moe_lightning.data.sources import MANIFEST, PLAN
from moe_lightning.data.tokenize.errors import TokenizeError
from moe_lightning.data.tokenize.files import write_json
from moe_lightning.data.tokenize.reading import describe_inputs, reading_plan, unit_pieces

SHARD_TOKENS = 1 << 28  # 268M tokens: 512 MiB of uint16 or 1 GiB of uint32 per shard
MIN_UNIT_BYTES = 1 << 20  # units smaller than this cost more in start-up than they gain in balance
UNITS = 4096  # enough units for 64 tasks of 64 workers to stay busy; never a function of the task count, so
# a text file's cuts (token-neutral only for GPT-2-style pre-tokenizers) fall in the same places however many run
PLAN_FORMAT = "moe_lightning tokenize plan v2"


def plan_units(inputs: list[list], groups: dict[int, list[int]], target: int) -> list[dict]:
    """Units of about ``target`` bytes, each a span ``[start, end)`` of ``(input, position)`` in corpus order:
    small files grouped, a large text or JSONL file cut by byte range, a table between row groups or batches."""
    units, start, size = [], [0, 0], 0

    def cut(i: int, position: int) -> None:
        nonlocal start, size
        units.append({"index": len(units), "start": start, "end": [i, position], "bytes": size})
        start, size = [i, position], 0

    for i, (_, nbytes, _) in enumerate(inputs):
        if i in groups:
            for g, group_bytes in enumerate(groups[i]):
                size += group_bytes
                if size >= target:
                    cut(i, g + 1)
            continue
        position = 0
        while nbytes - position + size >= target:
            position += target - size
            size = target
            cut(i, position)
        size += nbytes - position
    if size or not units:
        units.append({"index": len(units), "start": start, "end": [len(inputs), 0], "bytes": size})
    return units


def describe_unit(unit: dict, plan: dict) -> str:
    pieces = unit_pieces(unit, plan)
    if not pieces:
        return f"unit {unit['index']}"
    path, first, last, whole, table = pieces[0]
    where = "" if (first, last) == (0, whole) else \
        f" {'groups' if table else 'bytes'} {first:,}-{last:,}"
    more = f" and {len(pieces) - 1} more file(s)" if len(pieces) > 1 else ""
    return f"unit {unit['index']} ({path}{where}{more})"


def document_tokens(tokenizer) -> dict:
    """The special tokens put around each document, where there are any: part of what a folder was written with
    (a folder half-written by a version that put them around every piece of a long document is not continued;
    one it finished is read as written)."""
    around = [list(tokenizer.document_start), list(tokenizer.document_end)]
    return {"document_tokens": around} if any(around) else {}


def new_plan(folder: Path, identity: dict, files: list[Path], tokenizer, tasks: int, first_id: int) -> dict:
    reading = reading_plan(files, identity["text_field"])
    inputs, groups = reading["inputs"], {int(i): g for i, g in reading["groups"].items()}
    total = sum(size for _, size, _ in inputs)
    bytes_per_token = 1 if tokenizer.spec()["kind"] == "bytes" else 4
    # at most a shard a unit, and enough units to keep every worker busy: the same cuts for any task count
    target = max(MIN_UNIT_BYTES, min(identity["shard_tokens"] * bytes_per_token, math.ceil(total / UNITS)))
    plan = {**identity, **reading, "units": plan_units(inputs, groups, target), "tasks": tasks,
            "first_task_id": first_id}
    write_json(folder / PLAN, plan)
    return plan


def checked_plan(folder: Path, identity: dict, files: list[Path] | None, task: int = 0, tasks: int = 1) -> dict:
    """The plan in ``folder``, if it is this job (same arguments) over the same, unchanged inputs: all of them
    listed anew (``files``), or (``None``: a task of an array, so that a thousand tasks do not each list and stat
    millions of files) the files of this task's units, each unchanged."""
    try:
        plan = json.loads((folder / PLAN).read_text())
    except (OSError, json.JSONDecodeError):
        raise TokenizeError(f"tokenize: {folder / PLAN} is unreadable; tokenize into a new folder.") from None
    # an argument added to the identity after a corpus was finished (document_tokens) did not shape it: the corpus
    # is read as written, so a run that trained on it resumes on the same data; an unfinished one is not continued
    finished = (folder / MANIFEST).exists()
    differs = [key for key, value in identity.items() if plan.get(key) != value and (key in plan or not finished)]
    if differs:
        raise TokenizeError(f"tokenize --resume: {folder} was written with other {', '.join(differs)} "
                            f"({', '.join(f'{k}={plan.get(k)!r}' for k in differs)}); rerun with the same "
                            "arguments, or tokenize into a new folder.")
    if files is None:
        used = sorted({i for u in plan["units"] if u["index"] % tasks == task
                       for i in range(u["start"][0], min(u["end"][0] + 1, len(plan["inputs"])))})
        expected = [plan["inputs"][i] for i in used]
        now = describe_inputs([Path(p) for p, _, _ in expected], missing_ok=True)
    else:
        expected, now = plan["inputs"], describe_inputs(files)
    if now != expected:
        planned = {p: (b, m) for p, b, m in expected}
        current = {p: (b, m) for p, b, m in now}
        added = [p for p in current if p not in planned]
        gone = [p for p in planned if p not in current]
        changed = [p for p in current if p in planned and current[p] != planned[p]]
        what = "; ".join(f"{label} {len(paths)} file(s), e.g. {paths[0]}" for label, paths in
                         (("added", added), ("removed", gone), ("changed", changed)) if paths) or "reordered"
        raise TokenizeError(f"tokenize --resume: the inputs differ from those {folder} was tokenized from ({what}); "
                            "shards already written would not match them. Tokenize into a new folder.")
    return plan
