"""The first hour outside the checkout: the package built as a wheel, installed into a fresh virtual environment,
then used from an empty folder as the README says (the first command, a bad input, ``compare``)."""

import json
import os
import shutil
import sys
import sysconfig
from pathlib import Path

from helpers import REPO_ROOT, TESTS_DIR, run_command, side_by_side

# Nothing of the checkout on the path, only the tests' start-up hook (lm-eval's built-in task index, cached: see
# tests/startup), which imports no distperp code
ENV = {"PYTHONPATH": str(TESTS_DIR / "startup")}


def _run(cmd, cwd, check=True):
    return run_command(cmd, cwd=cwd, env=ENV, check=check)


def _fresh_venv(root: Path) -> Path:
    """A virtual environment with the wheel installed (no pip of its own); its dependencies, which this machine
    cannot download, come from the test environment's site-packages through a path file (a path line: that
    folder's own ``.pth`` files, the checkout's editable install among them, are not run)."""
    wheels = root / "wheels"
    _run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", wheels, REPO_ROOT],
        cwd=root,
    )
    venv = root / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", venv], cwd=root)
    python = venv / "bin" / "python"
    purelib = _run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=root).stdout
    (Path(purelib.strip()) / "_test_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            python,
            "install",
            "--no-deps",
            "--no-index",
            "-q",
            *wheels.glob("distperp_harness-*.whl"),
        ],
        cwd=root,
    )
    return venv


