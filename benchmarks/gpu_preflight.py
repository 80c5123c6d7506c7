"""Can Triton build its launcher here? Checked before any compiled part runs (FlexAttention, torch.compile).

Triton compiles a small C launcher per kernel signature with the compiler in ``$CC``, else ``gcc``, else
``clang`` on PATH, against the interpreter's ``Python.h`` (``sysconfig``'s include directory), and links it with
``-lcuda`` from the directories its ``backends/nvidia/driver.py`` ``libcuda_dirs`` names. Without any of these,
every compiled part fails minutes in with a long traceback; this builds such a library (a call into libcuda,
``Python.h`` included) and says what fails in one line, at once.

    python benchmarks/gpu_preflight.py    # exit 0 and one "ok" line, or exit 2 and one line naming what is missing
"""

import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from moe_lightning.run.durable import write_text  # noqa: E402

LAUNCHER = """#include <Python.h>
int cuInit(unsigned int flags);
int preflight(void) { return Py_IsInitialized() + cuInit(0); }
"""


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


def libcuda_dirs() -> list[str]:
    """Where Triton links libcuda from: its own ``libcuda_dirs`` when triton is installed; else the same rule
    (triton 3.x): ``$TRITON_LIBCUDA_PATH`` if set, else the directories of ``ldconfig -p``'s ``libcuda.so.1``
    entries, else ``$LD_LIBRARY_PATH`` entries that hold it; and ``/usr/lib/wsl/lib`` (WSL) where it exists."""
    try:
        from triton.backends.nvidia.driver import libcuda_dirs as triton_dirs
        return list(triton_dirs())
    except Exception:  # not installed, or its own check failed: the link below says what is missing
        pass
    if os.environ.get("TRITON_LIBCUDA_PATH"):
        return [os.environ["TRITON_LIBCUDA_PATH"]]
    ldconfig = shutil.which("ldconfig") or "/sbin/ldconfig"
    try:
        cache = subprocess.run([ldconfig, "-p"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        cache = ""
    dirs = sorted({os.path.dirname(line.split()[-1]) for line in cache.splitlines() if "libcuda.so.1" in line})
    if not dirs:
        dirs = [d for d in os.environ.get("LD_LIBRARY_PATH", "").split(":") if d and Path(d, "libcuda.so.1").exists()]
    return dirs + (["/usr/lib/wsl/lib"] if Path("/usr/lib/wsl/lib").is_dir() else [])


def link_problem(cc: str, header: Path) -> str | None:
    """Build a shared library as Triton builds its launcher (``-shared -fPIC``, ``Python.h``, ``-lcuda``); why not."""
    dirs = libcuda_dirs()
    with tempfile.TemporaryDirectory() as tmp:
        write_text(Path(tmp) / "launcher.c", LAUNCHER)
        command = [cc, str(Path(tmp) / "launcher.c"), "-O0", "-shared", "-fPIC", "-o", str(Path(tmp) / "launcher.so"),
                   f"-I{header.parent}", *(f"-L{d}" for d in dirs), "-lcuda"]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.TimeoutExpired) as error:
            return f"{cc} could not build a test launcher ({error})"
    if done.returncode == 0:
        return None
    lines = [line.strip() for line in done.stderr.splitlines() if line.strip()]
    why = next((line for line in lines if "cannot find" in line), None) or next(
        (line for line in lines if "error" in line.lower()), lines[-1] if lines else f"exit {done.returncode}")
    return (f"linking with -lcuda failed ({why}); searched {dirs or 'no libcuda directory'} (TRITON_LIBCUDA_PATH, "
            f"else ldconfig -p's libcuda.so.1, else LD_LIBRARY_PATH): install the NVIDIA driver's libcuda.so or "
            f"set TRITON_LIBCUDA_PATH to its directory")


def problems() -> list[str]:
    found = []
    cc, header = c_compiler(), python_header()
    if cc is None:
        found.append("no C compiler ($CC unset or missing, no gcc or clang on PATH)" if not os.environ.get("CC")
                     else f"no C compiler at CC={os.environ['CC']}")
    if header is None:
        found.append(f"no Python.h under {sysconfig.get_paths()['include']} (install the python3-dev headers)")
    if cc is not None and header is not None:
        why = link_problem(cc, header)
        if why:
            found.append(why)
    return found


def main() -> int:
    missing = problems()
    if missing:
        print(f"gpu_preflight: Triton cannot build its launcher: {'; '.join(missing)}. Compiled parts are skipped.")
        return 2
    print(f"gpu_preflight: ok, Triton's launcher builds with {c_compiler()} and {python_header()}, linked with "
          f"-lcuda from {libcuda_dirs() or 'the default library path'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
