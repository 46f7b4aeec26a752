"""Zero-config registration of ``--model distperp`` and of distperp's tasks with lm-eval.

lm-eval has no entry-point discovery for models. The installed ``distperp_harness_hook.pth`` imports this
module at interpreter start-up; it only puts a finder on ``sys.meta_path`` (stdlib, no torch, no lm-eval).
When ``lm_eval.api.registry`` is first imported, the finder lets it load normally, then registers the lazy
target ``distperp_harness.lm:DistPerpLM`` under the name ``distperp``. lm-eval's built-in models are
registered first (``import lm_eval.models``, itself lazy), so ``hf`` and ``dummy`` still resolve.

Likewise, when ``lm_eval.tasks.manager`` is first imported, its ``TaskManager`` learns to index distperp's task
folder next to lm-eval's own (:func:`add_tasks`), so ``--tasks distperp_wikitext2`` needs no ``--include_path``;
a handful of YAML files more in the index lm-eval builds anyway. And when ``lm_eval.loggers.evaluation_tracker``
is first imported, ``--output_path`` is checked before any model loads and results are never lost at the end
(:func:`guard_outputs`). When ``lm_eval.config.evaluate_config`` is first imported, lm-eval's command line checks
a ``--model distperp`` run's arguments (every ``--model_args`` key and value, the launch's group sizes,
``--use_cache``, ``--limit``, the distperp tasks' ``--metadata`` keys) as soon as it has read them, before it
indexes its tasks (:func:`check_before_tasks`); when ``lm_eval.evaluator`` is, ``simple_evaluate`` checks them
before the model loads (:func:`check_limit`).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from types import ModuleType
from typing import Any, Callable, Mapping

_TARGET_MODULE = "lm_eval.api.registry"
_TASKS_MODULE = "lm_eval.tasks.manager"
_TRACKER_MODULE = "lm_eval.loggers.evaluation_tracker"
_EVALUATOR_MODULE = "lm_eval.evaluator"
_CONFIG_MODULE = "lm_eval.config.evaluate_config"


def register(registry_module) -> None:
    """Register ``distperp`` in lm-eval's model registry (idempotent)."""
    import lm_eval.models  # noqa: F401 - registers the built-in models, lazily

    from distperp_harness import MODEL_NAME, MODEL_TARGET

    registry = registry_module.model_registry
    if MODEL_NAME not in registry:
        registry.register(MODEL_NAME, target=MODEL_TARGET)


class _AfterExecLoader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader, after: Callable[[ModuleType], None]) -> None:
        self._inner, self._after = inner, after

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module) -> None:
        self._inner.exec_module(module)
        self._after(module)


class AfterImportFinder(importlib.abc.MetaPathFinder):
    """Lets module ``fullname`` be found and loaded by the finders behind it, then calls ``after(module)``."""

    def __init__(self, fullname: str, after: Callable[[ModuleType], None]) -> None:
        self.fullname, self.after = fullname, after

    def find_spec(self, fullname, path, target=None):
        if fullname != self.fullname:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _AfterExecLoader(spec.loader, self.after)
                return spec
        return None


def after_import(fullname: str, after: Callable[[ModuleType], None]) -> None:
    """Call ``after(module)`` on module ``fullname``: now if it is loaded, else once it is first imported
    (idempotent for one ``(fullname, after)`` pair). Stdlib only: safe at interpreter start-up."""
    if fullname in sys.modules:
        after(sys.modules[fullname])
    elif not any(
        isinstance(f, AfterImportFinder) and f.fullname == fullname and f.after is after for f in sys.meta_path
    ):
        sys.meta_path.insert(0, AfterImportFinder(fullname, after))