def test_installed_from_a_wheel_the_readme_runs_from_an_empty_folder(tmp_path):
    _, venv = side_by_side(  # the demo model (cached, ~40 s the first time) builds while pip works
        lambda: _run([sys.executable, "-m", "distperp_harness", "demo-model"], tmp_path), lambda: _fresh_venv(tmp_path)
    )
    python, distperp = venv / "bin" / "python", venv / "bin" / "distperp"
    here = tmp_path / "first"
    here.mkdir()
    where = _run([python, "-c", "import distperp_harness; print(distperp_harness.__file__)"], cwd=here).stdout
    assert Path(where.strip()).is_relative_to(venv), where  # the wheel's copy, not the checkout

    model = _run([distperp, "demo-model"], cwd=here).stdout.strip()  # the README's $(distperp demo-model)
    assert (Path(model) / "config.json").exists(), model
    lm_eval = [python, "-m", "lm_eval"]  # the `lm_eval` script's module (its script lives with lm-eval's install)
    sample = ["--tasks", "distperp_wikitext2", "--metadata", json.dumps({"wikitext_path": "sample"})]
    first = [
        *lm_eval,
        "--model",
        "distperp",
        "--model_args",
        f"pretrained={model}",
        *sample,
        "--output_path",
        "results/",
    ]
    bad = [*lm_eval, "--model", "distperp", "--model_args", f"pretrained={model},quantize=int5", *sample]
    hf = [
        *lm_eval,
        "--model",
        "hf",
        "--model_args",
        f"pretrained={model}",
        "--device",
        "cpu",
        *sample,
        "--output_path",
        "results_hf/",
    ]
    ours, refused, theirs = side_by_side(
        lambda: _run(first, here), lambda: _run(bad, here, check=False), lambda: _run(hf, here)
    )

    assert list((here / "results").rglob("results_*.json")), ours.stderr[-3000:]
    assert refused.returncode == 1 and "Traceback" not in refused.stderr, refused.stderr[-3000:]
    errors = [line for line in refused.stderr.splitlines() if line.startswith("distperp: error")]
    assert errors == [
        "distperp: error: quantize='int5' is not valid for --model distperp; allowed: one of none, "
        "int4, int8, 8da4w. Fix: e.g. quantize=int4,group_size=128."
    ], refused.stderr[-3000:]

    table = _run([distperp, "compare", "results/", "results_hf/"], cwd=here).stdout.splitlines()
    name = Path(model).name
    rows = [line.split(" | ") for line in table if line.startswith(f"| {name} |")]
    assert [(row[1], row[2], row[3]) for row in rows] == [
        ("none", "1", "distperp_wikitext2"),
        ("hf", "1", "distperp_wikitext2"),
    ], table
    missing = _run([distperp, "compare", "nowhere/"], cwd=here, check=False)
    assert missing.returncode == 1 and missing.stderr.strip().splitlines() == [
        "distperp: error: nowhere: no such results file or folder. Fix: give a results_*.json file or a folder "
        "lm-eval wrote with --output_path"
    ], missing.stderr
    assert os.listdir(here) and not (here / "distperp_harness").exists()

    # nothing lost, nothing silent: an output folder that cannot be written (a file in the way) and a misspelled
    # --metadata key are one line each before any model loads; a task of one's own from `distperp new-task` runs
    # from this folder and gives the shipped task's results on the same documents
    (here / "blocked").write_text("a file, not a folder")
    docs = here / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text(Path(where.strip()).parent.joinpath("data", "sample_wikitext.txt").read_text())
    _run([distperp, "new-task", "mine", "--data", "docs", "--out", "mytasks"], cwd=here)
    shadow = _run([distperp, "new-task", "hellaswag", "--data", "docs", "--out", "mytasks"], cwd=here, check=False)
    said = [line for line in shadow.stderr.splitlines() if line.startswith("distperp: error")]
    assert shadow.returncode == 1 and len(said) == 1 and "already one of lm-eval's tasks" in said[0], shadow.stderr
    assert not (here / "mytasks" / "hellaswag.yaml").exists()  # lm-eval's hellaswag is not silently replaced
    plain = [*lm_eval, "--model", "distperp", "--model_args", f"pretrained={model}"]
    unwritable = [*plain, *sample, "--output_path", "blocked/results"]
    typo = [*plain, "--tasks", "distperp_wikitext2", "--metadata", json.dumps({"wikitext_pth": "sample"})]
    mine = [*plain, "--tasks", "mine", "--include_path", "mytasks", "--output_path", "mine/"]
    shipped = [*plain, "--tasks", "distperp_local_docs", "--metadata", json.dumps({"docs_path": "docs"})]
    # broken parts, each one line when it loads (tests/model/test_parts.py has every case): a checkpoint cut short,
    # a model folder without its tokenizer files; and a misspelled task name, answered from the wheel's task folder
    damaged, untokenized = Path(shutil.copytree(model, here / "damaged")), Path(shutil.copytree(model, here / "bare"))
    weights = damaged / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (untokenized / name).unlink()
    broken = [*lm_eval, "--model", "distperp", *sample, "--model_args"]
    blocked, misspelled, cut, bare, task, _, _ = side_by_side(
        lambda: _run(unwritable, here, check=False),
        lambda: _run(typo, here, check=False),
        lambda: _run([*broken, "pretrained=damaged"], here, check=False),
        lambda: _run([*broken, "pretrained=bare"], here, check=False),
        lambda: _run([*plain, "--tasks", "distperp_wikitxt2"], here, check=False),
        lambda: _run(mine, here),
        lambda: _run([*shipped, "--output_path", "shipped/"], here),
    )
    assert task.returncode == 1 and "distperp: did you mean 'distperp_wikitext2'" in task.stderr, task.stderr[-3000:]
    for run, fragment in (
        (blocked, "--output_path 'blocked/results'"),
        (misspelled, "Did you mean 'wikitext_path'"),
        (cut, f"the weight file {weights.relative_to(here)} is damaged"),
        (bare, "pretrained='bare': no tokenizer files in bare"),
    ):
        said = [line for line in run.stderr.splitlines() if line.startswith("distperp: error")]
        assert run.returncode == 1 and len(said) == 1 and fragment in said[0], run.stderr[-3000:]
        assert "Traceback" not in run.stderr and "loglikelihood_rolling" not in run.stderr, run.stderr[-3000:]
    ours = json.loads(next((here / "mine").rglob("results_*.json")).read_text())["results"]["mine"]
    theirs = json.loads(next((here / "shipped").rglob("results_*.json")).read_text())["results"]["distperp_local_docs"]
    assert ours["token_perplexity,none"] == theirs["token_perplexity,none"] and ours["n_tokens,none"] > 0
