"""Where the ``distperp_*`` task YAMLs are: below every command that passes them to lm-eval (``cli``, ``demo``,
``sweep``), so those three import it and not each other."""

from __future__ import annotations

from pathlib import Path


def tasks_path() -> Path:
    """Folder holding the ``distperp_*`` task YAMLs: the checkout's ``tasks/`` or the installed package's copy.

    Pass it to lm-eval as ``--include_path``.
    """
    package = Path(__file__).resolve().parent.parent
    for candidate in (package.parent / "tasks", package / "tasks"):
        if (candidate / "distperp").is_dir():
            return candidate
    raise FileNotFoundError(f"no distperp task folder next to {package}; reinstall distperp-harness")
