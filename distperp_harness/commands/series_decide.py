"""Rank 0's decisions in a series, sent to every rank: which checkpoint next, wait (``--watch``: nothing complete
yet), or stop; and :func:`from_main`, how any of rank 0's answers reaches the others."""

from __future__ import annotations

import argparse
import signal
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, Callable, Protocol, TypeVar, cast

from accelerate.logging import get_logger

from distperp_harness.commands.checkpoints import Checkpoint, Snapshot, discover, is_complete, snapshot
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


class Step(Enum):
    RUN = "run"
    WAIT = "wait"
    STOP = "stop"


@dataclass
class Watcher:
    """Rank 0's view of the folders between polls: each candidate's last snapshot, and the stop signals."""

    stop_files: tuple[Path, ...]
    snapshots: dict[Path, Snapshot] = field(default_factory=dict)
    signalled: str | None = None

    def on_signal(self, signum: int, frame: Any) -> None:  # signal handler signature
        self.signalled = signal.Signals(signum).name
        signal.signal(signum, signal.SIG_DFL)  # a second one ends the process at once

    def complete(self, checkpoint: Checkpoint) -> bool:
        now = snapshot(checkpoint.path)
        previous = self.snapshots.get(checkpoint.path)
        self.snapshots[checkpoint.path] = now
        return is_complete(checkpoint.path, previous, now)


def found(spec: str, watching: bool) -> list[Checkpoint]:
    """:func:`discover`; under ``--watch`` nothing found yet is an empty list (the run has not written one yet)."""
    try:
        return discover(spec)
    except InputError:
        if not watching:
            raise
        return []


def candidates(series: Series, spec: str, watching: bool) -> list[Checkpoint]:
    listed = found(spec, watching)
    skip, out = series.done() | series.tried, series.out.resolve()
    return [c for c in listed if c.label not in skip and not c.path.resolve().is_relative_to(out)]


def decide(series: Series, watcher: Watcher | None) -> tuple[Step, Checkpoint | None]:
    """Rank 0: the next checkpoint to evaluate, or wait (``--watch``: nothing complete yet), or stop."""
    pending = candidates(series, series.args.checkpoints, watcher is not None)
    if watcher is None:
        return (Step.RUN, pending[0]) if pending else (Step.STOP, None)
    if watcher.signalled:
        log.info(f"series: {watcher.signalled} received; the watch stops, the series intact", main_process_only=True)
        return Step.STOP, None
    ready = [c for c in pending if watcher.complete(c)]
    if ready:
        return Step.RUN, ready[0]
    stop = next((f for f in watcher.stop_files if f.exists()), None)
    if stop is not None and not pending:
        log.info(f"series: {stop} exists; the watch stops", main_process_only=True)
        return Step.STOP, None
    return Step.WAIT, None


def stop_files(args: argparse.Namespace) -> tuple[Path, ...]:
    """What ends a watch when it exists: ``--stop-file``, else ``STOP`` in the output folder or in a watched
    folder."""
    if args.stop_file:
        return (Path(args.stop_file),)
    folders = [Path(p.strip()) for p in args.checkpoints.split(",") if p.strip() and Path(p.strip()).is_dir()]
    return (Path(args.output_path) / "STOP", *(f / "STOP" for f in folders))
