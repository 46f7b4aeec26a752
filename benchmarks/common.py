"""What every benchmark shares: the repository's paths, the offline environment and launching workers.

Every benchmark runs from the repository root as ``python -m benchmarks.<name>`` (``distperp_harness`` installed, or
the root on ``PYTHONPATH`` as ``device_run.sh`` puts it). Importing the package :mod:`benchmarks` calls
:func:`use_offline_env` first, before anything imports torch, transformers, lm-eval or tqdm (they read these
variables when they are imported). Data and models are read from ``../shared`` at run time; nothing is copied into
the repository.

Launching goes through :mod:`distperp_harness.commands.launching` (the project's one ``accelerate launch`` command):
:func:`launch` runs a benchmark module (its worker mode) on several processes, or under ``torchrun`` for the one
process that needs a process group (``shard_check``'s mesh of one).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import tracemalloc
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from distperp_harness.commands.launching import OFFLINE_ENV, accelerate_launch_prefix, free_port, offline_env

REPO_ROOT = Path(__file__).resolve().parents[1]
"""The repository root: the working folder of every process a benchmark starts."""
SHARED = REPO_ROOT.parent / "shared"
"""``../shared`` beside the checkout: data and models, read at run time."""
WIKITEXT_TEST = SHARED / "data" / "wikitext-2" / "test.txt"
"""``../shared/data/wikitext-2/test.txt``: 62 articles, 241,211 words."""
WIKITEXT_VALID = WIKITEXT_TEST.with_name("valid.txt")
"""``../shared/data/wikitext-2/valid.txt``."""
SHARED_MODEL = SHARED / "models" / "wt2-llama-5m"
"""``../shared/models/wt2-llama-5m``: 5.5M-parameter Llama (vocab 8,192) with its tokenizer."""
SMOLLM2 = Path("~/.cache/distperp/smollm2-135m-instruct").expanduser()
"""Where the docs' examples keep SmolLM2-135M-Instruct (see ``../shared/models/*/README``)."""
TEST_TASKS = REPO_ROOT / "tests" / "tasks"
"""The test tasks (``dptest_rolling``, ``dptest_mc``, ``dptest_fewshot``, ``dptest_gen``, ...) as an include path."""
PROJECT_TASKS = REPO_ROOT / "tasks" / "distperp"
"""The project's own task folder (``distperp_wikitext2``, ``distperp_local_docs``)."""

TORCHAO_SKIP = "TORCHAO_FORCE_SKIP_LOADING_SO_FILES"
"""The :data:`OFFLINE_ENV` variable that keeps torchao's compiled extensions unloaded (CPU runs)."""
QUIET = {"TQDM_DISABLE": "1"}
"""Set besides :data:`OFFLINE_ENV`: no progress bars between a benchmark's table lines."""
_USER_SET = frozenset(key for key in (*OFFLINE_ENV, *QUIET) if key in os.environ)
"""The variables the user had set before :mod:`benchmarks` was imported (kept by :func:`use_offline_env`)."""


def environment(extra: Mapping[str, str] | None = None, device: str = "cpu") -> dict[str, str]:
    """The environment of a process a benchmark starts: ``os.environ`` with :data:`OFFLINE_ENV` and :data:`QUIET`
    applied over it (never a hub), then ``extra``. On ``cuda`` torchao's compiled kernels must load (int4 on the GPU):
    :data:`TORCHAO_SKIP` is left out unless the user set it or ``extra`` does."""
    env = offline_env({**QUIET, **(extra or {})})
    if device == "cuda" and TORCHAO_SKIP not in _USER_SET and TORCHAO_SKIP not in (extra or {}):
        env.pop(TORCHAO_SKIP, None)
    return env


def use_offline_env(device: str = "cpu") -> None:
    """Set :data:`OFFLINE_ENV` and :data:`QUIET` in this process's ``os.environ``, keeping any value the user set.

    Importing :mod:`benchmarks` calls it for the CPU. A benchmark given ``--device cuda`` calls it again before
    torchao is imported: then :data:`TORCHAO_SKIP` is removed (unless the user set it), so int4's kernels load.
    """
    env = offline_env({k: v for k, v in QUIET.items() if k not in os.environ}, keep_set=True)
    if device == "cuda" and TORCHAO_SKIP not in _USER_SET:
        env.pop(TORCHAO_SKIP, None)
        os.environ.pop(TORCHAO_SKIP, None)
    os.environ.update(env)


