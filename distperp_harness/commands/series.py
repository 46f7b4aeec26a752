"""``python -m distperp_harness series``: a training run's checkpoints evaluated in one launch, as curves.

::

    [accelerate launch --multi_gpu --num_processes N] -m distperp_harness series \\
        --checkpoints runs/out/ --tasks distperp_wikitext2,hellaswag --output_path series/ [--watch]

A command of its own rather than ``sweep --checkpoints``: a sweep varies the quantization of one model against its
own unquantized weights, a series varies the weights (steps of a run, adapters of a sweep, merges) and reads as
curves over steps; they share the in-process loop (:func:`~.sweep.save_results`), not their options or outputs.

Every rank runs the same loop; every decision (which checkpoint next, whether to wait or stop, whether a load
failed) is rank 0's, sent to all (:meth:`AccelerateCollective.all_gather_object`), so ranks never diverge:

* **Once per launch**: the tasks are built (lm-eval's ``TaskManager.load``: datasets, few-shot docs), and each
  checkpoint's evaluation reuses the Task objects (``simple_evaluate`` takes them); the strings lm-eval asks to
  encode are kept per tokenizer (:meth:`~distperp_harness.tokens.Tokenization.keep_encodings`), keyed by a content
  hash of the loaded tokenizer (:meth:`~distperp_harness.tokens.Tokenization.encoding_key`), so a checkpoint with
  another tokenizer is encoded on its own; a fixed reference (``--reference PATH``) is loaded once.
* **Per checkpoint** (:mod:`~.checkpoints` finds them, by step): a ``DistPerpLM`` with the model_args that load it
  alone (``lm_eval --model distperp --model_args <them>`` gives the same fingerprint) and ``resume_dir`` under
  ``<output_path>/.resume/<label>``; lm-eval's results in ``<output_path>/<label>/`` (``compare`` reads them); the
  model dropped and checked released (:func:`~.release.released`) before the next loads. A checkpoint that fails
  to load is a failed row with its whole reason (:func:`~.series_decide.reason_of`), and the series goes on; the
  launch then exits 3 (:mod:`~.exitcodes`) once every row is written, unless ``--allow-failures``.
* **After each checkpoint** (rank 0): ``series.json`` (the record), ``series.md`` (a row per checkpoint, a column
  per task metric ± stderr) and ``series.png`` (:mod:`~.series_plot`), all written atomically.
* **Resume**: a checkpoint whose row is done and whose results folder holds results is skipped (said once); one
  stopped inside resumes from its saved batches. A failed row is tried again by a new launch.
* ``--watch``: poll the folders every ``--poll`` seconds; a checkpoint is evaluated once its writer is done with it
  (its marker, or files unchanged over ``--settle`` seconds and 2 polls) and its weight files are whole
  (:class:`~.series_decide.Watcher`); one that failed to load is read again when its files change (at most
  ``--retries`` times); ``STOP`` in the output folder or ``--stop-file`` ends the watch once every checkpoint left
  is evaluated or has settled unreadable (a failed row saying what is not whole); SIGTERM / SIGINT end it after
  the checkpoint at hand, the series intact.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import shutil
import signal
import time
import weakref
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, Iterator, cast

from accelerate.logging import get_logger

from distperp_harness.commands.checkpoints import Checkpoint, Kind
from distperp_harness.commands.exitcodes import ExitCode, for_failures
from distperp_harness.commands.series_decide import (
    DEFAULT_RETRIES,
    Step,
    Watcher,
    decide,
    found,
    from_main,
    launch_collective,
    made_on_every_rank,
    settle_seconds,
    stop_files,
)
from distperp_harness.commands.series_table import (
    STATE_FILE,
    TABLE_FILE,
    Row,
    Status,
    read_rows,
    series_table,
    with_row,
    write_rows,
)
from distperp_harness.errors import InputError
from distperp_harness.report.atomic import atomic_write_text

log = get_logger("distperp_harness.series")

OWN_KEYS = ("pretrained", "peft", "delta", "gguf_file", "reference")
"""``--model_args`` keys the series sets per checkpoint."""


class Reference(Enum):
    """``--reference``: none, the series' base (``base``), the checkpoint before (``previous``), or a path."""

    NONE = "none"
    BASE = "base"
    PREVIOUS = "previous"
    PATH = "path"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``series`` subcommand's arguments."""
    parser.add_argument(
        "--checkpoints",
        required=True,
        help="comma-separated checkpoints: folders (HF, PEFT adapter), .gguf files, delta=PATH, globs, or a run's "
        "output folder whose children are checkpoints (checkpoint-N, step_N, ...)",
    )
    parser.add_argument("--base", default=None, help="the model that adapters and delta= checkpoints apply to")
    parser.add_argument("--tasks", required=True, help="comma-separated lm-eval tasks")
    parser.add_argument(
        "--reference",
        default="none",
        help="compare each checkpoint with: none, base (the first checkpoint; for adapters their base), previous "
        "(the checkpoint before), or a model PATH; adds KL, top-1 agreement and flips per step",
    )
    parser.add_argument("--model_args", default="", help="other --model_args for every checkpoint, k=v,...")
    parser.add_argument("--batch_size", default="1", help="batch_size= (N, auto)")
    parser.add_argument("--include_path", default=None, help="more task YAML folders, comma-separated")
    parser.add_argument("--metadata", default=None, help="JSON passed to the tasks, as lm-eval's --metadata")
    parser.add_argument("--num_fewshot", type=int, default=None, help="lm-eval's --num_fewshot")
    parser.add_argument("--limit", type=float, default=None, help="documents per task (lm-eval's --limit)")
    parser.add_argument("--log_samples", action="store_true", help="also write per-document samples")
    parser.add_argument("--output_path", required=True, help="folder for one results folder per checkpoint")
    parser.add_argument("--plot", default=None, help="figure path (default: OUTPUT_PATH/series.png)")
    parser.add_argument("--watch", action="store_true", help="keep evaluating checkpoints as they appear")
    parser.add_argument("--poll", type=float, default=30.0, help="--watch: seconds between polls (default 30)")
    parser.add_argument(
        "--settle",
        type=float,
        default=None,
        help="--watch: a checkpoint without its writer's marker is read once its files have not changed for this "
        "many seconds and 2 polls (default: the larger of 10 s and 2 polls)",
    )
    parser.add_argument(
        "--retries",
        type=int,
        default=DEFAULT_RETRIES,
        help="--watch: a checkpoint that failed to load is read again when its files change, at most this many "
        f"times (default {DEFAULT_RETRIES})",
    )
    parser.add_argument(
        "--allow-failures",
        dest="allow_failures",
        action="store_true",
        help="exit 0 when some checkpoints failed to load (their rows still written); default: exit 3",
    )
    parser.add_argument(
        "--stop-file",
        dest="stop_file",
        default=None,
        help="--watch: stop once this file exists (default: OUTPUT_PATH/STOP)",
    )


