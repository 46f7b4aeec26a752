"""``python -m distperp_harness sweep``: a quantization leaderboard in one command.

::

    [accelerate launch --multi_gpu --num_processes N] -m distperp_harness sweep --pretrained MODEL \\
        --schemes int4:32,int4:128,int8,8da4w --tasks hellaswag,distperp_wikitext2 --output_path sweep/

Every process runs the same loop: for each scheme, a :class:`~distperp_harness.lm.DistPerpLM` with
``quantize=<scheme>,reference=<reference>`` is evaluated in-process with lm-eval's ``simple_evaluate`` (so every
scheme runs under the same launcher, world size and plan rule). The reference model is loaded **once per launch**:
the first scheme loads it, later schemes reuse the object (``reference_model=``); only the quantized model is
loaded again per scheme (quantization rewrites it in place). Rank 0 writes one lm-eval results folder per scheme,
named as the scheme is given (``<output_path>/int4:32/``, readable by ``compare``), and
``<output_path>/leaderboard.md``: schemes ranked by KL divergence pooled over all scored tokens of all tasks, one
row per scheme and task with KL, top-1 agreement, flips, Δ accuracy and Δ perplexity (± standard errors, all from
``config.distperp.reference.tasks``), a scheme that could not be loaded as a row saying why, weight bytes and
scoring tokens/s (model and reference forward passes); and beside it ``leaderboard.png`` (``--plot PATH`` to
choose): KL per token against weight bytes, one point per scheme, with the Pareto front, and Δppl % / flips / Δacc
per scheme and task (:mod:`distperp_harness.commands.plots`). The exit code: :mod:`~.exitcodes`.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence, cast

from distperp_harness.commands.exitcodes import ExitCode, for_failures
from distperp_harness.commands.panels import (  # re-exported: the leaderboard's ranking and figure data
    leaderboard_panels,  # noqa: F401 - re-exported
    pooled_kl,  # noqa: F401 - re-exported
    pooled_kl_stderr,  # noqa: F401 - re-exported
    ranked,
)
from distperp_harness.errors import InputError
from distperp_harness.options import GROUP_SIZES, QUANT_SCHEMES
from distperp_harness.report.atomic import atomic_write_text


@dataclass(frozen=True)
class Scheme:
    """One ``--schemes`` item: ``name`` or ``name:group_size``."""

    label: str
    quantize: str
    group_size: int | None

    @property
    def folder(self) -> str:
        """Results folder name: the label as given (``int4:32``), as the leaderboard names the scheme."""
        return self.label

    def model_args(self) -> dict[str, Any]:
        args: dict[str, Any] = {"quantize": self.quantize}
        if self.group_size is not None:
            args["group_size"] = self.group_size
        return args


def parse_schemes(text: str) -> list[Scheme]:
    """``"int4:32,int4:128,int8,8da4w"`` → schemes, in the order given; ``ValueError`` names what is wrong."""
    allowed = [s for s in QUANT_SCHEMES if s != "none"]
    fix = (
        f"e.g. --schemes int4:32,int4:128,int8,8da4w (schemes: {', '.join(allowed)}; group sizes: "
        f"{', '.join(map(str, GROUP_SIZES))})"
    )
    schemes = []
    for item in (part.strip() for part in text.split(",")):
        name, _, group = item.partition(":")
        if name not in allowed:
            raise InputError(f"--schemes item {item!r}: scheme {name!r} is not one of {', '.join(allowed)}. Fix: {fix}")
        if group and (not group.isdigit() or int(group) not in GROUP_SIZES):
            raise InputError(
                f"--schemes item {item!r}: group size {group!r} is not one of "
                f"{', '.join(map(str, GROUP_SIZES))}. Fix: {fix}"
            )
        if group and name == "int8":
            raise InputError(f"--schemes item {item!r}: int8 uses per-row scales and takes no group size. Fix: {fix}")
        schemes.append(Scheme(item, name, int(group) if group else None))
    labels = [s.label for s in schemes]
    if len(set(labels)) != len(labels):
        raise InputError(f"--schemes {text!r} names a scheme twice. Fix: {fix}")
    return schemes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``sweep`` subcommand's arguments."""
    parser.add_argument("--pretrained", required=True, help="hub id or local folder of the model")
    parser.add_argument(
        "--schemes",
        default="int4:32,int4:128,int8,8da4w",
        help="comma-separated schemes, each NAME or NAME:GROUP_SIZE (default: %(default)s)",
    )
    parser.add_argument("--tasks", required=True, help="comma-separated lm-eval tasks")
    parser.add_argument("--reference", default="base", help="reference= for every scheme (default: base)")
    parser.add_argument("--model_args", default="", help="other --model_args for every scheme, k=v,...")
    parser.add_argument("--batch_size", default="1", help="batch_size= (N, auto)")
    parser.add_argument(
        "--include_path",
        default=None,
        help="more task YAML folders, comma-separated (distperp's own tasks are always included)",
    )
    parser.add_argument("--metadata", default=None, help="JSON passed to the tasks, as lm-eval's --metadata")
    parser.add_argument("--limit", type=float, default=None, help="documents per task (lm-eval's --limit)")
    parser.add_argument("--log_samples", action="store_true", help="also write per-document samples")
    parser.add_argument("--output_path", required=True, help="folder for one results folder per scheme")
    parser.add_argument(
        "--plot",
        default=None,
        help="path of the leaderboard figure (default: OUTPUT_PATH/leaderboard.png; needs matplotlib)",
    )
    parser.add_argument(
        "--allow-failures",
        dest="allow_failures",
        action="store_true",
        help="exit 0 when some schemes failed to load (their rows still written); default: exit 3",
    )