def add_tasks(manager_module) -> None:
    """Make ``manager_module.TaskManager`` index distperp's task folder whenever it indexes lm-eval's built-in
    tasks (``include_defaults``), after them and before the caller's ``include_path`` (which may override a task);
    not twice when the caller names the folder itself. Idempotent."""
    import functools
    import inspect
    from pathlib import Path

    from distperp_harness.errors import install_excepthook

    install_excepthook()  # an lm-eval run: distperp's input errors print as one line (stdlib only, cheap)
    cls = manager_module.TaskManager
    original = cls.__init__
    if getattr(original, "_distperp", False):
        return
    signature = inspect.signature(original)

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        if bound.arguments.get("include_defaults", True):
            try:
                from distperp_harness.commands.taskdir import tasks_path

                ours = tasks_path().resolve()
            except (FileNotFoundError, ImportError):
                ours = None
            given = bound.arguments.get("include_path")
            paths = list(given) if isinstance(given, (list, tuple)) else [] if given is None else [given]
            if ours is not None and all(Path(p).resolve() != ours for p in paths):
                bound.arguments["include_path"] = [ours, *paths]
        original(*bound.args, **bound.kwargs)

    __init__._distperp = True  # type: ignore[attr-defined]
    cls.__init__ = __init__


def guard_outputs(tracker_module) -> None:
    """Make lm-eval's ``EvaluationTracker`` check ``--output_path`` when it is made, write its results and samples
    whole or not at all, and never lose results at the end (:mod:`distperp_harness.report.outputs`). Idempotent."""
    import functools

    cls = tracker_module.EvaluationTracker
    if getattr(cls.save_results_aggregated, "_distperp", False):
        return
    init, save, save_samples = cls.__init__, cls.save_results_aggregated, cls.save_results_samples

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        from distperp_harness.report.outputs import check_writable

        init(self, *args, **kwargs)
        check_writable(getattr(self, "output_path", None))

    @functools.wraps(save)
    def save_results_aggregated(self, results, *args, **kwargs):
        from distperp_harness.report.outputs import save_or_fall_back

        save_or_fall_back(save, self, results, *args, **kwargs)

    @functools.wraps(save_samples)
    def save_results_samples(self, task_name, *args, **kwargs):
        from distperp_harness.report.outputs import save_samples_or_fail

        save_samples_or_fail(save_samples, self, task_name, *args, **kwargs)

    save_results_aggregated._distperp = True  # type: ignore[attr-defined]
    cls.__init__, cls.save_results_aggregated = __init__, save_results_aggregated
    cls.save_results_samples = save_results_samples


_PLAIN = (str, int, float, bool, type(None), dict, list)


def check_run(model_args: Any, cli: dict, *, tasks: Any, metadata: Any, use_cache: Any, limit: Any) -> None:
    """Refuse a ``--model distperp`` run whose command line cannot work
    (:func:`distperp_harness.options.check_command_line`: every ``--model_args`` key and value, the group sizes
    against the launch, ``--use_cache`` on several processes, ``--limit``, the distperp tasks' ``--metadata``
    keys) as one :class:`~distperp_harness.errors.OptionError` line (rank 0), before lm-eval indexes its tasks or
    loads a model. ``model_args``: lm-eval's dict or ``k=v,...`` string; one holding objects (an in-memory model)
    is left to the model's own checks, only ``--limit`` is checked then."""
    from distperp_harness.errors import install_excepthook
    from distperp_harness.options import check_command_line, limit_error

    install_excepthook()  # the error is one line even before lm-eval's task manager loads
    if isinstance(model_args, str):
        from lm_eval.utils import simple_parse_args_string

        model_args = simple_parse_args_string(model_args)
    names = [t for t in tasks if isinstance(t, str)] if isinstance(tasks, (list, tuple)) else tasks
    if isinstance(model_args, dict) and all(isinstance(v, _PLAIN) for v in model_args.values()):
        check_command_line(
            model_args, cli, tasks=names, metadata=metadata, use_cache=use_cache, limit=limit
        )  # fmt: skip
        return
    message = limit_error(limit)
    if message is not None:
        from distperp_harness.errors import OptionError

        raise OptionError(message)


def check_before_tasks(config_module) -> None:
    """Make lm-eval's command line check a ``--model distperp`` run (:func:`check_run`) as soon as it has read its
    arguments (``EvaluatorConfig.from_cli``, before it imports its evaluator, ~1.8 s, and indexes its tasks, 15-25 s,
    and long before the model is made). Idempotent."""
    import functools

    cls = config_module.EvaluatorConfig
    original = cls.from_cli.__func__
    if getattr(original, "_distperp", False):
        return

    @functools.wraps(original)
    def from_cli(klass, namespace):
        config = original(klass, namespace)
        if getattr(config, "model", None) == "distperp":
            cli = {k: getattr(config, k, None) for k in ("batch_size", "max_batch_size", "device")}
            check_run(
                config.model_args or {}, cli, tasks=config.tasks, metadata=config.metadata,
                use_cache=config.use_cache, limit=config.limit,
            )  # fmt: skip
        return config

    from_cli._distperp = True  # type: ignore[attr-defined]
    cls.from_cli = classmethod(from_cli)


