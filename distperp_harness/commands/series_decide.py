"""Rank 0's decisions in a series, sent to every rank: which checkpoint next, wait (``--watch``: nothing complete
yet), or stop; :func:`from_main`, how any of rank 0's answers reaches the others; and :func:`made_on_every_rank`,
whether every rank loaded a checkpoint's (or a sweep scheme's) model, with the failing rank's whole reason."""

from __future__ import annotations

import argparse
import gc
import signal
import time
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, Callable, Protocol, TypeVar, cast

from accelerate.logging import get_logger

from distperp_harness.commands.checkpoints import Checkpoint, Snapshot, discover, has_marker, not_whole, snapshot
from distperp_harness.errors import InputError


class Series(Protocol):
    """What the decisions read of the series (:class:`~.series.Series`; a protocol, so that this module stays below
    the loop that imports it)."""

    args: argparse.Namespace
    out: Path
    tried: set[str]

    def done(self) -> set[str]: ...


log = get_logger("distperp_harness.series")

T = TypeVar("T")


def from_main(collective: Any, make: Callable[[], T], name: str) -> T:
    """``make()`` computed on rank 0, its result on every rank; an :class:`InputError` it raises is raised on every
    rank (the others would otherwise wait for rank 0's answer)."""
    answer: tuple[T | None, InputError | None] = (None, None)
    if collective.is_main:
        try:
            answer = (make(), None)
        except InputError as raised:
            answer = (None, raised)
    value, failure = collective.all_gather_object(answer, f"series: {name}")[0]
    if failure is not None:
        raise InputError(str(failure), same_on_every_rank=True)
    return cast(T, value)


def reason_of(error: BaseException) -> str:
    """An error as one whole line: its type and every line of its message joined (a failed row's reason, in the
    log, ``series.json``, ``series.md`` and ``leaderboard.md`` alike; never cut)."""
    return f"{type(error).__name__}: " + " ".join(str(error).split())


def made_on_every_rank(collective: Any, make: Callable[[], T], name: str) -> tuple[T | None, str | None]:
    """``make()`` on every rank (a checkpoint's or a scheme's model), and whether every rank made it: ``(value,
    None)``, or ``(None, reason)`` on every rank with the first failing rank's :func:`reason_of` (the value of the
    ranks that made it dropped), so that every rank goes on to the same next step."""
    try:
        value: T | None = make()
        failure = None
    except Exception as error:  # a model that cannot be loaded is a row of its own, not the end of the launch
        value, failure = None, reason_of(error)
    failures = [f for f in collective.all_gather_object(failure, name) if f]
    if failures:
        del value
        gc.collect()
        return None, failures[0]
    return value, None


def launch_collective(model_args: dict[str, Any]) -> Any:
    """The launch's process group for a command that evaluates several models in one launch (``series``, ``sweep``):
    gloo on CPU (``device=cpu`` or no CUDA), bounded by the ``timeout`` of ``model_args``."""
    import torch

    from distperp_harness.distributed.collective import AccelerateCollective

    cpu = str(model_args.get("device", "")).strip().lower() == "cpu" or not torch.cuda.is_available()
    return AccelerateCollective(float(model_args.get("timeout", 1800.0)), cpu=cpu)


class Step(Enum):
    RUN = "run"
    WAIT = "wait"
    ABANDON = "abandon"  # --watch stopping: a checkpoint whose files never became whole is a failed row
    STOP = "stop"


@dataclass(frozen=True)
class Decision:
    """Rank 0's answer to "what next": the step, the checkpoint it names (``RUN``, ``ABANDON``) and why
    (``ABANDON``: what is not whole)."""

    step: Step
    checkpoint: Checkpoint | None = None
    reason: str = ""


DEFAULT_SETTLE_S = 10.0
SETTLE_POLLS = 2
DEFAULT_RETRIES = 3


@dataclass
class Seen:
    """A checkpoint's files as the watch last saw them, since when (monotonic seconds) and over how many polls
    they have not changed; the last :func:`~.checkpoints.not_whole` verdict on those files (read once per
    snapshot: a GGUF file's is seconds)."""

    files: Snapshot
    since: float
    polls: int = 0
    verdict: tuple[str | None] | None = None


