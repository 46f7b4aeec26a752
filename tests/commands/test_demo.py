"""demo: its figure lands where the user stands (or in --out), its exit code says whether 1 and N processes gave the
same bits; the runs are faked (fixed results files), the demo's three launches are the user's wait, not the tests'."""

import json
from pathlib import Path

import pytest
from helpers import write_results_json

from distperp_harness.commands import demo, tiny


@pytest.fixture
def faked(monkeypatch, tmp_path):
    """The demo with its model and launches replaced: each launch writes a results file and a samples file whose
    documents' values are ``values[processes]``."""
    values = {1: [-10.5, -20.25], 2: [-10.5, -20.25]}
    monkeypatch.setattr(tiny, "cached_tiny_model", lambda spec: tmp_path / "model")

    def launch(processes, model_args, out, sample):
        path = write_results_json(out, results={demo.TASK: {"word_perplexity,none": 3.0}})
        with open(out / f"samples_{demo.TASK}_{path.stem.removeprefix('results_')}.jsonl", "w") as f:
            for doc, value in enumerate(values[processes]):
                f.write(json.dumps({"doc_id": doc, "resps": [[str(value)]], "token_perplexity": [value, 10]}) + "\n")
        return 1.0

    monkeypatch.setattr(demo, "_launch", launch)
    return values


def test_the_demo_writes_its_figure_in_the_current_folder_or_out(faked, tmp_path, monkeypatch, capsys):
    pytest.importorskip("matplotlib")
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    assert demo.run_demo() == 0
    said = capsys.readouterr().out
    assert (here / "compare.png").exists() and f"compare: figure {here / 'compare.png'}" not in said
    assert f"demo: figure {here / 'compare.png'}" in said and "IDENTICAL" in said
    out = tmp_path / "out"
    assert demo.run_demo(out=str(out)) == 0
    assert (out / "compare.png").exists() and sorted(p.name for p in out.iterdir() if p.is_dir()) == [
        "run0", "run1", "run2"
    ]  # fmt: skip


def test_a_demo_whose_processes_disagree_exits_3(faked, tmp_path, monkeypatch, capsys):
    faked[2] = [-10.5, -20.250000000000004]
    monkeypatch.chdir(tmp_path)
    assert demo.run_demo() == 3
    assert "DIFFERENT" in capsys.readouterr().out


def test_demo_model_says_on_stderr_that_it_builds_and_how_long_it_took(monkeypatch, tmp_path, capsys):
    """``$(distperp demo-model)`` reads stdout: the folder alone; a first build says so on stderr (it takes about
    a minute on 2 cores), a cached one says nothing."""
    from distperp_harness.commands.cli import main

    monkeypatch.setenv("DISTPERP_CACHE", str(tmp_path))
    built = tmp_path / "models" / tiny.spec_key(tiny.DEMO_SPEC)

    def build(spec, out, text=None):
        Path(out, "config.json").write_text("{}")
        return Path(out)

    monkeypatch.setattr(tiny, "build_tiny_model", build)
    assert main(["demo-model"]) == 0
    said = capsys.readouterr()
    assert said.out == f"{built}\n"
    assert (
        said.err.splitlines()[0]
        == f"distperp demo-model: building the demo model once ({tiny.DEMO_BUILD}); then cached"
    )
    assert said.err.splitlines()[1].startswith("distperp demo-model: built in ")
    assert main(["demo-model"]) == 0
    assert capsys.readouterr() == (f"{built}\n", "")
