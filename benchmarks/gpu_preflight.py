"""Can Triton build its launcher here? Checked before any compiled part runs (FlexAttention, torch.compile).

Triton compiles a small C launcher per kernel signature with the compiler in ``$CC``, else ``gcc``, else
``clang`` on PATH, against the interpreter's ``Python.h`` (``sysconfig``'s include directory). Without either,
every compiled part fails minutes in with a long traceback; this says so in one line, at once.

    python benchmarks/gpu_preflight.py    # exit 0 and one "ok" line, or exit 2 and one line naming what is missing
"""

import os
import shutil
import sys
import sysconfig
from pathlib import Path


def c_compiler() -> str | None:
    """The compiler Triton would use: ``$CC`` if set (a name on PATH or a path), else gcc, else clang."""
    cc = os.environ.get("CC")
    if cc:
        return shutil.which(cc) or (cc if Path(cc).is_file() else None)
    return shutil.which("gcc") or shutil.which("clang")


def python_header() -> Path | None:
    """``Python.h`` in this interpreter's include directory (the default scheme's, or ``posix_prefix``'s in a venv)."""
    for scheme in (None, "posix_prefix"):
        try:
            include = sysconfig.get_paths(scheme=scheme)["include"] if scheme else sysconfig.get_paths()["include"]
        except KeyError:
            continue
        if (Path(include) / "Python.h").is_file():
            return Path(include) / "Python.h"
    return None


def problems() -> list[str]:
    found = []
    if c_compiler() is None:
        found.append("no C compiler ($CC unset or missing, no gcc or clang on PATH)" if not os.environ.get("CC")
                     else f"no C compiler at CC={os.environ['CC']}")
    if python_header() is None:
        found.append(f"no Python.h under {sysconfig.get_paths()['include']} (install the python3-dev headers)")
    return found


def main() -> int:
    missing = problems()
    if missing:
        print(f"gpu_preflight: Triton cannot build its launcher: {'; '.join(missing)}. Compiled parts are skipped.")
        return 2
    print(f"gpu_preflight: ok, Triton's launcher builds with {c_compiler()} and {python_header()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