def parse_reference(text: str) -> tuple[Reference, str | None]:
    """``--reference`` → its kind and, for a path, the path."""
    for kind in (Reference.NONE, Reference.BASE, Reference.PREVIOUS):
        if text == kind.value:
            return kind, None
    if not Path(text).exists() and "/" not in text:
        raise InputError(
            f"--reference {text!r} is not none, base, previous or an existing model path. Fix: one of those, or a "
            "hub id written owner/name."
        )
    return Reference.PATH, text


def _common_args(args: argparse.Namespace) -> dict[str, Any]:
    from lm_eval.utils import simple_parse_args_string

    extra = simple_parse_args_string(args.model_args) if args.model_args else {}
    clash = set(OWN_KEYS) & set(extra)
    if clash:
        raise InputError(
            f"--model_args {args.model_args!r} sets {', '.join(sorted(clash))}, which the series sets per "
            "checkpoint. Fix: use --checkpoints, --base and --reference for them."
        )
    return {"batch_size": args.batch_size, **extra}


@dataclass
class Series:
    """What one launch knows: the checkpoints' model_args rule, the record so far, what this launch tried, and the
    results read back for the table (``runs``, by label)."""

    args: argparse.Namespace
    out: Path
    common: dict[str, Any]
    reference: tuple[Reference, str | None]
    rows: list[Row] = field(default_factory=list)
    tried: set[str] = field(default_factory=set)
    previous: Checkpoint | None = None
    first: Checkpoint | None = None
    runs: dict[str, Any] = field(default_factory=dict)

    def model_args(self, checkpoint: Checkpoint) -> dict[str, Any]:
        """The ``--model_args`` that evaluate ``checkpoint`` alone (``resume_dir`` aside)."""
        own = checkpoint.model_args(self.args.base)
        kind, path = self.reference
        if kind is Reference.PATH:
            own["reference"] = path
        elif kind is Reference.BASE and checkpoint.kind in (Kind.ADAPTER, Kind.DELTA):
            own["reference"] = "pretrained"
        elif kind is Reference.BASE and self.first is not None and self.first != checkpoint:
            own["reference"] = self.first.model_args(self.args.base)["pretrained"]
        elif kind is Reference.PREVIOUS and self.previous is not None:
            own["reference"] = self.previous.model_args(self.args.base)["pretrained"]
        return {**self.common, **own}

    def resume_dir(self, checkpoint: Checkpoint) -> Path:
        given = self.common.get("resume_dir")
        return Path(given) / checkpoint.label if given else self.out / ".resume" / checkpoint.label

    def done(self) -> set[str]:
        """Labels whose row is done and whose results folder holds results."""
        return {
            r.label for r in self.rows if r.status is Status.DONE and any((self.out / r.folder).rglob("results_*.json"))
        }


