"""torch's flight recorder (the last collectives of every process group, per rank): switched on for a fit, dumped
by the stall watchdog before it ends a rank, read back by ``moe-lightning stalls``.

A dump is the pickle torch writes (``torch/distributed/flight_recorder``'s format): ``{"version", "pg_config",
"pg_status", "entries"}``, each entry with ``process_group`` (name, description: a mesh dimension's groups are
described ``mesh_<dimension>``), ``collective_seq_id``, ``profiling_name`` (``nccl:all_reduce``,
``gloo:all_to_all``) and ``state`` (``scheduled``, ``started``, ``completed``). torch 2.13 records gloo too.
"""

import os
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


def dump(rank: int, folder: Path) -> Path | None:
    """Write this rank's recorder to ``folder/flight-recorder/rank_<rank>`` (beside the stall report); None when
    nothing records (or this torch has no ``_dump_fr_trace``: torch 2.11's NCCL recorder dumps on NCCL's own
    timeout, under ``TORCH_FR_DUMP_TEMP_FILE``, instead)."""
    if not recording():
        return None
    from torch._C import _distributed_c10d

    write = getattr(_distributed_c10d, "_dump_fr_trace", None)
    if write is None:
        return None
    path = Path(folder) / FOLDER / f"{PREFIX}{rank}"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(write())
    return path
