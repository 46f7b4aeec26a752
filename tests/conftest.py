"""Shared fixtures: a tiny random Llama model built once per session, the packaged sample text and the local
``dptest_*`` lm-eval tasks. Subprocess helpers (offline lm-eval / accelerate runs) live in ``tests/helpers.py``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # `from helpers import ...` under any import mode

from helpers import OFFLINE_ENV, TASKS_DIR, TESTS_DIR  # noqa: E402

STARTUP_DIR = TESTS_DIR / "startup"


def _load_startup():
    import importlib.util

    spec = importlib.util.spec_from_file_location("distperp_tests_startup", STARTUP_DIR / "sitecustomize.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


startup = _load_startup()

for _key, _value in OFFLINE_ENV.items():  # in-process loads are offline too (set before any HF import)
    os.environ.setdefault(_key, _value)


def _index_lm_eval_tasks_once() -> None:
    """Index lm-eval's built-in tasks once and have this process and every subprocess use it (see
    ``tests/startup/sitecustomize.py``). The pickle lives in a folder of this user's (mode 0700), keyed by every
    built-in YAML's path, size and mtime, lm-eval's indexing code and PyYAML's version: any change builds anew."""
    import hashlib
    import pickle

    import yaml
    from lm_eval.tasks import _index, _yaml_loader

    root = startup.defaults_root()
    key = hashlib.sha256(f"{root}|{yaml.__version__}".encode())
    for path in sorted([*root.glob("**/*.yaml"), Path(_index.__file__), Path(_yaml_loader.__file__)]):
        stat = path.stat()
        key.update(f"|{path}|{stat.st_size}|{stat.st_mtime_ns}".encode())
    folder = Path.home() / ".cache" / "distperp-tests"
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    cache = folder / f"lm-eval-index-{key.hexdigest()[:24]}.pickle"
    if not cache.exists():
        build = getattr(_index.TaskIndex.build, "original", _index.TaskIndex.build)  # lm-eval's own
        part = cache.with_name(f"{cache.name}.{os.getpid()}")
        try:
            part.write_bytes(pickle.dumps(build([root]), protocol=pickle.HIGHEST_PROTOCOL))
            os.replace(part, cache)
        finally:
            part.unlink(missing_ok=True)
    os.environ[startup.ENV] = str(cache)
    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                 if p and os.path.abspath(p) != str(STARTUP_DIR)]
    os.environ["PYTHONPATH"] = os.pathsep.join([str(STARTUP_DIR), *inherited])
    startup.install(cache)


_index_lm_eval_tasks_once()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Directory of ``TEST_SPEC`` (random init, no training) built once per session: model + tokenizer."""
    from distperp_harness.commands.tiny import TEST_SPEC, build_tiny_model

    return build_tiny_model(TEST_SPEC, tmp_path_factory.mktemp("tiny_model"))


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir: Path):
    """The tokenizer of :func:`tiny_model_dir` (byte-level BPE, no BOS added, ``model_max_length=128``)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="session")
def sample_text_path() -> Path:
    """The packaged WikiText-formatted sample, ``distperp_harness/data/sample_wikitext.txt``."""
    from distperp_harness.commands.tiny import sample_text_path as path

    return path()


@pytest.fixture(scope="session")
def tasks_dir() -> Path:
    """``tests/tasks``: ``dptest_mc``, ``dptest_mmlu``, ``dptest_fewshot``, ``dptest_random``, ``dptest_rolling``, ``dptest_gen``, ``dptest_chain``, ``dptest_sample`` (pass as ``--include_path``)."""
    return TASKS_DIR