def _model_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    from lm_eval.utils import simple_parse_args_string

    extra = simple_parse_args_string(args.model_args) if args.model_args else {}
    clash = {"pretrained", "quantize", "group_size", "reference"} & set(extra)
    if clash:
        raise InputError(
            f"--model_args {args.model_args!r} sets {', '.join(sorted(clash))}, which the sweep sets "
            "itself. Fix: use --pretrained, --schemes and --reference for them."
        )
    return {"pretrained": args.pretrained, "reference": args.reference, "batch_size": args.batch_size, **extra}


def run_sweep(args: argparse.Namespace) -> int:
    """Evaluate every scheme (all ranks), write results and the leaderboard (rank 0); returns the exit code
    (:mod:`~.exitcodes`: 3 when a scheme failed to load, after every row is written, unless ``--allow-failures``)."""
    import lm_eval
    from lm_eval.loggers import EvaluationTracker
    from lm_eval.tasks import TaskManager

    from distperp_harness.commands.series_decide import launch_collective, made_on_every_rank
    from distperp_harness.commands.taskdir import tasks_path
    from distperp_harness.lm import DistPerpLM, log

    schemes = parse_schemes(args.schemes)
    kwargs = _model_kwargs(args)
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    metadata = json.loads(args.metadata) if args.metadata else None
    include = [str(tasks_path()), *(p for p in (args.include_path or "").split(",") if p)]
    out = Path(args.output_path)
    collective = launch_collective(kwargs)
    reference, folders, failed, t0 = None, [], [], time.perf_counter()
    for scheme in schemes:
        load = functools.partial(DistPerpLM.in_process, **kwargs, **scheme.model_args(), reference_model=reference)
        made, failure = made_on_every_rank(collective, load, f"sweep: did every rank load {scheme.label}")
        if failure is not None:  # a scheme that cannot be loaded is a row of the leaderboard, not its end
            log.warning(f"sweep: {scheme.label} failed: {failure}; the sweep goes on", main_process_only=True)
            failed.append((scheme.label, failure))
            continue
        lm = cast("DistPerpLM", made)
        del made  # released after its evaluation: no other name may hold it
        log.info(
            f"sweep: scheme {scheme.label} loaded in {lm.load_seconds:.1f} s "
            f"({'reference reused' if reference is not None else 'reference loaded'})",
            main_process_only=True,
        )
        manager = TaskManager(include_path=include, metadata=metadata)
        tracker = EvaluationTracker(output_path=str(out / scheme.folder)) if lm.rank == 0 else None
        results = lm_eval.simple_evaluate(
            model=lm,
            tasks=tasks,
            task_manager=manager,
            limit=args.limit,
            log_samples=args.log_samples,
            evaluation_tracker=tracker,
        )
        if results is not None and tracker is not None:
            save_results(tracker, results, {**kwargs, **scheme.model_args()})
            folders.append((scheme.label, out / scheme.folder))
        reference = lm.reference
        del lm
        gc.collect()
    if collective.is_main:
        from distperp_harness.commands.compare import load_run

        runs = [(label, load_run(folder)) for label, folder in folders]
        print("\n".join(write_leaderboard(out, runs, args.plot, failed)))
        print(
            f"sweep: {len(schemes)} schemes ({len(failed)} failed), reference loaded once, "
            f"{time.perf_counter() - t0:.0f} s; results in {out}/<scheme>/"
        )
        if failed and not args.allow_failures:
            print(f"sweep: exit {ExitCode.FAILED.value}: {len(failed)} scheme(s) failed (--allow-failures: exit 0)")
    code = for_failures(len(failed), args.allow_failures)
    if code and collective.world_size > 1:  # a launcher stops every rank once one exits non-zero: rank 0 has written
        collective.barrier("the leaderboard written before a rank exits")
    return code


