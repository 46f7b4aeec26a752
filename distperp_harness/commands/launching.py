"""Starting lm-eval (or any module) under ``accelerate launch``, offline: the one launch command of the project.

Used by the package's commands (``demo``, ``check``), the benchmarks and the tests. ``--multi_gpu`` is passed for
two or more processes even on CPU: Accelerate's ``--cpu`` flag starts a single process whatever
``--num_processes`` says. On a CPU-only machine the processes form a gloo group only if the program creates
``PartialState(cpu=True)`` (or ``Accelerator(cpu=True)``), as ``DistPerpLM`` does; a bare ``PartialState()`` reports
world size 1.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from collections.abc import Mapping, Sequence

OFFLINE_ENV: dict[str, str] = {
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TORCHAO_FORCE_SKIP_LOADING_SO_FILES": "1",
    "TOKENIZERS_PARALLELISM": "false",
}
"""What a run of the project's own checks sets: no hub access, torchao's Python kernels, quiet tokenizers."""


def offline_env(extra: Mapping[str, str] | None = None, *, keep_set: bool = False) -> dict[str, str]:
    """A copy of ``os.environ`` with :data:`OFFLINE_ENV` applied, then ``extra`` (which wins).

    With ``keep_set`` a variable the user already set keeps its value (a user command that respects the caller's
    environment); without it the offline values win (tests and benchmarks must never reach a hub).
    """
    env = dict(os.environ)
    for key, value in OFFLINE_ENV.items():
        if not (keep_set and key in env):
            env[key] = value
    env.update(extra or {})
    return env


def free_port() -> int:
    """A TCP port that was free a moment ago (for ``--main_process_port``)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def accelerate_launch_prefix(
    num_processes: int,
    port: int | None = None,
    *,
    num_machines: int = 1,
    machine_rank: int = 0,
    main_ip: str | None = None,
) -> list[str]:
    """``python -m accelerate.commands.launch ...`` for ``num_processes`` processes over ``num_machines``.

    ``num_processes`` counts every process of every machine, as Accelerate's flag does. Append the script (or
    ``-m module``) and its arguments.

    Raises:
        ValueError: a count below 1, or a machine rank outside ``0 .. num_machines - 1``.
    """
    if num_processes < 1 or num_machines < 1:
        raise ValueError(f"num_processes and num_machines must be >= 1, got {num_processes} and {num_machines}")
    if not 0 <= machine_rank < num_machines:
        raise ValueError(f"machine_rank must be in 0..{num_machines - 1}, got {machine_rank}")
    machines = ["--num_machines", str(num_machines)]
    if num_machines > 1:
        machines += ["--machine_rank", str(machine_rank), "--main_process_ip", main_ip or "127.0.0.1"]
    return [
        sys.executable, "-m", "accelerate.commands.launch",
        *(["--multi_gpu"] if num_processes > 1 else []),
        "--num_processes", str(num_processes), *machines,
        "--mixed_precision", "no", "--dynamo_backend", "no",
        "--main_process_port", str(port if port is not None else free_port()),
    ]  # fmt: skip


def lm_eval_command(
    processes: int,
    model_args: str,
    tasks: str,
    *,
    output_path: str | os.PathLike[str],
    include_path: str | os.PathLike[str] | None = None,
    metadata: Mapping[str, object] | None = None,
    extra: Sequence[str] = (),
) -> list[str]:
    """``accelerate launch ... -m lm_eval --model distperp`` with ``--log_samples`` into ``output_path``, the command
    a user types, for ``processes`` local processes; ``extra`` goes last (``--limit``, ``--batch_size``...)."""
    return [
        *accelerate_launch_prefix(processes),
        "-m", "lm_eval", "--model", "distperp", "--model_args", model_args, "--tasks", tasks,
        *(["--include_path", str(include_path)] if include_path is not None else []),
        *(["--metadata", json.dumps(dict(metadata))] if metadata else []),
        "--log_samples", "--output_path", str(output_path), *extra,
    ]  # fmt: skip