# ---------------------------------------------------------------------------------------------------------------
# The loop (every rank)
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class Launch:
    """What one launch keeps across checkpoints: the built tasks, the encoding memos per tokenizer, the last
    reference model loaded and the ``reference=`` it was loaded for (reused while the same is asked), and the
    :class:`~distperp_harness.model.kept_base.BaseKeeper` holding the base of PEFT adapters (read once)."""

    tasks: Any
    memos: dict[str, dict] = field(default_factory=dict)
    reference_model: Any = None
    reference_for: str | None = None
    baseline: int | None = None
    keeper: Any = None


def _build_tasks(args: argparse.Namespace, first_args: dict[str, Any]) -> Any:
    """lm-eval's ``TaskManager`` whose ``load`` builds the tasks the first time and gives the same Task objects
    every time after, with the metadata lm-eval's CLI gives them (the model_args, then ``--metadata``).

    Its index: lm-eval indexes every YAML it ships (14,000 files, ~13 s of a 2-core CPU) and then distperp's and
    ``--include_path``'s folders, each later folder replacing an earlier folder's entry of the same name. When every
    asked name is a single task (not a group or tag, which may gather members from lm-eval's folders) in distperp's
    and ``--include_path``'s folders alone, the full index would give that same entry (theirs come last), so those
    folders alone are indexed (:func:`_own_index_suffices`); otherwise the full index is built, as lm-eval's CLI
    does."""
    from lm_eval.tasks import TaskManager

    from distperp_harness.commands.taskdir import tasks_path

    class BuiltOnce(TaskManager):
        built: Any = None

        def load(self, task_list: Any) -> Any:
            if self.built is None:
                self.built = super().load(task_list)
            return self.built

    include = [str(tasks_path()), *(p for p in (args.include_path or "").split(",") if p)]
    metadata = {**first_args, **(json.loads(args.metadata) if args.metadata else {})}
    own = BuiltOnce(include_path=include, include_defaults=False, metadata=metadata)
    if _own_index_suffices(own, task_names(args)):
        return own
    return BuiltOnce(include_path=include, metadata=metadata)


def task_names(args: argparse.Namespace) -> list[str]:
    """``--tasks`` as the list ``simple_evaluate`` is given."""
    return [t.strip() for t in args.tasks.split(",") if t.strip()]


def _own_index_suffices(manager: Any, names: list[str]) -> bool:
    """Whether every name is a single task (YAML or Python) of ``manager``'s index (see :func:`_build_tasks`)."""
    from lm_eval.tasks._index import Kind as IndexKind

    index = manager.task_index
    return bool(names) and all(n in index and index[n].kind in (IndexKind.TASK, IndexKind.PY_TASK) for n in names)


@contextlib.contextmanager
def env_info_once() -> Iterator[None]:
    """lm-eval's ``add_env_info`` (torch's ``collect_env``, which runs subprocesses: ~0.3 s a call on a 2-core CPU)
    computed for the first checkpoint and copied into each later checkpoint's results: one process has one
    environment. It only adds keys (``pretty_env_info``, versions, the git hash), so the results are what each
    call would write."""
    import lm_eval.evaluator as evaluator

    original = evaluator.add_env_info
    first: dict[str, Any] = {}

    def once(storage: dict[str, Any]) -> None:
        if not first:
            original(first)
        storage.update(copy.deepcopy(first))

    evaluator.add_env_info = once
    try:
        yield
    finally:
        evaluator.add_env_info = original


