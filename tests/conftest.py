"""Shared fixtures: a tiny random Llama model built once per session, the packaged sample text and the local
``dptest_*`` lm-eval tasks. Subprocess helpers (offline lm-eval / accelerate runs) live in ``tests/helpers.py``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # `from helpers import ...` under any import mode

from helpers import OFFLINE_ENV, TASKS_DIR, TESTS_DIR

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

startup.activate()  # lm-eval's built-in task index: built once, used by this process and every subprocess


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
    """``tests/tasks``: ``dptest_mc``, ``dptest_mmlu``, ``dptest_fewshot``, ``dptest_random``, ``dptest_rolling``,
    ``dptest_gen``, ``dptest_chain``, ``dptest_sample`` (pass as ``--include_path``)."""
    return TASKS_DIR


_LAUNCHES = (
    "run_command(",
    "run_lm_eval(",
    "accelerate_launch_prefix(",
    "start_two_nodes(",
    "run_two_nodes(",
    "subprocess.",
    "Popen(",
)
"""What starts another process (the helpers' launchers, subprocess): a module using any is a launching module."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test of a module that starts processes gets the ``launches`` marker: ``make test-fast`` deselects them.
    A ``matrix`` test (every registered model type) runs only when asked for (``-m matrix``, ``make test-matrix``)."""
    asked = "matrix" in (config.getoption("markexpr", "") or "")
    sources: dict[Path, bool] = {}
    for item in items:
        if "matrix" in item.keywords and not asked:
            item.add_marker(
                pytest.mark.skip(reason="the registered-type matrix runs with -m matrix (make test-matrix)")
            )
        path = Path(str(item.fspath))
        if path not in sources:
            text = path.read_text(encoding="utf-8")
            sources[path] = any(call in text for call in _LAUNCHES)
        if sources[path]:
            item.add_marker(pytest.mark.launches)


@pytest.fixture(autouse=True)
def _probe_decides_afresh():
    """Each test's probes run their cases: a verdict kept from another test (which may patch the engine) never
    decides for this one."""
    from distperp_harness.run.scoring.engine.probe import forget_decisions

    forget_decisions()
    yield
