"""lm-eval's per-rank document split, made to give what one process gives.

lm-eval 0.4.13's ``evaluate()`` calls ``task.build_all_requests(rank=r, world_size=n, ...)``, which builds requests
for ``docs[r::n]`` only. That breaks two promises of a world-size-independent backend:

- a rank that gets no document (a task with fewer documents than ranks, or ``--limit 1``) raises
  ``"task.build_requests() did not find any docs!"`` and the other ranks wait for it forever;
- lm-eval's default few-shot sampler draws from one random generator per task that advances once per document the
  rank builds, so every prompt but each rank's first depends on the number of processes (``first_n`` is unaffected).

Contract of the wrapper installed by :func:`install_document_split` (``DistPerpLM`` installs it when ``world_size > 1``,
once per process). On every call of ``Task.build_all_requests`` it reads ``lm`` from the calling
``lm_eval.evaluator.evaluate`` frame (read-only). Unless that ``lm`` carries an installed ``document_split`` record
(what :func:`install_document_split` returned to it: a ``DistPerpLM``) and has more than one process, and unless the
task needs it — ``num_fewshot > 0`` with a sampler that is not ``first_n``, or fewer documents after
``limit``/``samples`` than ranks — the original runs unchanged. When it acts (:func:`build_split`):

1. the original runs with ``rank=0, world_size=1``: the sampler's generator advances exactly as in one process, and
   every rank builds every document's prompt (cost: see docs/scale.md, "Document splitting");
2. the rank keeps the instances of exactly the documents ``task.doc_iterator(rank=, limit=, samples=,
   world_size=)`` yields for it — what ``evaluate()`` iterates when it computes metrics, so metrics are those of one
   process;
3. a rank left with no document keeps fresh copies (no responses) of the first document's instances, so lm-eval's
   ``task.instances[0]`` and its padding all-gather work; its ``doc_iterator`` yields nothing, so nothing is counted
   twice, and distperp's plan computes identical requests once. Such a rank then sends ``evaluate()`` no metric
   keys for the task, and rank 0 reads every key from every rank: ``DistPerpLM.gather_object`` passes what it
   gathers through :func:`fill_empty_ranks`, which reads a missing key of those tasks as an empty list.

What was done is recorded per task in the lm's ``document_split`` (:class:`DocumentSplit`;
``config.distperp.document_split``) and logged once per acting task on rank 0. If lm-eval's layout differs (method or
arguments missing), nothing is wrapped and every rank warns at start with the fix (``fewshot_config: sampler: first_n``,
or one process).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import sys
from dataclasses import dataclass, field
from types import FrameType
from typing import Any, Callable, cast

from accelerate.logging import get_logger

from distperp_harness.distributed.failfast import stop_together

log = get_logger(__name__)

_MARK = "_distperp_document_split"


@dataclass
class TaskSplit:
    """What the wrapper did for one task on this rank (:func:`build_split`): why it acted (``reason``; None: lm-eval's
    own build ran), the task's document count in one process, whether every document's requests were built
    (``built_all``), how many documents this rank kept, whether it kept a padding copy of the first document's
    requests because it had none (``padded``), and how many ranks have no document (``empty_ranks``)."""

    reason: str | None
    documents: int
    built_all: bool = False
    kept_documents: int | None = None
    padded: bool = False
    empty_ranks: int = 0


@dataclass
class DocumentSplit:
    """The lm's record of the wrapper (``config.distperp.document_split`` is :meth:`to_dict`): whether it is
    installed, why not (``problem``), and each task's :class:`TaskSplit` by task name."""

    installed: bool = False
    problem: str | None = None
    tasks: dict[str, TaskSplit] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_BUILD_ARGS = ("limit", "samples", "rank", "world_size")
_ITER_ARGS = ("rank", "limit", "world_size", "samples")


