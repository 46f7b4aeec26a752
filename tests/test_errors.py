"""Input errors: one line from the command line (on the ranks that must say it), the exception for library callers,
the traceback on request; lm-eval's "Tasks not found" gains the fix."""

import sys

import pytest

from distperp_harness.errors import TASKS_HINT, InputError, MissingInput, OptionError, install_excepthook, one_line


@pytest.mark.parametrize(
    "env, error, line",
    [
        ({}, OptionError("quantize='int5' is not valid"), "distperp: error: quantize='int5' is not valid"),
        ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}, OptionError("x=1 is not valid"), None),  # rank 0 says it
        ({"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "0"}, OptionError("x=1 is not valid"), None),  # once a launch
        (
            {"RANK": "1", "WORLD_SIZE": "2"},
            MissingInput("/data (from --metadata) does not exist"),
            "distperp: error (rank 1): /data (from --metadata) does not exist",
        ),
        ({}, InputError("two\nlines"), "distperp: error: two lines"),
    ],
)
def test_the_line_each_rank_prints(monkeypatch, env, error, line):
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert one_line(error) == line


def test_input_errors_are_value_errors_and_a_missing_input_is_a_file_not_found():
    assert issubclass(OptionError, ValueError) and OptionError("x").same_on_every_rank
    assert isinstance(MissingInput("gone"), FileNotFoundError) and not MissingInput("gone").same_on_every_rank


@pytest.fixture
def hooked(monkeypatch):
    """The input-error hook over a recording stand-in for Python's own excepthook."""
    seen = []
    monkeypatch.setattr(sys, "excepthook", lambda kind, value, tb: seen.append(value))
    monkeypatch.delenv("DISTPERP_TRACEBACK", raising=False)
    for key in ("RANK", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    install_excepthook()
    install_excepthook()  # idempotent
    return seen


def test_an_uncaught_input_error_is_one_line_without_traceback(hooked, capsys):
    error = OptionError("quantize='int5' is not valid for --model distperp; allowed: int4. Fix: quantize=int4.")
    sys.excepthook(type(error), error, None)
    assert capsys.readouterr().err.splitlines() == [f"distperp: error: {error}"]
    assert hooked == []  # no traceback printed


def test_the_traceback_comes_back_on_request(hooked, capsys, monkeypatch):
    monkeypatch.setenv("DISTPERP_TRACEBACK", "1")
    error = OptionError("bad")
    sys.excepthook(type(error), error, None)
    assert hooked == [error] and capsys.readouterr().err == ""


def test_other_errors_keep_their_traceback_and_a_missing_task_gains_the_fix(hooked, capsys):
    bug = KeyError("x")
    sys.excepthook(type(bug), bug, None)
    missing = ValueError("Tasks not found: my_task")
    sys.excepthook(type(missing), missing, None)
    assert hooked == [bug, missing]
    assert capsys.readouterr().err.splitlines() == [TASKS_HINT]


def test_an_unknown_task_close_to_a_distperp_task_gets_did_you_mean():
    from distperp_harness.errors import did_you_mean, distperp_task_names

    assert "distperp_wikitext2" in distperp_task_names() and "distperp_local_docs" in distperp_task_names()
    assert did_you_mean("Tasks not found: distperp_wikitxt2, hellaswagg, distperp_local_doc") == [
        "distperp: did you mean 'distperp_wikitext2' (for 'distperp_wikitxt2')?",
        "distperp: did you mean 'distperp_local_docs' (for 'distperp_local_doc')?",
    ]
    assert did_you_mean("Tasks not found: no_such_task") == []
