"""What quantization costs, per lm-eval task: KL divergence, top-1 agreement, ln(PPL / PPL_ref) and answer flips.

With ``reference=``, every scored request carries the reference model's log-likelihood, its per-token KL
divergence and its top-1 agreement (:class:`~distperp_harness.report.results.Score`). This module turns the requests of
*every* task (lm-eval's own YAMLs included, not only distperp's) into one entry per task, for
``config.distperp.reference.tasks`` and one log line per task.

**Data flow.** lm-eval hands each rank a share of the documents and calls ``loglikelihood`` (and
``loglikelihood_rolling``) once for the requests of all tasks. :func:`records_from` keeps what each request needs
(``Instance.task_name``, ``doc_id``, ``idx``, the scores, and for multiple-choice documents the choice lengths and
gold index read from the task as lm-eval's ``process_results`` reads them). :meth:`ReferenceComparison.add`
all-gathers the records of every rank, drops lm-eval's padding copies (same key), and aggregates in the canonical
order (task, doc_id, idx): no per-rank partial sums, so every entry is the same bits for every world size.

**Entry** (:func:`task_entry`), documents being the sampling unit:

- ``kl_divergence``, ``top1_agreement``, ``ln_ppl_ratio``: ratios of per-document sums with delta-method standard
  errors (:func:`distperp_harness.report.metrics.ratio_and_stderr`), the same items the ``distperp_*`` tasks aggregate,
  so their values agree exactly on the same documents. ``kl_p99`` / ``kl_max`` over all scored tokens.
- multiple-choice tasks: the model's choice is the first argmax of the choices' log-likelihoods (numpy's
  ``argmax``, as lm-eval's ``acc``); ``flips`` is the share of documents whose choice differs from the reference's,
  ``flips_norm`` the same with lm-eval's ``acc_norm`` rule (log-likelihood / length of the choice in characters,
  ``len(choice)`` of ``task.doc_to_choice(doc)``). Where the task gives a gold index (``task.doc_to_target(doc)``,
  mapped as lm-eval maps it): ``correct_to_wrong`` / ``wrong_to_correct`` (shares of ``n_docs``; the rest of the
  flips went from one wrong answer to another), accuracies of both models and the paired Δ accuracy.

All sums are :func:`math.fsum`. Standard errors that need two documents are ``None`` with one.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import groupby
from types import FrameType
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from distperp_harness.report.metrics import percentile_99, ratio_and_stderr

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Record:
    """One scored request and its reference statistics: what ranks exchange.

    Attributes:
        task, doc_id, idx: where lm-eval's ``Instance`` came from (``idx``: the choice index).
        loglikelihood, ref_loglikelihood: float64 sums (nats) under the model and the reference.
        n_tokens, top1_agree: scored tokens and positions where both models' argmax agree.
        kl: per-token KL(reference || model), float64, ``n_tokens`` long.
        multiple_choice: the task is lm-eval ``multiple_choice`` (``None``: no task object was found; then a
            ``loglikelihood`` task whose documents have two or more requests counts as multiple choice).
        n_choices: choices of the document (requests with ``idx >= n_choices`` are lm-eval's unconditional
            ``acc_mutual_info`` requests and take no part in the choice); ``None``: all requests are choices.
        choice_length: lm-eval's ``acc_norm`` denominator, ``len(choice)`` in characters (without a task object:
            the length of the continuation).
        gold: the document's gold choice indices (one, or several for a multiple-target task); ``None``: unknown.
    """

    task: str
    doc_id: int
    idx: int
    loglikelihood: float
    ref_loglikelihood: float
    n_tokens: int
    top1_agree: int
    kl: np.ndarray
    multiple_choice: bool | None = None
    n_choices: int | None = None
    choice_length: float | None = None
    gold: tuple[int, ...] | None = None

    @property
    def key(self) -> tuple[str, int, int]:
        return (self.task, self.doc_id, self.idx)


# ---------------------------------------------------------------------------------------------------------------
# Requests → records (per rank)
# ---------------------------------------------------------------------------------------------------------------


def evaluator_tasks() -> Mapping[str, Any] | None:
    """The task objects of the lm-eval evaluation that is calling us, by name; ``None`` outside one.

    lm-eval gives a model only ``Instance``s; the task (its ``doc_to_choice`` and ``doc_to_target``, which define
    ``acc_norm``'s lengths and the gold index) stays in ``lm_eval.evaluator.evaluate``'s local ``eval_tasks``.
    This reads that local from the calling frames, read-only; nothing is patched. Without it (a direct call, another
    lm-eval layout) flips are still counted, with continuation lengths and no gold.
    """
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "evaluate" and frame.f_globals.get("__name__") == "lm_eval.evaluator":
            tasks = frame.f_locals.get("eval_tasks")
            if isinstance(tasks, Mapping):
                return tasks
            if isinstance(tasks, list):  # older lm-eval: a list of TaskOutput
                return {t.task_name: t.task for t in tasks if getattr(t, "task", None) is not None}
            return None
        frame = frame.f_back
    return None


def gold_indices(target: Any, choices: Sequence[str]) -> tuple[int, ...] | None:
    """lm-eval's gold of a multiple-choice document as choice indices; ``None`` where it gives none.

    Follows ``ConfigurableTask.process_results``: an int is an index, a string is looked up in ``choices``, a list
    holds several (multiple targets). An index out of range, a string that is no choice, a negative index (the
    unlabeled ``-1`` of test splits) or any other value: no gold.
    """
    values = target if isinstance(target, (list, tuple)) else [target]
    indices = []
    for value in values:
        if isinstance(value, str):
            if value not in choices:
                return None
            value = list(choices).index(value)
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 0 <= value < len(choices):
            return None
        indices.append(int(value))
    return tuple(indices) if indices else None


def _choice_info(task: Any, doc: Any) -> tuple[bool, int | None, list[float] | None, tuple[int, ...] | None]:
    """``(multiple_choice, n_choices, choice lengths, gold)`` of one document, read from its task object."""
    if getattr(task, "OUTPUT_TYPE", None) != "multiple_choice":
        return False, None, None, None
    try:
        choices = list(task.doc_to_choice(doc))
    except Exception:  # lm-eval itself will fail on this document; count flips over the requests
        return True, None, None, None
    try:
        target = task.doc_to_text(doc) if getattr(task, "multiple_input", False) else task.doc_to_target(doc)
        gold = gold_indices(target, choices)
    except Exception:  # a task without usable labels: flips are still counted
        gold = None
    return True, len(choices), [float(len(c)) for c in choices], gold


def records_from(requests: Sequence[Any], scores: Sequence[Any], tasks: Mapping[str, Any] | None) -> list[Record]:
    """Records of this rank's requests (``Instance``s) and their :class:`Score` results, padding copies dropped.

    Requests without a ``doc_id`` (not from lm-eval's evaluator) or scores without reference statistics are skipped.
    """
    out: dict[tuple, Record] = {}
    info_cache: dict[tuple[str, int], tuple] = {}
    for req, score in zip(requests, scores, strict=True):
        if getattr(req, "doc_id", None) is None or getattr(score, "kl", None) is None:
            continue
        task_name = str(req.task_name)
        multiple_choice, n_choices, lengths, gold = None, None, None, None
        task = (tasks or {}).get(task_name)
        if task is not None:
            key = (task_name, req.doc_id)
            if key not in info_cache:
                info_cache[key] = _choice_info(task, req.doc)
            multiple_choice, n_choices, lengths, gold = info_cache[key]
        length = None
        if req.request_type == "loglikelihood":
            length = lengths[req.idx] if lengths and req.idx < len(lengths) else float(len(req.args[1]))
        record = Record(
            task_name,
            int(req.doc_id),
            int(req.idx),
            float(score),
            float(score.ref_loglikelihood),
            int(score.n_tokens),
            int(score.top1_agree),
            np.asarray(score.kl, dtype=np.float64),
            multiple_choice,
            n_choices,
            length,
            gold,
        )
        out.setdefault(record.key, record)
    return list(out.values())


def merge(parts: Sequence[Sequence[Record]]) -> list[Record]:
    """Records of all ranks, each key once, in canonical (task, doc_id, idx) order."""
    unique: dict[tuple, Record] = {}
    for part in parts:
        for record in part:
            unique.setdefault(record.key, record)
    return [unique[k] for k in sorted(unique)]


# ---------------------------------------------------------------------------------------------------------------
# Records → one entry per task (pure; no process group)
# ---------------------------------------------------------------------------------------------------------------


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def _mean_stderr(values: Sequence[float]) -> tuple[float, float | None]:
    """Mean and its standard error (sample standard deviation / sqrt(n), as lm-eval's ``mean_stderr``)."""
    n = len(values)
    mean = math.fsum(values) / n
    if n < 2:
        return mean, None
    variance = math.fsum((v - mean) ** 2 for v in values) / (n - 1)
    return mean, math.sqrt(variance / n)


@dataclass(frozen=True)
class Choice:
    """The choices of one multiple-choice document under both models (first argmax, as numpy and lm-eval)."""

    model: int
    reference: int
    model_norm: int
    reference_norm: int
    gold: tuple[int, ...] | None


def choose(doc: Sequence[Record]) -> Choice:
    """The choice of each model, raw and length-normalised, for one document's records (sorted by ``idx``)."""
    n = doc[0].n_choices
    rows = [r for r in doc if n is None or r.idx < n]
    lls = np.array([r.loglikelihood for r in rows], dtype=np.float64)
    ref = np.array([r.ref_loglikelihood for r in rows], dtype=np.float64)
    lengths = np.array([r.choice_length for r in rows], dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):  # an empty choice: lm-eval divides by zero too
        return Choice(
            int(np.argmax(lls)),
            int(np.argmax(ref)),
            int(np.argmax(lls / lengths)),
            int(np.argmax(ref / lengths)),
            doc[0].gold,
        )


def _is_multiple_choice(docs: Sequence[Sequence[Record]]) -> bool:
    known = docs[0][0].multiple_choice
    if known is not None:
        return known
    return all(r.choice_length is not None for d in docs for r in d) and any(len(d) > 1 for d in docs)


def _flip_stats(choices: Sequence[Choice]) -> dict[str, Any]:
    n = len(choices)
    flips = [float(c.model != c.reference) for c in choices]
    flips_norm = [float(c.model_norm != c.reference_norm) for c in choices]
    entry: dict[str, Any] = {"n_docs": n}
    for name, values in (("flips", flips), ("flips_norm", flips_norm)):
        mean, se = _mean_stderr(values)
        entry.update({name: mean, f"{name}_stderr": se, f"n_{name}": int(sum(values))})
    labelled = [c for c in choices if c.gold is not None]
    golds = [c.gold or () for c in labelled]
    entry["n_docs_with_gold"] = len(labelled)
    if not labelled:
        return entry
    c2w = sum(c.reference in g and c.model not in g for c, g in zip(labelled, golds))
    w2c = sum(c.reference not in g and c.model in g for c, g in zip(labelled, golds))
    entry.update(
        {"correct_to_wrong": c2w / n, "wrong_to_correct": w2c / n, "n_correct_to_wrong": c2w, "n_wrong_to_correct": w2c}
    )
    for suffix, model, reference in (("", "model", "reference"), ("_norm", "model_norm", "reference_norm")):
        mine = [float(getattr(c, model) in g) for c, g in zip(labelled, golds)]
        theirs = [float(getattr(c, reference) in g) for c, g in zip(labelled, golds)]
        delta, se = _mean_stderr([a - b for a, b in zip(mine, theirs)])
        entry.update(
            {
                f"acc{suffix}": math.fsum(mine) / len(mine),
                f"ref_acc{suffix}": math.fsum(theirs) / len(theirs),
                f"delta_acc{suffix}": delta,
                f"delta_acc{suffix}_stderr": se,
            }
        )
    return entry


def task_entry(records: Sequence[Record]) -> dict[str, Any]:
    """The entry of one task from its records (any order; they are sorted here).

    Per document: KL sum ``fsum(kl)`` over all its tokens, token count, top-1 agreements, ``fsum`` of its
    log-likelihoods under both models. Multiple-choice documents add the flip statistics (see the module doc).
    """
    records = sorted(records, key=lambda r: r.key)
    docs = [list(group) for _, group in groupby(records, key=lambda r: r.doc_id)]
    kl_sums, counts, agree, log_ratio = [], [], [], []
    for doc in docs:
        kl = np.concatenate([r.kl for r in doc])
        kl_sums.append(math.fsum(kl))
        counts.append(sum(r.n_tokens for r in doc))
        agree.append(sum(r.top1_agree for r in doc))
        log_ratio.append(math.fsum(r.ref_loglikelihood for r in doc) - math.fsum(r.loglikelihood for r in doc))
    entry: dict[str, Any] = {"n_docs": len(docs), "n_tokens": sum(counts)}
    if entry["n_tokens"] > 0:
        for name, numerators in (("kl_divergence", kl_sums), ("top1_agreement", agree), ("ln_ppl_ratio", log_ratio)):
            value, se = ratio_and_stderr(numerators, counts)
            entry.update({name: value, f"{name}_stderr": _finite(se)})
        entry["kl_p99"] = percentile_99([r.kl for r in records])
        entry["kl_max"] = float(max(float(r.kl.max()) for r in records if r.kl.size))
    if _is_multiple_choice(docs):
        entry.update(_flip_stats([choose(doc) for doc in docs]))
    return entry


def task_entries(records: Sequence[Record]) -> dict[str, dict[str, Any]]:
    """One :func:`task_entry` per task name, sorted by name."""
    ordered = sorted(records, key=lambda r: r.key)
    return {task: task_entry(list(group)) for task, group in groupby(ordered, key=lambda r: r.task)}


def log_line(task: str, entry: Mapping[str, Any]) -> str:
    """One line for a task's entry: KL, top-1 agreement, flips (and their split)."""

    def pm(name: str, digits: str) -> str:
        value, se = entry.get(name), entry.get(f"{name}_stderr")
        if value is None:
            return "–"
        return f"{value:{digits}}" + (f" ± {se:{digits.lstrip('+')}}" if se is not None else "")

    text = (
        f"reference vs model on {task} ({entry['n_docs']} docs, {entry['n_tokens']} tokens): "
        f"KL {pm('kl_divergence', '.4g')} nats/token, top-1 agreement {pm('top1_agreement', '.4f')}, "
        f"ln(PPL/PPL_ref) {pm('ln_ppl_ratio', '.4g')}"
    )
    if "flips" in entry:
        text += (
            f", flips {entry['flips']:.4f} ({entry['n_flips']}/{entry['n_docs']}; "
            f"acc_norm rule {entry['flips_norm']:.4f})"
        )
        if "n_correct_to_wrong" in entry:
            text += (
                f", correct→wrong {entry['n_correct_to_wrong']}, wrong→correct {entry['n_wrong_to_correct']}"
                f", Δacc {pm('delta_acc', '+.4f')}"
            )
    return text


# ---------------------------------------------------------------------------------------------------------------
# The accumulator a DistPerpLM holds
# ---------------------------------------------------------------------------------------------------------------


class GathersToOne(Protocol):
    """What :meth:`ReferenceComparison.add` needs of the process group (``report/`` does not import
    ``distributed/``): :meth:`~distperp_harness.distributed.protocol.Collective.gather_object`."""

    def gather_object(self, obj: Any, dst: int = 0, name: str = ...) -> list[Any] | None: ...


class ReferenceComparison:
    """Records of every scoring call of one model instance, gathered from all ranks on rank 0; entries on demand."""

    def __init__(self) -> None:
        self._records: dict[tuple, Record] = {}

    def add(
        self,
        requests: Sequence[Any],
        scores: Sequence[Any],
        collective: GathersToOne,
        tasks: Mapping[str, Any] | None = None,
    ) -> list[str]:
        """Gather this call's records from every rank on rank 0 (all ranks call this together); rank 0 merges and
        keeps them (it is the rank that reports them), the others keep nothing.

        Returns:
            On rank 0, one :func:`log_line` per task this call touched (entries over everything kept so far), by task
            name; elsewhere nothing.
        """
        parts = collective.gather_object(records_from(requests, scores, tasks), 0, "gather reference comparisons")
        if parts is None:
            return []
        merged = merge(parts)
        for record in merged:
            self._records[record.key] = record
        touched = sorted({r.task for r in merged})
        entries = self.entries()
        return [log_line(task, entries[task]) for task in touched]

    def entries(self) -> dict[str, dict[str, Any]]:
        """``config.distperp.reference.tasks``: one entry per task (see :func:`task_entry`)."""
        return task_entries(list(self._records.values()))


def quantization_warnings(
    report, reference_source: str | None, model: torch.nn.Module, reference: torch.nn.Module | None
) -> list[str]:
    """The quantization report's warnings (recorded in the results) and, with a reference, what a comparison against
    an unquantized model then measures."""
    warnings = list(report.warnings) if report else []
    if warnings and reference is not None:
        warnings.append(
            f"reference={reference_source}: with no layer quantized, the comparison measures only the cast from the "
            f"reference's {next(reference.parameters()).dtype} to the model's {next(model.parameters()).dtype}, not "
            "quantization."
        )
    return warnings
