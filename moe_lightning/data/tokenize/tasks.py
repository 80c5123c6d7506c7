"""Which share of the units this task takes: ``--task-index``/``--num-tasks``, else a SLURM array's task (its index
counted from the array's first id in steps of its step) or torchrun's rank, else the whole corpus."""

import os

from moe_lightning.data.tokenize.errors import TokenizeError

def cores() -> int:
    """The cores this process may run on (a SLURM or cgroup CPU set), not the machine's."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def task_from_environment(task_index: int | None, num_tasks: int | None, planned: dict | None = None) -> tuple:
    """``(task index, number of tasks, first array id)``: each of index and count as given, else from a SLURM array
    (the index counted from its first id in steps of its step) or torchrun, else ``(0, 1)``. ``planned``: the
    folder's plan, whose array a single resubmitted index (``sbatch --array=17``: an array of one) belongs to."""
    env, names, found, first = os.environ, ("--task-index", "--num-tasks"), None, 0
    if "SLURM_ARRAY_TASK_ID" in env:
        ident = int(env["SLURM_ARRAY_TASK_ID"])
        first, step = int(env.get("SLURM_ARRAY_TASK_MIN", 0)), int(env.get("SLURM_ARRAY_TASK_STEP") or 1)
        count = int(env["SLURM_ARRAY_TASK_COUNT"]) if "SLURM_ARRAY_TASK_COUNT" in env else \
            (int(env.get("SLURM_ARRAY_TASK_MAX", ident)) - first) // step + 1
        if count == 1 and planned and planned.get("tasks", 1) > 1:  # one task of the planned array, rerun
            first = planned.get("first_task_id", 0)
            found = (ident - first, planned["tasks"])
        else:
            found = ((ident - first) // step if (ident - first) % step == 0 else count, count)
        env_names = ("SLURM_ARRAY_TASK_ID", "SLURM_ARRAY_TASK_COUNT")
    elif "RANK" in env and "WORLD_SIZE" in env:
        found, env_names = (int(env["RANK"]), int(env["WORLD_SIZE"])), ("RANK", "WORLD_SIZE")
    index, count = task_index, num_tasks
    if found is not None:
        if index is None:
            index, names = found[0], (env_names[0], names[1])
        if count is None:
            count, names = found[1], (names[0], env_names[1])
    if count is not None and count > 1 and index is None:
        raise TokenizeError(f"tokenize: --num-tasks={count} needs --task-index (this task's index), or run it as a "
                            "SLURM array task.")
    if index is not None and index > 0 and count is None:
        raise TokenizeError(f"tokenize: --task-index={index} needs --num-tasks (how many tasks share the work).")
    index, count = index or 0, count or 1
    if count < 1 or not 0 <= index < count:
        raise TokenizeError(f"tokenize: task index {index} (from {names[0]}) must be in 0..{count - 1} for {count} "
                            f"tasks (from {names[1]}); a SLURM array given as a list (--array=1,5,9) needs "
                            "--task-index and --num-tasks." if names[0].startswith("SLURM") else
                            f"tokenize: {names[0]}={index} must be in 0..{count - 1} ({names[1]}={count}).")
    return index, count, first
