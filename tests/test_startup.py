"""The suite's start-up hook (tests/startup/sitecustomize.py) indexes lm-eval's tasks as lm-eval does."""

import json
import sys

from helpers import run_command


def test_cached_index_equals_lm_evals_own(tasks_dir):
    import distperp_tests_startup as startup
    from lm_eval.tasks._index import TaskIndex

    root = startup.defaults_root()
    assert hasattr(TaskIndex.build, "original")  # conftest patched this process
    cached = TaskIndex.build([root, tasks_dir])
    fresh = TaskIndex.build.original([root, tasks_dir])  # lm-eval's own, parsing every YAML
    assert list(cached) == list(fresh) and "dptest_mc" in cached and "gsm8k_cot" in cached
    assert cached == fresh  # every Entry: name, kind, path, config, tags


def test_subprocesses_use_it():
    code = (
        "import json; from lm_eval.tasks import TaskManager; from lm_eval.tasks._index import TaskIndex; "
        "tasks = TaskManager().all_tasks; print(json.dumps([TaskIndex.build.hits, 'gsm8k_cot' in tasks]))"
    )
    out = run_command([sys.executable, "-c", code]).stdout
    assert json.loads(out.strip().splitlines()[-1]) == [1, True]  # the built-ins came from the cache, once
