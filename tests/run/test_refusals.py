"""Which failures are a one-line refusal and which keep their traceback (``run/refusals.py``)."""

import numpy as np
import pytest

from moe_lightning.model.config import MoEConfig
from moe_lightning.run import refusals
from moe_lightning.run.locks import FolderInUseError


def caught(action) -> BaseException:
    try:
        action()
    except Exception as error:
        return error
    raise AssertionError("nothing raised")


def test_the_packages_own_checks_are_refusals_and_bugs_or_library_errors_keep_their_traceback(tmp_path):
    config_error = caught(lambda: MoEConfig(num_experts=4, top_k=5))  # raised by our check
    assert refusals.is_refusal(config_error) and refusals.exit_status(config_error) == 2
    assert refusals.one_line(config_error) == " ".join(str(config_error).split())
    numpy_error = caught(lambda: np.zeros(3).reshape(2))  # a ValueError inside numpy: a bug of the caller
    assert isinstance(numpy_error, ValueError) and not refusals.is_refusal(numpy_error)
    assert not refusals.is_refusal(caught(lambda: MoEConfig(wide=True)))  # a TypeError: a bug to report
    missing = caught(lambda: open(tmp_path / "gone.txt"))  # names a path: a refusal wherever it is raised
    assert refusals.is_refusal(missing) and refusals.exit_status(missing) == 2
    busy = FolderInUseError(tmp_path, "host h, pid 1", tmp_path / ".moe-lightning.lock")
    assert refusals.exit_status(busy) == 1  # the state of the machine: try again later
    assert not refusals.is_refusal(refusals.keep_traceback(caught(lambda: MoEConfig(num_experts=4, top_k=5))))
    assert not refusals.is_refusal(KeyboardInterrupt())


def test_traceback_flag_is_taken_off_the_command_line_and_set_for_the_launched_ranks(monkeypatch):
    assert refusals.take_traceback_flag(["fit", "--config", "a.yaml"]) == ["fit", "--config", "a.yaml"]
    assert not refusals.traceback_requested()
    assert refusals.take_traceback_flag(["fit", "--traceback", "--config", "a.yaml"]) == ["fit", "--config", "a.yaml"]
    assert refusals.traceback_requested()
    monkeypatch.setenv(refusals.TRACEBACK_ENV, "0")
    assert not refusals.traceback_requested()


def test_command_parser_usage_error_is_one_line(capsys, monkeypatch):
    parser = refusals.CommandParser(prog="moe-lightning demo")
    parser.add_argument("--count", type=int, required=True)
    with pytest.raises(SystemExit) as exit_:
        parser.parse_args(["--count", "many"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err == ("moe-lightning demo: error: argument --count: invalid int value: 'many' "
                                       "(see moe-lightning demo --help)\n")
