"""Print a pip constraints file pinning every runtime dependency of pyproject.toml to its declared floor
(``name>=X`` -> ``name==X``): the oldest versions the package claims to support, for the CI leg that tests them."""

import re
import sys
import tomllib
from pathlib import Path

project = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())["project"]
for requirement in project["dependencies"]:
    if match := re.fullmatch(r"\s*([A-Za-z0-9_.-]+)(\[[^\]]*\])?\s*>=\s*([0-9][^,;\s]*)\s*", requirement.split("#")[0]):
        print(f"{match[1]}=={match[3]}")
    elif ">=" in requirement:
        sys.exit(f"oldest_versions.py: cannot read the floor of {requirement!r}; write it as 'name>=X'.")
