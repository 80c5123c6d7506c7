"""torch's flight recorder (the last collectives of every process group, per rank): switched on for a fit, dumped
by the stall watchdog before it ends a rank, read back by ``moe-lightning stalls``.

A dump is the pickle torch writes (``torch/distributed/flight_recorder``'s format): ``{"version", "pg_config",
"pg_status", "entries"}``, each entry with ``process_group`` (name, description: a mesh dimension's groups are
described ``mesh_<dimension>``), ``collective_seq_id``, ``profiling_name`` (``nccl:all_reduce``,
``gloo:all_to_all``) and ``state`` (``scheduled``, ``started``, ``completed``). torch 2.13 records gloo too.
"""

import os
import pickle
from pathlib import Path

FOLDER = "flight-recorder"
PREFIX = "rank_"  # dumps are FOLDER/rank_<global rank>, as torch names them after TORCH_FR_DUMP_TEMP_FILE
BUFFER_ENTRIES = "2000"

# torch >= 2.7 reads the TORCH_FR_* names and falls back to the TORCH_NCCL_* ones (torch 2.11's NCCL reads those).
BUFFER_VARS = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
FILE_VARS = ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")


def flight_recorder_env(run_folder: Path, environ=os.environ) -> dict[str, str]:
    """The variables that switch the recorder on with dumps in ``run_folder/flight-recorder`` (NCCL also dumps on
    its own timeout), none that the user has set: a user who set any buffer or file variable keeps theirs alone.
    Set them before the process group is created."""
    if any(name in environ for name in (*BUFFER_VARS, *FILE_VARS)):
        return {}
    prefix = str(Path(run_folder) / FOLDER / PREFIX)
    return {**{name: BUFFER_ENTRIES for name in BUFFER_VARS}, **{name: prefix for name in FILE_VARS},
            "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}


def enable(run_folder: Path) -> dict[str, str]:
    """Set ``flight_recorder_env``'s variables in this process (its ranks' process groups read them) and create
    the dump folder; returns what was set."""
    env = flight_recorder_env(run_folder)
    if env:
        (Path(run_folder) / FOLDER).mkdir(parents=True, exist_ok=True)
        os.environ.update(env)
    return env


def recording(environ=os.environ) -> bool:
    return any(environ.get(name, "0") not in ("", "0") for name in BUFFER_VARS)


DUMPERS = ("_dump_nccl_trace", "_dump_fr_trace")
"""torch's recorders, each a pickle in the same format: NCCL's (CUDA builds) and the one other backends (gloo) use."""


def _identity(entry: dict) -> tuple:
    return (tuple(entry.get("process_group", ())), entry.get("collective_seq_id"), entry.get("p2p_seq_id"),
            entry.get("profiling_name"))


def merged_dumps(pickles: list[bytes]) -> bytes | None:
    """One dump of several recorders' (an entry both hold, should a recorder cover both backends, once)."""
    if not pickles:
        return None
    merged = pickle.loads(pickles[0])
    entries = merged.setdefault("entries", [])
    known = {_identity(entry) for entry in entries}
    for other in map(pickle.loads, pickles[1:]):
        entries.extend(e for e in other.get("entries", []) if _identity(e) not in known)
        for field in ("pg_config", "pg_status"):
            merged.setdefault(field, {}).update(other.get(field, {}))
    return pickle.dumps(merged)


def dump(rank: int, folder: Path) -> Path | None:
    """Write this rank's recorders (NCCL's and gloo's, merged) to ``folder/flight-recorder/rank_<rank>`` (beside
    the stall report); None when nothing records (or this torch has neither dump function: torch 2.11's NCCL
    recorder dumps on NCCL's own timeout, under ``TORCH_FR_DUMP_TEMP_FILE``, instead)."""
    if not recording():
        return None
    from torch._C import _distributed_c10d

    pickles = []
    for write in filter(None, (getattr(_distributed_c10d, name, None) for name in DUMPERS)):
        try:
            pickles.append(write())
        except RuntimeError:  # a recorder this process never used (NCCL's without an NCCL group)
            pass
    data = merged_dumps(pickles)
    if data is None:
        return None
    path = Path(folder) / FOLDER / f"{PREFIX}{rank}"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path