def evaluate_one(series: Series, launch: Launch, checkpoint: Checkpoint, collective: Any) -> Row:
    """Evaluate ``checkpoint`` on every rank; rank 0 writes its results folder. Returns its row: done, or failed with
    the first failing rank's one line (every rank returns the same status)."""
    import lm_eval
    from lm_eval.loggers import EvaluationTracker

    from distperp_harness.commands.release import released
    from distperp_harness.commands.sweep import save_results
    from distperp_harness.lm import DistPerpLM

    t0 = time.perf_counter()

    def row(status: Status, reason: str = "", reused: int = 0, encoded: int = 0) -> Row:
        seconds = time.perf_counter() - t0
        return Row(checkpoint.label, str(checkpoint.path), checkpoint.step, status, reason, seconds, reused, encoded)

    model_args = series.model_args(checkpoint)
    reference = model_args.get("reference")
    reuse = launch.reference_model if reference == launch.reference_for else None
    resume = str(series.resume_dir(checkpoint))
    made, failure = made_on_every_rank(
        collective,
        lambda: DistPerpLM.in_process(**model_args, resume_dir=resume, reference_model=reuse),
        "series: did every rank load",
    )
    if failure is not None:  # a checkpoint that cannot be loaded is a row of the series, not its end
        return row(Status.FAILED, failure)
    lm = cast("DistPerpLM", made)  # every rank loaded (no failure above)
    del made  # the model is released below: no other name may hold it
    memo = launch.memos.setdefault(lm.encoding_key(), {})
    reused = len(memo)
    lm.keep_encodings(memo)
    tracker = EvaluationTracker(output_path=str(series.out / checkpoint.label)) if lm.rank == 0 else None
    results = lm_eval.simple_evaluate(
        model=lm,
        tasks=task_names(series.args),
        task_manager=launch.tasks,
        num_fewshot=series.args.num_fewshot,
        limit=series.args.limit,
        log_samples=series.args.log_samples,
        evaluation_tracker=tracker,
    )
    if results is not None and tracker is not None:
        save_results(tracker, results, model_args)
    encoded = len(memo) - reused
    log.info(
        f"series: {checkpoint.label} (step {checkpoint.step}) evaluated in {time.perf_counter() - t0:.1f} s; "
        f"{reused} encoded strings reused, {encoded} encoded",
        main_process_only=True,
    )
    if reference not in (None, "base", "pretrained"):  # a model of its own: the next checkpoint may reuse it
        launch.reference_model, launch.reference_for = lm.reference, reference
    kept = launch.keeper is not None and launch.keeper.holds(lm.model)  # the base of the next adapter: not released
    model_ref = weakref.ref(lm.model)
    del lm, results
    release = released(model_ref, launch.baseline)
    if not release.ok and not kept:
        log.warning(f"series: {checkpoint.label}'s model was not released: {release.detail}", main_process_only=True)
    return row(Status.DONE, reused=reused, encoded=encoded)


FIGURE_EVERY_S = 60.0
"""The figure is redrawn after a checkpoint once its last drawing (or the launch's start) is this old, and always at
the end: drawing it costs about a second of a 2-core CPU, which checkpoints of seconds would pay each time."""


def _write_outputs(series: Series, draw: bool = True) -> list[str]:
    """Rank 0: ``series.json``, ``series.md`` and, with ``draw``, the figure; the lines to print."""
    from distperp_harness.commands.compare import load_run
    from distperp_harness.commands.plots import PlotUnavailable
    from distperp_harness.commands.series_plot import plot_series

    write_rows(series.out, series.rows)
    done = series.done()
    for row in series.rows:  # a done checkpoint's results do not change: each folder is read once
        if row.label in done and row.label not in series.runs:
            series.runs[row.label] = load_run(series.out / row.folder)
    runs = {label: run for label, run in series.runs.items() if label in done}
    table = series_table(series.rows, runs)
    atomic_write_text(series.out / TABLE_FILE, table + "\n")
    if not draw:
        return [table, "", f"series: table in {series.out / TABLE_FILE}"]
    try:
        figure = plot_series(series.rows, runs, series.args.plot or series.out / "series.png").line("series")
    except (PlotUnavailable, ValueError) as error:
        figure = f"series: no figure: {error}"
    return [table, "", f"series: table in {series.out / TABLE_FILE}", figure]