def layout_problem() -> str | None:
    """Why the wrapper cannot be installed on this lm-eval, or ``None`` when it can."""
    try:
        from lm_eval.api.task import ConfigurableTask, Task
    except ImportError as exc:
        return f"lm_eval.api.task has no Task/ConfigurableTask ({exc})"
    for name, wanted in (("build_all_requests", _BUILD_ARGS), ("doc_iterator", _ITER_ARGS)):
        method = getattr(Task, name, None)
        if method is None:
            return f"lm_eval's Task has no {name}()"
        missing = [a for a in wanted if a not in inspect.signature(method).parameters]
        if missing:
            return f"lm_eval's Task.{name}() takes no {', '.join(missing)}"
    if ConfigurableTask.build_all_requests is not Task.build_all_requests:
        return "lm_eval's ConfigurableTask overrides build_all_requests()"
    return None


def install_document_split(world_size: int) -> DocumentSplit:
    """Wrap ``Task.build_all_requests`` (idempotent) when ``world_size > 1``; return a fresh record for the lm."""
    record = DocumentSplit()
    if world_size <= 1:
        return record
    problem = layout_problem()
    if problem:
        record.problem = problem
        log.warning(
            f"document split: {problem}, so lm-eval's own per-rank split is used: a rank with no document "
            "fails, and few-shot prompts drawn by the default random sampler change with the number of "
            "processes. Fix: fewshot_config: sampler: first_n in the task, or one process.",
            main_process_only=False,
        )
        return record
    from lm_eval.api.task import Task

    if not getattr(Task.build_all_requests, _MARK, False):
        original = Task.build_all_requests

        @functools.wraps(original)
        def build_all_requests(self, **kwargs):
            lm = evaluator_lm()
            record = getattr(lm, "document_split", None)
            if not (isinstance(record, DocumentSplit) and record.installed) or getattr(lm, "world_size", 1) <= 1:
                return original(self, **kwargs)
            collective, device = getattr(lm, "collective", None), getattr(lm, "device", None)
            with stop_together(cast(Any, collective), device, "building requests (document split)"):
                entry = build_split(self, original, **kwargs)
            name = getattr(self, "task_name", None) or type(self).__name__
            record.tasks[name] = entry
            if entry.reason:
                log.info(
                    f"document split: {name}: {entry.reason}: every rank built the requests of all "
                    f"{entry.documents} document(s) and keeps its own, as one process would "
                    "(docs/scale.md: document splitting)",
                    main_process_only=True,
                )

        setattr(build_all_requests, _MARK, True)
        Task.build_all_requests = build_all_requests
    record.installed = True
    return record