@dataclass
class Watcher:
    """Rank 0's view of the folders between polls (``--watch``).

    A checkpoint is read once its writer is done with it, by its marker (:func:`~.checkpoints.has_marker`) or by
    its files (names, sizes, times) unchanged over ``settle_s`` seconds and at least :data:`SETTLE_POLLS` polls, and
    only when its weight files are whole (:func:`~.checkpoints.not_whole`: safetensors and GGUF headers and sizes
    agree with the index). A checkpoint that failed to load is read again when its files change, at most
    ``retries`` times. Also the stop signals."""

    stop_files: tuple[Path, ...]
    settle_s: float = DEFAULT_SETTLE_S
    retries: int = DEFAULT_RETRIES
    seen: dict[Path, Seen] = field(default_factory=dict)
    failed: dict[str, Snapshot] = field(default_factory=dict)
    retried: dict[str, int] = field(default_factory=dict)
    signalled: str | None = None
    clock: Callable[[], float] = time.monotonic

    def on_signal(self, signum: int, frame: Any) -> None:  # signal handler signature
        self.signalled = signal.Signals(signum).name
        signal.signal(signum, signal.SIG_DFL)  # a second one ends the process at once

    def look(self, checkpoint: Checkpoint) -> Seen:
        """This poll's look at ``checkpoint``'s files (call once per poll)."""
        now, files = self.clock(), snapshot(checkpoint.path)
        seen = self.seen.get(checkpoint.path)
        if seen is None or seen.files != files:
            seen = self.seen[checkpoint.path] = Seen(files, now)
        else:
            seen.polls += 1
        return seen

    def settled(self, seen: Seen) -> bool:
        return bool(seen.files) and seen.polls >= SETTLE_POLLS and self.clock() - seen.since >= self.settle_s

    def not_whole(self, checkpoint: Checkpoint, seen: Seen) -> str | None:
        if seen.verdict is None:
            seen.verdict = (not_whole(checkpoint.path),)
        return seen.verdict[0]

    def ready(self, checkpoint: Checkpoint) -> bool:
        """Whether ``checkpoint`` may be read now (see the class docstring); looks at its files once."""
        seen = self.look(checkpoint)
        if not (self.settled(seen) or (seen.files and has_marker(checkpoint.path))):
            return False
        return self.not_whole(checkpoint, seen) is None

    def stuck(self, checkpoint: Checkpoint) -> str | None:
        """Why ``checkpoint`` is not readable although its files have settled (damaged at rest, or a writer that
        stopped), or ``None`` while it may still become readable (its files change, or have not settled)."""
        seen = self.seen.get(checkpoint.path)
        if seen is None or not self.settled(seen):
            return None
        return self.not_whole(checkpoint, seen) or None

    def failed_now(self, checkpoint: Checkpoint) -> None:
        """``checkpoint`` failed to load: read it again once its files change (:meth:`again`)."""
        self.failed[checkpoint.label] = snapshot(checkpoint.path)

    def again(self, checkpoint: Checkpoint) -> bool:
        """Whether a checkpoint that failed in this launch is to be read again: its files changed since, and it was
        retried fewer than ``retries`` times."""
        label = checkpoint.label
        if label not in self.failed or self.retried.get(label, 0) >= self.retries:
            return False
        return snapshot(checkpoint.path) != self.failed[label]

    def retrying(self, checkpoint: Checkpoint) -> None:
        self.retried[checkpoint.label] = self.retried.get(checkpoint.label, 0) + 1
        del self.failed[checkpoint.label]


def settle_seconds(poll_s: float, settle_s: float | None) -> float:
    """``--settle``, or the default: at least :data:`DEFAULT_SETTLE_S` and :data:`SETTLE_POLLS` polls."""
    return max(DEFAULT_SETTLE_S, SETTLE_POLLS * poll_s) if settle_s is None else settle_s


def found(spec: str, watching: bool) -> list[Checkpoint]:
    """:func:`discover`; under ``--watch`` nothing found yet is an empty list (the run has not written one yet)."""
    try:
        return discover(spec)
    except InputError:
        if not watching:
            raise
        return []


def candidates(series: Series, spec: str, watcher: Watcher | None = None) -> list[Checkpoint]:
    """The checkpoints still to evaluate: not done, not tried in this launch (unless the watch reads a failed one
    again, :meth:`Watcher.again`), not inside the output folder."""
    listed = found(spec, watcher is not None)
    done, out = series.done(), series.out.resolve()
    return [
        c
        for c in listed
        if c.label not in done
        and (c.label not in series.tried or (watcher is not None and watcher.again(c)))
        and not c.path.resolve().is_relative_to(out)
    ]


def decide(series: Series, watcher: Watcher | None) -> Decision:
    """Rank 0: the next checkpoint to evaluate, or wait (``--watch``: nothing readable yet), or, once a stop file
    exists and every checkpoint left has settled unreadable, abandon each as a failed row, then stop."""
    pending = candidates(series, series.args.checkpoints, watcher)
    if watcher is None:
        return Decision(Step.RUN, pending[0]) if pending else Decision(Step.STOP)
    if watcher.signalled:
        log.info(f"series: {watcher.signalled} received; the watch stops, the series intact", main_process_only=True)
        return Decision(Step.STOP)
    ready = [c for c in pending if watcher.ready(c)]
    if ready:
        if ready[0].label in watcher.failed:
            watcher.retrying(ready[0])
        return Decision(Step.RUN, ready[0])
    stop = next((f for f in watcher.stop_files if f.exists()), None)
    if stop is None:
        return Decision(Step.WAIT)
    stuck = [(c, watcher.stuck(c)) for c in pending]
    if any(why is None for _, why in stuck):
        return Decision(Step.WAIT)  # a checkpoint still being written: the writer left STOP before it settled
    if stuck:
        checkpoint, why = stuck[0]
        return Decision(Step.ABANDON, checkpoint, f"its files were not whole when the watch stopped: {why}")
    log.info(f"series: {stop} exists; the watch stops", main_process_only=True)
    return Decision(Step.STOP)


def stop_files(args: argparse.Namespace) -> tuple[Path, ...]:
    """What ends a watch when it exists: ``--stop-file``, else ``STOP`` in the output folder or in a watched
    folder."""
    if args.stop_file:
        return (Path(args.stop_file),)
    folders = [Path(p.strip()) for p in args.checkpoints.split(",") if p.strip() and Path(p.strip()).is_dir()]
    return (Path(args.output_path) / "STOP", *(f / "STOP" for f in folders))