def run_series(args: argparse.Namespace) -> int:
    """Evaluate the series (all ranks); rank 0 writes its record, table and figure. Returns the exit code."""
    from distperp_harness.run.execution.progress import setup_logging

    setup_logging()  # the series' own lines, said before the first model loads
    common = _common_args(args)
    series = Series(args, Path(args.output_path), common, parse_reference(args.reference))
    collective = launch_collective(common)
    series.rows = from_main(collective, lambda: read_rows(series.out), "read the record")
    plan = from_main(collective, lambda: found(args.checkpoints, args.watch), "find the checkpoints")
    if series.reference[0] is Reference.PREVIOUS and any(c.kind is not Kind.MODEL for c in plan):
        raise InputError(
            "--reference previous compares model folders with the one before; this series has adapters, delta= or "
            "GGUF checkpoints. Fix: --reference base (their base) or a model PATH.",
            same_on_every_rank=True,
        )
    series.first = plan[0] if plan else None
    skipped = sorted(series.done())
    if skipped:
        log.info(
            f"series: {len(skipped)} checkpoint(s) done already, skipped: {', '.join(skipped)}", main_process_only=True
        )
    watcher = Watcher(stop_files(args), settle_seconds(args.poll, args.settle), args.retries) if args.watch else None
    handlers = {s: signal.signal(s, watcher.on_signal) for s in (signal.SIGTERM, signal.SIGINT)} if watcher else {}
    try:
        return _loop(series, collective, watcher, plan, common)
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)


def _loop(series: Series, collective: Any, watcher: Watcher | None, plan: list[Checkpoint], common: dict) -> int:
    """Evaluate checkpoints until rank 0 says stop (see :func:`decide`); rank 0 prints the table at the end."""
    from distperp_harness.commands.release import cuda_baseline
    from distperp_harness.model.kept_base import keeping_base

    launch = Launch(_build_tasks(series.args, series.model_args(plan[0]) if plan else common), baseline=cuda_baseline())
    with keeping_base() as launch.keeper, env_info_once():
        return _checkpoints(series, collective, watcher, launch)


def _checkpoints(series: Series, collective: Any, watcher: Watcher | None, launch: Launch) -> int:
    """The loop of :func:`_loop`, with the launch's kept state."""
    args = series.args
    t0, lines, drawn = time.perf_counter(), [], False
    last_figure = t0
    while True:
        decision = from_main(collective, lambda: decide(series, watcher), "decide what next")
        if decision.step is Step.STOP:
            break
        if decision.step is Step.WAIT:
            time.sleep(args.poll)
            continue
        checkpoint = cast(Checkpoint, decision.checkpoint)  # RUN and ABANDON name one
        series.tried.add(checkpoint.label)
        if decision.step is Step.ABANDON:
            row = Row(checkpoint.label, str(checkpoint.path), checkpoint.step, Status.FAILED, decision.reason)
        else:
            series.first = series.first or checkpoint  # a watch that started before the run wrote any
            row = evaluate_one(series, launch, checkpoint, collective)
        series.rows = with_row(series.rows, row)
        if row.status is Status.DONE:
            series.previous = checkpoint
        elif watcher is not None and decision.step is Step.RUN:
            watcher.failed_now(checkpoint)  # read again once its files change
        if collective.is_main:
            if row.status is Status.DONE:
                shutil.rmtree(series.resume_dir(checkpoint), ignore_errors=True)
            else:
                log.warning(f"series: {row.label} failed: {row.reason}; the series goes on", main_process_only=True)
            drawn = time.perf_counter() - last_figure >= FIGURE_EVERY_S
            lines = _write_outputs(series, draw=drawn)
            last_figure = time.perf_counter() if drawn else last_figure
    failed = sum(r.status is Status.FAILED for r in series.rows)
    if collective.is_main:
        if not drawn and series.rows:
            lines = _write_outputs(series)
        print("\n".join(lines))
        print(
            f"series: {len(series.rows)} checkpoint(s) ({failed} failed), {len(series.tried)} evaluated in this "
            f"launch, {time.perf_counter() - t0:.0f} s; results in {series.out}/<checkpoint>/, record in "
            f"{series.out / STATE_FILE}"
        )
        if failed and not args.allow_failures:
            print(f"series: exit {ExitCode.FAILED.value}: {failed} checkpoint(s) failed (--allow-failures: exit 0)")
    code = for_failures(failed, args.allow_failures)
    if code and collective.world_size > 1:  # a launcher stops every rank once one exits non-zero: rank 0 has written
        collective.barrier("the series' record written before a rank exits")
    return code