def evaluator_lm() -> Any:
    """The ``lm`` local of the calling ``lm_eval.evaluator.evaluate`` frame (read-only), or ``None`` outside one."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "evaluate" and frame.f_globals.get("__name__") == "lm_eval.evaluator":
            return frame.f_locals.get("lm")
        frame = frame.f_back
    return None


def count_documents(task: Any, limit: int | float | None, samples: list[int] | None) -> int:
    """How many documents ``task.doc_iterator(limit=limit, samples=samples)`` yields in one process."""
    total = len(task.eval_docs)
    if samples:
        return len({i for i in samples if 0 <= i < total})
    return total if not limit else min(int(limit), total)


def split_reason(
    task: Any, *, world_size: int, limit: int | float | None = None, samples: list[int] | None = None
) -> tuple[str | None, int]:
    """``(why the split must be one process's, or None; documents after limit/samples)`` for ``world_size`` ranks."""
    documents = count_documents(task, limit, samples)
    if world_size <= 1:
        return None, documents
    reasons = []
    num_fewshot = getattr(task.config, "num_fewshot", None) or 0
    if num_fewshot > 0:
        from lm_eval.api.samplers import FirstNSampler

        sampler = getattr(task, "sampler", None)
        if not isinstance(sampler, FirstNSampler):
            reasons.append(
                f"{num_fewshot}-shot prompts from the {type(sampler).__name__} sampler (random, "
                "advanced once per document built)"
            )
    if documents < world_size:
        reasons.append(f"{documents} document(s) for {world_size} ranks")
    return ("; ".join(reasons) or None), documents


def build_split(
    task: Any,
    build: Callable[..., None],
    *,
    rank: int = 0,
    world_size: int = 1,
    limit: int | float | None = None,
    samples: list[int] | None = None,
    **kwargs: Any,
) -> TaskSplit:
    """Build ``task``'s instances for ``rank`` of ``world_size`` as one process would (module docstring); ``build``
    is the original ``Task.build_all_requests``, ``kwargs`` its other arguments. Returns the task's
    :class:`TaskSplit`; with no reason, ``build`` runs unchanged."""
    reason, documents = split_reason(task, world_size=world_size, limit=limit, samples=samples)
    entry = TaskSplit(reason, documents, empty_ranks=max(0, world_size - documents))
    if reason is None:
        build(task, limit=limit, samples=samples, rank=rank, world_size=world_size, **kwargs)
        return entry
    build(task, limit=limit, samples=samples, rank=0, world_size=1, **kwargs)
    everything = task.instances
    mine = {doc_id for doc_id, _ in task.doc_iterator(rank=rank, limit=limit, samples=samples, world_size=world_size)}
    kept = [inst for inst in everything if inst.doc_id in mine]
    entry.built_all, entry.kept_documents = True, len(mine)
    if not kept:  # lm-eval needs instances on every rank; these answer nothing (no document is iterated)
        from lm_eval.api.instance import Instance

        first = everything[0].doc_id
        kept = [
            Instance(
                request_type=inst.request_type,
                doc=inst.doc,
                arguments=inst.arguments,
                idx=inst.idx,
                metadata=(inst.task_name, inst.doc_id, inst.repeats),
            )
            for inst in everything
            if inst.doc_id == first
        ]
        entry.padded = True
    task._instances = kept  # lm-eval's Task keeps them there; its `instances` property has no setter
    return entry


def fill_empty_ranks(gathered: list, record: DocumentSplit) -> list:
    """Every rank's ``gather_object`` payload, with a missing metric key read as ``[]`` for the tasks of ``record``
    (the lm's ``document_split``) that left some rank without documents.

    lm-eval's ``evaluate()`` gathers ``{task: {(metric, filter): [values]}}`` from every rank and reads every key of
    rank 0's dict from each; a rank with no document of the task computed no metric, so its dict has no key. Other
    payloads (logged samples: ``{task: [rows]}``) and other tasks pass unchanged.
    """
    tasks = {name for name, entry in record.tasks.items() if entry.empty_ranks}
    if not tasks:
        return gathered
    from collections import defaultdict

    return [
        {
            name: defaultdict(list, value) if name in tasks and isinstance(value, dict) else value
            for name, value in payload.items()
        }
        if isinstance(payload, dict)
        else payload
        for payload in gathered
    ]


def detach_padding(requests: list) -> list:
    """Give lm-eval's padding requests responses of their own; returns ``requests``, changed in place.

    A rank with fewer instances than another is padded by lm-eval's ``evaluate()`` with more references to the
    call's last request (``cloned_reqs.extend([req] * req.repeats)``, once per missing instance), and every answer
    is then appended to its request's ``resps``: that request's ``resps`` would hold its value twice on N processes
    and once on one, and the samples files of 1 and N processes would differ (lm-eval's own doing: ``hf`` shows it on
    several GPUs; on CPU it runs world size 1 in every process and never pads). Each reference beyond a request's
    ``repeats`` is replaced, in the list lm-eval passed and zips with the answers, by a shallow copy with its own
    empty ``resps`` and ``filtered_resps``; lm-eval never reads those copies again (its tasks hold the originals)."""
    import copy

    seen: dict[int, int] = {}
    for i, request in enumerate(requests):
        seen[id(request)] = count = seen.get(id(request), 0) + 1
        if count > (getattr(request, "repeats", None) or 1):
            padding = copy.copy(request)
            padding.resps, padding.filtered_resps = [], {}
            requests[i] = padding
    return requests
