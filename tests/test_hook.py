"""Zero-config registration: ``--model distperp`` resolves wherever lm-eval looks, with nothing heavy at start-up."""

import os
import sys
from pathlib import Path

import pytest
from helpers import load_results, run_command, side_by_side


def test_registry_resolves_distperp_and_builtins_without_heavy_startup_imports():
    code = (
        "import sys\n"
        "heavy = sorted(m for m in ('torch', 'transformers', 'lm_eval', 'accelerate') if m in sys.modules)\n"
        "assert not heavy, heavy\n"
        "from lm_eval.api.registry import get_model\n"
        "from distperp_harness.lm import DistPerpLM\n"
        "assert get_model('distperp') is DistPerpLM\n"
        "assert get_model('hf').__name__ == 'HFLM' and get_model('dummy').__name__ == 'DummyLM'\n"
        "print('ok')\n"
    )
    proc = run_command([sys.executable, "-c", code], cwd="/")
    assert proc.stdout.strip().endswith("ok")


def _bin(name: str) -> str:
    return str(Path(sys.executable).with_name(name))


def test_cli_entry_points_run_distperp(tiny_model_dir, tasks_dir, tmp_path):
    common = [
        "--model",
        "distperp",
        "--model_args",
        f"pretrained={tiny_model_dir},max_length=128",
        "--tasks",
        "dptest_rolling",
        "--include_path",
        str(tasks_dir),
        "--limit",
        "2",
    ]
    entries = {
        "module": [sys.executable, "-m", "lm_eval"],
        "lm_eval": [_bin("lm_eval")],
        "lm-eval-run": [_bin("lm-eval"), "run"],
    }
    side_by_side(
        *(
            lambda cmd=cmd, name=name: run_command([*cmd, *common, "--output_path", str(tmp_path / name)], cwd=tmp_path)
            for name, cmd in entries.items()
        )
    )
    for name in entries:
        results = load_results(tmp_path / name)
        assert results["config"]["model"] == "distperp"
        assert "word_perplexity,none" in results["results"]["dptest_rolling"]


def test_simple_evaluate_by_name(tiny_model_dir, tasks_dir):
    import lm_eval
    from lm_eval.tasks import TaskManager

    out = lm_eval.simple_evaluate(
        model="distperp",
        model_args={"pretrained": str(tiny_model_dir), "max_length": 128},
        tasks=["dptest_rolling"],
        task_manager=TaskManager(include_path=str(tasks_dir)),
        limit=2,
    )
    assert out["config"]["distperp"]["world_size"] == 1


def test_distperp_tasks_resolve_without_include_path():
    """Installed, distperp's tasks are in lm-eval's index next to its own: ``--tasks distperp_wikitext2`` needs no
    ``--include_path``; naming the folder anyway indexes it once; without lm-eval's defaults, nothing is added."""
    from lm_eval.tasks import TaskManager

    from distperp_harness.commands.taskdir import tasks_path

    assert {"distperp_wikitext2", "distperp_wikitext103"} <= set(TaskManager().all_tasks)
    named = TaskManager(include_path=str(tasks_path()))
    assert named.include_path == str(tasks_path()) and "distperp_wikitext2" in named.all_tasks
    assert "distperp_wikitext2" not in TaskManager(include_defaults=False).all_tasks


def test_a_limit_of_zero_or_below_is_one_error_before_the_model_loads(tmp_path):
    """``--limit 0`` (or below) selects no document: refused before the model loads (here it does not even exist),
    from the command line as one line; other models are left to lm-eval."""
    import lm_eval
    import pytest
    from lm_eval.evaluator import simple_evaluate

    from distperp_harness.errors import InputError

    assert lm_eval.simple_evaluate is simple_evaluate  # lm-eval's lazy attribute is the checked function
    for limit in (0, 0.0, -1):
        with pytest.raises(InputError, match=f"--limit {limit:g} selects no document.*Fix: e.g. --limit 10"):
            simple_evaluate(model="distperp", model_args=f"pretrained={tmp_path / 'none'}", tasks=["x"], limit=limit)
    cmd = [sys.executable, "-m", "lm_eval", "--model", "distperp", "--model_args", f"pretrained={tmp_path / 'none'}"]
    proc = run_command([*cmd, "--tasks", "distperp_wikitext2", "--limit", "0"], cwd=tmp_path, check=False)
    assert proc.returncode == 1 and "distperp: error: --limit 0 selects no document" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    "argv, environ, expected",
    [
        (["python", "-m", "lm_eval", "--model", "distperp", "--tasks", "x"], {"LOCAL_RANK": "0"}, True),
        (["/venv/bin/lm_eval", "--model=distperp"], {"TORCHELASTIC_RUN_ID": "r"}, True),
        (["python", "-m", "lm_eval", "run", "--model", "distperp"], {"LOCAL_RANK": "1"}, True),
        (["python", "-m", "lm_eval", "--model", "distperp"], {}, False),  # not launched: one process, no store
        (["python", "-m", "lm_eval", "--model", "hf"], {"LOCAL_RANK": "0"}, False),  # another backend
        (["python", "train.py", "--model", "distperp"], {"LOCAL_RANK": "0"}, False),  # not lm-eval
    ],
)
def test_only_launched_distperp_ranks_quiet_cpp_warnings(argv, environ, expected, monkeypatch):
    """torch's C++ warnings (c10d's failed store calls, each with ~20 C++ frames when a launcher is killed) default
    to ERROR in a launched lm-eval rank of --model distperp, and only there; a level the user set is kept."""
    from distperp_harness import _hook

    assert _hook.launched_distperp_worker(argv, environ) is expected
    monkeypatch.setattr(_hook.sys, "orig_argv", argv, raising=False)
    for key in ("LOCAL_RANK", "TORCHELASTIC_RUN_ID", _hook.CPP_LOG_ENV):
        monkeypatch.delenv(key, raising=False)
    for key, value in environ.items():
        monkeypatch.setenv(key, value)
    _hook.quiet_cpp_warnings()
    assert os.environ.get(_hook.CPP_LOG_ENV) == ("ERROR" if expected else None)
    monkeypatch.setenv(_hook.CPP_LOG_ENV, "WARNING")
    _hook.quiet_cpp_warnings()
    assert os.environ[_hook.CPP_LOG_ENV] == "WARNING"
