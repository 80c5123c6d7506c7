"""The suite does not depend on what the installed torch happens to contain (the README's command runs on the
newest release, whose default wheel is the CUDA build, on a machine without a GPU)."""

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def calls_to(name: str) -> list[tuple[Path, ast.Call]]:
    found = []
    for path in TESTS.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == name:
                found.append((path, node))
    return found


def test_every_flex_create_mask_call_names_its_device():
    """FlexAttention's ``create_mask`` without ``device`` builds on CUDA in torch 2.14 ("Found no NVIDIA driver" on a
    CPU machine) and on CPU in 2.13: every call in the tests says where."""
    calls = calls_to("create_mask")
    assert calls  # the scan sees them
    undeviced = [f"{path.relative_to(TESTS)}:{call.lineno}" for path, call in calls
                 if not any(k.arg == "device" for k in call.keywords)]
    assert undeviced == []

