"""``moe-lightning stalls PATH``: the stall report of a run, read back from its files.

PATH is a run folder, a folder above several (the newest report below it is read) or a ``stall-report.json``. It
prints the watchdog's report (``run/watchdog.py``) and, from the flight-recorder dumps beside it
(``flight-recorder/rank_<N>``, written by each live rank before it exited, or by NCCL on its own timeout), each
process group's last collective per rank: the ranks that never entered the collective the others are in, named
with the mesh coordinates the report recorded. ``--hosts`` prints only the hosts to leave out of a relaunch,
comma-separated (what ``configs/slurm.sbatch`` passes to ``scontrol``); ``--since EPOCH`` reads only a report written
after that time (the script's own job: its exit status alone misses a stall when srun's tasks die by signals).
"""

import argparse
import json
import pickle
from pathlib import Path

from moe_lightning.run.flight_recorder import FOLDER, PREFIX
from moe_lightning.run.watchdog import REPORT_FILE, report_lines, where


def newest_report(path: Path, since: float = 0.0) -> Path | None:
    """``path`` itself, or the newest report below it; None when none was written after ``since`` (epoch s)."""
    if path.is_file():
        found = [path]
    else:
        found = sorted(path.rglob(REPORT_FILE), key=lambda p: p.stat().st_mtime) if path.is_dir() else []
    return found[-1] if found and found[-1].stat().st_mtime >= since else None


def dump_folder(report: Path | None, path: Path) -> Path | None:
    """The watchdog's dumps beside the report, else the first flight-recorder folder under ``path`` (NCCL's own
    dumps on its timeout, under the fit's root folder)."""
    if report is not None and (report.parent / FOLDER).is_dir():
        return report.parent / FOLDER
    return next(iter(sorted(path.rglob(FOLDER))), None) if path.is_dir() else None


def read_dumps(folder: Path) -> dict[int, dict]:
    """Every rank's flight-recorder dump in ``folder`` (``rank_<N>`` files), by rank."""
    dumps = {}
    for path in sorted(folder.glob(f"{PREFIX}*")) if folder.is_dir() else ():
        suffix = path.name[len(PREFIX):]
        if suffix.isdigit():
            with open(path, "rb") as file:
                dumps[int(suffix)] = pickle.load(file)  # torch's own format: a pickle (a file the run wrote)
    return dumps


def last_collectives(dumps: dict[int, dict]) -> dict[str, dict[int, dict]]:
    """Per process group (its description, e.g. ``mesh_shard``), each rank's last recorded collective."""
    groups: dict[str, dict[int, dict]] = {}
    for rank, dump in dumps.items():
        for entry in dump.get("entries", []):
            if entry.get("is_p2p"):
                continue
            name, desc = entry["process_group"]
            key = desc or name or "default_pg"
            last = groups.setdefault(key, {}).get(rank)
            if last is None or entry["collective_seq_id"] >= last["collective_seq_id"]:
                groups[key][rank] = entry
    return groups


def recorder_lines(dumps: dict[int, dict], places: dict[int, dict]) -> list[str]:
    """Each group's ranks that are behind the group's newest collective, and where the others are."""
    lines = [f"flight recorder ({len(dumps)} rank(s) dumped):"]
    for group, last in sorted(last_collectives(dumps).items()):
        newest = max(entry["collective_seq_id"] for entry in last.values())
        for rank, entry in sorted(last.items()):
            state = "completed" if entry["state"] == "completed" else f"{entry['state']}, not completed"
            mark = "BEHIND " if entry["collective_seq_id"] < newest else ""
            place = f" ({where(places[rank])})" if rank in places else ""
            lines.append(f"  {mark}{group}: rank {rank}{place}: {entry['profiling_name']} #{entry['collective_seq_id']} "
                         f"({state})")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="moe-lightning stalls", description=__doc__.split("\n\n")[0])
    parser.add_argument("path", type=Path, help="a run folder, a folder above runs, or a stall-report.json")
    parser.add_argument("--hosts", action="store_true", help="print only the hosts to exclude, comma-separated")
    parser.add_argument("--since", type=float, default=0.0, metavar="EPOCH",
                        help="only a report written at or after this time (seconds since the epoch)")
    args = parser.parse_args(argv)
    path = newest_report(args.path, args.since)
    report = json.loads(path.read_text()) if path is not None else None
    if args.hosts:
        print(",".join(report["exclude_hosts"]) if report else "")
        return
    found = dump_folder(path, args.path)
    dumps = read_dumps(found) if found is not None else {}
    if report is None and not dumps:
        raise FileNotFoundError(f"no {REPORT_FILE} and no {FOLDER}/{PREFIX}<rank> dumps under {args.path}: "
                                f"pass the folder of the run that stalled.")
    lines = [f"{path}:", *report_lines(report)] if report else []
    places = {e["rank"]: e for e in (report["stalled"] + report["waiting"])} if report else {}
    print("\n".join(lines + (recorder_lines(dumps, places) if dumps else [])))