def save_results(tracker: Any, results: dict[str, Any], model_args: dict[str, Any]) -> None:
    """Write an in-process evaluation's results (and samples, when logged) with lm-eval's ``EvaluationTracker``
    straight into the tracker's ``output_path``, saying what ran (``model: distperp`` and its ``model_args``): lm-eval
    names an in-process model object by its class and writes under a folder named after it otherwise."""
    results["config"].update(model="distperp", model_args=model_args)
    tracker.general_config_tracker.model_name = str(model_args["pretrained"])
    tracker.general_config_tracker.model_name_sanitized = ""
    samples = results.pop("samples", None)
    tracker.save_results_aggregated(results=results, samples=samples)
    for task in results["configs"] if samples else ():
        tracker.save_results_samples(task_name=task, samples=samples[task])


def write_leaderboard(
    out: Path, runs: list[tuple[str, Any]], plot: str | Path | None = None, failed: Sequence[tuple[str, str]] = ()
) -> list[str]:
    """Write ``leaderboard.md`` and the figure (``plot``, default ``leaderboard.png``) into ``out``; returns the lines
    to print: the table, then one line naming the figure and its panels, or saying why there is none (matplotlib
    missing, nothing to draw). The markdown is written in every case; ``failed``: ``(label, reason)`` of the schemes
    that could not be loaded, each a row of its own after the ranked ones."""
    from distperp_harness.commands.plots import PlotUnavailable, plot_leaderboard

    out.mkdir(parents=True, exist_ok=True)
    table = leaderboard(runs, failed)
    atomic_write_text(out / "leaderboard.md", table + "\n")
    try:
        figure = plot_leaderboard(runs, plot or out / "leaderboard.png").line("sweep")
    except (PlotUnavailable, ValueError) as error:
        figure = f"sweep: no figure: {error}"
    return [table, "", f"sweep: table in {out / 'leaderboard.md'}", figure]


# ---------------------------------------------------------------------------------------------------------------
# The leaderboard (pure: from loaded runs)
# ---------------------------------------------------------------------------------------------------------------


def _pm(value: float | None, stderr: float | None, fmt: str) -> str:
    if value is None:
        return "–"
    return f"{value:{fmt}}" + (f" ± {stderr:{fmt.lstrip('+')}}" if stderr is not None else "")


def leaderboard(runs: list[tuple[str, Any]], failed: Sequence[tuple[str, str]] = ()) -> str:
    """Markdown: ``(label, Run)`` pairs (:class:`~distperp_harness.commands.compare.Run`) ranked by :func:`pooled_kl`, a
    row per task.

    Δacc is the paired difference of accuracy against the reference (lm-eval's ``acc`` rule); c→w / w→c count the
    documents whose answer went from correct to wrong and back; Δppl is ``exp(ln_ppl_ratio) − 1`` in percent, with
    the delta-method standard error; tok/s counts scored tokens over scoring time (model and reference). A scheme
    in ``failed`` is a row saying why, in place of its numbers.
    """
    head = [
        "rank",
        "scheme",
        "task",
        "KL (nats/tok)",
        "top-1 agree",
        "flips",
        "flips (norm)",
        "c→w / w→c",
        "Δacc",
        "Δppl %",
        "weights MB",
        "tok/s",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for rank, (label, run) in enumerate(ranked(runs), start=1):
        for task, e in sorted(run.reference.items()):
            ratio, ratio_se = e.get("ln_ppl_ratio"), e.get("ln_ppl_ratio_stderr")
            dppl = None if ratio is None else 100 * math.expm1(ratio)
            dppl_se = None if ratio_se is None else 100 * math.exp(ratio) * ratio_se
            row = [
                str(rank),
                label,
                task,
                _pm(e.get("kl_divergence"), e.get("kl_divergence_stderr"), ".3g"),
                _pm(e.get("top1_agreement"), e.get("top1_agreement_stderr"), ".3f"),
                "–" if "flips" not in e else f"{e['flips']:.3f} ({e['n_flips']}/{e['n_docs']})",
                "–" if "flips_norm" not in e else f"{e['flips_norm']:.3f}",
                "–" if "n_correct_to_wrong" not in e else f"{e['n_correct_to_wrong']} / {e['n_wrong_to_correct']}",
                _pm(e.get("delta_acc"), e.get("delta_acc_stderr"), "+.3f"),
                _pm(dppl, dppl_se, "+.2f"),
                f"{run.weight_bytes / 1e6:.2f}" if run.weight_bytes else "–",
                f"{run.tokens_per_second:.0f}" if run.tokens_per_second else "–",
            ]
            lines.append("| " + " | ".join(row) + " |")
    for label, reason in failed:
        cells = ["–", label, "–", "failed: " + reason.replace("|", "/"), *["–"] * (len(head) - 4)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
