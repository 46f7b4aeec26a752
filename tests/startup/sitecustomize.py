"""Start-up hook of the test suite's Python processes (conftest puts this folder on ``PYTHONPATH``).

lm-eval's ``TaskManager`` indexes its ~14,700 built-in task YAMLs in every process it is built in: about 8 s of
one core per rank, once per ``lm_eval`` launch, and the suite starts over a hundred such processes. The tests use
only their own tasks and distperp's, so they index lm-eval's built-in folder once (conftest calls
:func:`activate`: a pickle named by ``DISTPERP_TESTS_LM_EVAL_INDEX``, rebuilt whenever lm-eval's files change) and
every process loads that instead of parsing the YAMLs again. Other folders (``--include_path``) are indexed as
lm-eval does; the merge of folders follows ``TaskIndex.build`` (later folders override earlier ones, with
lm-eval's warning). Without the variable nothing is installed. The package under test is untouched: this is
the tests' harness, not distperp's.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import pickle
import sys
from pathlib import Path

ENV = "DISTPERP_TESTS_LM_EVAL_INDEX"
_MODULE = "lm_eval.tasks._index"


def defaults_root() -> Path:
    """lm-eval's built-in task folder, spelled as ``TaskManager`` spells it (``Path(manager.__file__).parent``,
    not resolved: the entries' ``yaml_path`` must be lm-eval's own)."""
    spec = importlib.util.find_spec("lm_eval.tasks")
    return Path(spec.origin).parent


def patch(module, cache: Path) -> None:
    """Make ``module.TaskIndex.build`` take lm-eval's built-in folder's index from ``cache`` (if it is patched
    already, only the cache changes). The patched function keeps ``original`` (lm-eval's) and counts the folders
    it served from the cache in ``hits``."""
    current = module.TaskIndex.build
    if hasattr(current, "original"):
        current.cache = cache
        return
    original = current
    root_of_defaults = defaults_root().resolve()
    log = logging.getLogger(module.__name__)

    def build(paths, *, resolve_includes=True):
        index = {}
        for root in paths:
            if resolve_includes and Path(root).resolve() == root_of_defaults:
                with open(build.cache, "rb") as f:
                    part = pickle.load(f)
                build.hits += 1
            else:
                part = original([root], resolve_includes=resolve_includes)
            for name, entry in part.items():
                if name in index:
                    log.warning(
                        "Task '%s' from %s overrides existing task from %s",
                        name,
                        entry.yaml_path,
                        index[name].yaml_path,
                    )
                index[name] = entry
        return index

    build.original, build.cache, build.hits = original, cache, 0
    module.TaskIndex.build = staticmethod(build)


def install(cache: Path) -> None:
    """Patch now if lm-eval's index module is loaded, else when it is first imported (distperp's own
    after-import finder, the one that registers ``--model distperp``)."""
    from distperp_harness._hook import after_import

    after_import(_MODULE, functools.partial(patch, cache=cache))


def cache_path() -> Path:
    """The pickle of lm-eval's built-in index, built now if missing. It lives in a folder of this user's (mode
    0700), keyed by every built-in YAML's path, size and mtime (lm-eval's own walk), lm-eval's indexing code and
    PyYAML's version: any change builds anew. Built with lm-eval's own ``TaskIndex.build`` even when patched."""
    import yaml
    from lm_eval.tasks import _index, _yaml_loader

    root = defaults_root()
    key = hashlib.sha256(f"{root}|{yaml.__version__}".encode())
    for path in [*_index.TaskIndex._iter_yaml_files(root), Path(_index.__file__), Path(_yaml_loader.__file__)]:
        stat = path.stat()
        key.update(f"|{path}|{stat.st_size}|{stat.st_mtime_ns}".encode())
    folder = Path.home() / ".cache" / "distperp-tests"
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    cache = folder / f"lm-eval-index-{key.hexdigest()[:24]}.pickle"
    if not cache.exists():
        build = getattr(_index.TaskIndex.build, "original", _index.TaskIndex.build)
        part = cache.with_name(f"{cache.name}.{os.getpid()}")
        try:
            part.write_bytes(pickle.dumps(build([root]), protocol=pickle.HIGHEST_PROTOCOL))
            os.replace(part, cache)
        finally:
            part.unlink(missing_ok=True)
    return cache


def activate() -> None:
    """Build the cache if needed, name it and this folder in the environment every subprocess inherits
    (``DISTPERP_TESTS_LM_EVAL_INDEX``, ``PYTHONPATH`` first), and patch this process."""
    cache, here = cache_path(), str(Path(__file__).resolve().parent)
    os.environ[ENV] = str(cache)
    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and os.path.abspath(p) != here]
    os.environ["PYTHONPATH"] = os.pathsep.join([here, *inherited])
    install(cache)


def _chain_next_sitecustomize() -> None:
    """Run the ``sitecustomize`` this one shadows, if the interpreter has one further down ``sys.path``."""
    here = str(Path(__file__).resolve().parent)
    rest = [p for p in sys.path if p and str(Path(p).resolve()) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


if __name__ == "sitecustomize":  # run by the interpreter at start-up (conftest loads it under another name)
    _chain_next_sitecustomize()
    if os.environ.get(ENV):
        try:
            install(Path(os.environ[ENV]))
        except Exception as exc:  # the process still runs, parsing lm-eval's YAMLs itself
            print(f"tests/startup: lm-eval's task index is not cached here: {exc!r}", file=sys.stderr)