def module_command(module: str, *args: object) -> list[str]:
    """``python -m benchmarks.<module> args...`` with this interpreter (run it from :data:`REPO_ROOT`)."""
    return [sys.executable, "-m", f"benchmarks.{module}", *map(str, args)]


def launch(
    module: str,
    args: Sequence[object],
    processes: int,
    *,
    device: str = "cpu",
    torchrun: bool = False,
    extra_env: Mapping[str, str] | None = None,
    **run: Any,
) -> subprocess.CompletedProcess:
    """Run ``benchmarks.<module>`` with ``args`` on ``processes`` processes from :data:`REPO_ROOT`, in
    :func:`environment` ``(extra_env, device)``: under ``accelerate launch``
    (:func:`~distperp_harness.commands.launching.accelerate_launch_prefix`, a free port), or with ``torchrun`` one
    process under ``torch.distributed.run`` (it sets up the process group a device mesh needs, which Accelerate does
    not for a single process). ``run`` goes to :func:`subprocess.run` (``check``, ``timeout``, ``capture_output``...).

    Raises:
        ValueError: ``torchrun`` with other than one process.
    """
    if torchrun:
        if processes != 1:
            raise ValueError(f"torchrun launches one process here, got processes={processes}; use accelerate for more")
        prefix = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "1",
            "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
        ]  # fmt: skip
    else:
        prefix = accelerate_launch_prefix(processes)
    cmd = [*prefix, "-m", f"benchmarks.{module}", *map(str, args)]
    return subprocess.run(cmd, cwd=REPO_ROOT, env=environment(extra_env, device), **run)


def lm_eval_model(name: str) -> Any:
    """lm-eval's model class ``name`` (``hf``, or ``distperp``, which the project's start-up hook registers: the
    installed ``distperp_harness_hook.pth``, or the ``sitecustomize`` of ``device_run.sh`` on the GPU machine).

    Raises:
        SystemExit: ``name`` is not registered, with lm-eval's message and how to register ``distperp``.
    """
    from lm_eval.api.registry import get_model

    try:
        return get_model(name)
    except ValueError as exc:
        raise SystemExit(
            f"lm-eval has no model {name!r}: {str(exc)[:200]}... Install the project (`pip install -e .`: its "
            "start-up hook registers --model distperp) or run through benchmarks/device_run.sh"
        ) from exc


def cpu_and_peak(step: Callable[[], Any]) -> tuple[float, int, Any]:
    """``(CPU seconds: the median of 3 untraced runs, peak traced bytes, result)`` of ``step()``; the traced run that
    gives the peak and the result is not timed (tracing slows it). ``tracemalloc`` sees Python and NumPy
    allocations, not torch's."""
    cpu = []
    for _ in range(3):
        t = time.process_time()
        step()
        cpu.append(time.process_time() - t)
    tracemalloc.start()
    result = step()
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return sorted(cpu)[1], peak, result


def load_articles(path: Path = WIKITEXT_TEST) -> list[str]:
    """The articles of the WikiText file ``path`` (split on top-level `` = Title = `` lines).

    Raises:
        FileNotFoundError: naming the path and what to pass instead, when the file is missing.
    """
    from distperp_harness.report.wikitext import split_wikitext_articles

    if not path.is_file():
        raise FileNotFoundError(f"WikiText file {path} not found; pass --text PATH (a WikiText test.txt)")
    return split_wikitext_articles(path.read_text(encoding="utf-8"))


def write_sample_copies(path: Path, copies: int = 24) -> Path:
    """``copies`` copies of the packaged WikiText sample in one file at ``path``, each copy's articles retitled and
    every paragraph marked, so no two windows are equal (distperp computes an identical window once; ``hf`` would
    not): the text of ``gpu_all.sh`` where ``../shared`` is absent."""
    from distperp_harness.commands.tiny import sample_text

    out = []
    for i in range(copies):
        for line in sample_text().splitlines():
            s = line.strip()
            if not s or s.startswith("= = "):
                out.append(line)
            elif s.startswith("= "):
                out.append(line.replace(" = ", f" = Copy {i} ", 1))
            else:
                out.append(f" ( {i} ) {s} ")
    Path(path).write_text("\n".join(out) + "\n", encoding="utf-8")
    return Path(path)