def check_limit(evaluator_module) -> None:
    """Make lm-eval's ``simple_evaluate`` check a ``distperp`` run (:func:`check_run`) before the model loads when
    the model is named ``distperp``; with a ``DistPerpLM`` given, its ``limit`` alone. Other models are left to
    lm-eval. Idempotent."""
    import functools
    import inspect

    original = evaluator_module.simple_evaluate
    if getattr(original, "_distperp", False):
        return
    signature = inspect.signature(original)

    @functools.wraps(original)
    def simple_evaluate(*args, **kwargs):
        given = signature.bind_partial(*args, **kwargs).arguments
        model = given.get("model")
        if model == "distperp":
            cli = {k: given.get(k) for k in ("batch_size", "max_batch_size", "device")}
            check_run(
                given.get("model_args") or {}, cli, tasks=given.get("tasks") or (), metadata=given.get("metadata"),
                use_cache=given.get("use_cache"), limit=given.get("limit"),
            )  # fmt: skip
        elif type(model).__module__.startswith("distperp_harness."):
            check_run(None, {}, tasks=(), metadata=None, use_cache=None, limit=given.get("limit"))
        return original(*args, **kwargs)

    simple_evaluate._distperp = True  # type: ignore[attr-defined]
    evaluator_module.simple_evaluate = simple_evaluate


CPP_LOG_ENV = "TORCH_CPP_LOG_LEVEL"


def launched_distperp_worker(argv: list[str], environ: Mapping[str, str]) -> bool:
    """True for a rank a launcher started (``accelerate launch``, ``torchrun``: ``TORCHELASTIC_RUN_ID`` or
    ``LOCAL_RANK`` set) to run lm-eval (``-m lm_eval``, the ``lm_eval``/``lm-eval`` command) with ``--model
    distperp``; ``argv`` is the interpreter's whole command line (``sys.orig_argv``)."""
    if "TORCHELASTIC_RUN_ID" not in environ and "LOCAL_RANK" not in environ:
        return False
    words = [w.rsplit("/", 1)[-1] for w in argv]
    runs_lm_eval = "lm_eval" in words or any(w in ("lm_eval", "lm-eval") for w in words[1:2])
    model = next((argv[i + 1] for i, w in enumerate(argv[:-1]) if w == "--model"), None)
    model = model or next((w.split("=", 1)[1] for w in argv if w.startswith("--model=")), None)
    return runs_lm_eval and model == "distperp"


def quiet_cpp_warnings() -> None:
    """In a launched distperp rank (:func:`launched_distperp_worker`), torch's C++ log level defaults to ``ERROR``
    (``TORCH_CPP_LOG_LEVEL``, read once when torch loads, so only here): when a launcher is killed, every failed
    store call of c10d would otherwise log a warning with some 20 C++ frames per rank, where distperp prints one
    line naming the cause. A level the user set is kept (``TORCH_CPP_LOG_LEVEL=WARNING`` shows them)."""
    import os

    if CPP_LOG_ENV not in os.environ and launched_distperp_worker(list(getattr(sys, "orig_argv", [])), os.environ):
        os.environ[CPP_LOG_ENV] = "ERROR"


def install() -> None:
    """Register ``distperp`` once lm-eval's registry is loaded, its tasks once lm-eval's task manager is, the
    output checks once its evaluation tracker is, and the argument checks once its evaluator and its command line's
    configuration are (at once where they already are)."""
    quiet_cpp_warnings()
    after_import(_TARGET_MODULE, register)
    after_import(_TASKS_MODULE, add_tasks)
    after_import(_TRACKER_MODULE, guard_outputs)
    after_import(_EVALUATOR_MODULE, check_limit)
    after_import(_CONFIG_MODULE, check_before_tasks)


install()
