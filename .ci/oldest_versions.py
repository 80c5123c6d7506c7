"""Print a pip constraints file pinning the framework dependencies of pyproject.toml to their declared floors
(``name>=X`` -> ``name==X``): the oldest versions the package claims to support, for the CI leg that tests them.
(Not safetensors: the test extra's transformers needs a newer one.)"""

import re
import sys
import tomllib
from pathlib import Path

PINNED = ("torch", "lightning", "torchmetrics", "jsonargparse")

project = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())["project"]
for requirement in project["dependencies"]:
    name = re.match(r"\s*([A-Za-z0-9_.-]+)", requirement)[1]
    if name not in PINNED:
        continue
    if not (match := re.fullmatch(r"\s*[A-Za-z0-9_.-]+(\[[^\]]*\])?\s*>=\s*([0-9][^,;\s]*)\s*", requirement)):
        sys.exit(f"oldest_versions.py: cannot read the floor of {requirement!r}; write it as 'name>=X'.")
    print(f"{name}=={match[2]}")
