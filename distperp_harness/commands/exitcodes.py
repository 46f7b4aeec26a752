"""What the exit status of a distperp command says, for a script or a CI job around it (the README's table).

* ``0`` (:attr:`ExitCode.OK`): everything asked for was done and passed: every checkpoint (``series``) and scheme
  (``sweep``) evaluated, every check passed (``check``), every task agrees (``parity``), the table (and figure)
  written and the runs the same bits (``compare --same-bits``).
* ``1`` (:attr:`ExitCode.ERROR`): the command stopped: a bad input (one ``distperp: error: ...`` line), a rank
  that failed or was lost (named), an evaluation that failed; what it wrote is what was done before.
* ``2`` (:attr:`ExitCode.USAGE`): the arguments did not parse (argparse's own message).
* ``3`` (:attr:`ExitCode.FAILED`): the command ran to its end and wrote everything, but some of it failed: a
  checkpoint or a scheme that could not be loaded (a failed row), a failed check, a task that differs, runs that
  are not the same bits. ``series --allow-failures`` and ``sweep --allow-failures`` exit 0 on failed rows.
* ``130`` / ``143``: stopped by Ctrl-C / SIGTERM (the shell's codes); ``series --watch`` ended by SIGTERM or
  SIGINT after the checkpoint at hand is no failure (its own exit status).
"""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    """The exit statuses of the commands (see the module docstring)."""

    OK = 0
    ERROR = 1
    USAGE = 2
    FAILED = 3


def for_failures(failed: int, allowed: bool = False) -> ExitCode:
    """:attr:`ExitCode.FAILED` when ``failed`` things failed (rows, checks, tasks) and failures are not
    ``allowed``; else :attr:`ExitCode.OK`."""
    return ExitCode.FAILED if failed and not allowed else ExitCode.OK
