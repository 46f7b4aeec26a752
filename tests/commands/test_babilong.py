"""``distperp babilong-local``: lm-eval's own babilong tasks run offline on a local copy of their dataset (the hub
repository's ``<length>/qaN-*.parquet`` layout), with lm-eval's instructions, few-shot examples and scoring; folders
without those files, and lengths not there, are refused in one line with the fix."""

from __future__ import annotations

import json
import sys

import pytest
from helpers import run_command

from distperp_harness.commands.babilong import GROUP, load_local, write_tasks
from distperp_harness.errors import InputError, MissingInput

ROWS = {
    "qa1": [
        ("Mary went to the kitchen. John travelled to the garden.", "Where is Mary?", "kitchen"),
        ("Sandra moved to the office. Mary went to the hallway.", "Where is Sandra?", "office"),
        ("John journeyed to the bathroom.", "Where is John?", "bathroom"),
    ],
    "qa2": [("Mary got the football there. Mary went to the kitchen.", "Where is the football?", "kitchen")],
}


@pytest.fixture
def babilong_dir(tmp_path):
    """A folder in the hub repository's layout: ``4k/qa1-00000-of-00001.parquet`` and ``4k/qa2-...``."""
    import datasets

    root = tmp_path / "babilong"
    for qa, rows in ROWS.items():
        (root / "4k").mkdir(parents=True, exist_ok=True)
        columns = {"input": [r[0] for r in rows], "question": [r[1] for r in rows], "target": [r[2] for r in rows]}
        datasets.Dataset.from_dict(columns).to_parquet(str(root / "4k" / f"{qa}-00000-of-00001.parquet"))
    return root


def test_the_tasks_are_written_for_the_splits_found_and_refused_where_nothing_is(babilong_dir, tmp_path):
    written = write_tasks(str(babilong_dir), str(tmp_path / "tasks"))
    assert sorted(p.name for p in written) == [f"{GROUP}.yaml", f"{GROUP}_qa1.yaml", f"{GROUP}_qa2.yaml"]
    text = (tmp_path / "tasks" / f"{GROUP}_qa1.yaml").read_text()
    assert "babilong/babilong_qa1.yaml" in text and "load_local" in text and str(babilong_dir) in text
    with pytest.raises(InputError, match="already exists"):
        write_tasks(str(babilong_dir), str(tmp_path / "tasks"))
    assert write_tasks(str(babilong_dir), str(tmp_path / "tasks"), force=True)
    (tmp_path / "empty").mkdir()
    with pytest.raises(InputError, match="holds no <length>/qaN-\\*.parquet files"):
        write_tasks(str(tmp_path / "empty"), str(tmp_path / "t2"))
    with pytest.raises(MissingInput, match="no such folder"):
        write_tasks(str(tmp_path / "nope"), str(tmp_path / "t2"))
    with pytest.raises(MissingInput, match=r"no 8k/qa1-\*.parquet under .* \(lengths there for qa1: \[.4k.\]\)"):
        load_local(str(babilong_dir), "qa1", "8k")
    assert len(load_local(str(babilong_dir), "qa1", "4k")["qa1"]) == 3


def test_lm_evals_babilong_runs_offline_from_the_written_tasks(babilong_dir, tiny_model_dir, tmp_path):
    """The written group through ``--model distperp`` at ``max_seq_lengths=4k``: every document of both splits
    scored with lm-eval's ``acc``, the prompt lm-eval's (its qa1 instruction and few-shot examples, then ours)."""
    from helpers import load_results, load_samples

    run_command(
        [sys.executable, "-m", "distperp_harness", "babilong-local", "--data", str(babilong_dir), "--out", "tasks"],
        cwd=tmp_path,
    )
    out = tmp_path / "out"
    args = ["-m", "lm_eval", "--model", "distperp", "--model_args", f"pretrained={tiny_model_dir}"]
    args += ["--tasks", GROUP, "--include_path", "tasks", "--metadata", json.dumps({"max_seq_lengths": "4k"})]
    run_command([sys.executable, *args, "--output_path", str(out), "--log_samples"], cwd=tmp_path, timeout=600)
    results = load_results(out)["results"]
    for qa, rows in ROWS.items():
        assert 0 <= results[f"{GROUP}_{qa}"]["acc,none"] <= 1
        samples = load_samples(out, f"{GROUP}_{qa}")
        assert len(samples) == len(rows)
    prompt = load_samples(out, f"{GROUP}_qa1")[0]["arguments"]["gen_args_0"]["arg_0"]
    assert prompt.startswith("I will give you context with the facts about positions of different persons")
    assert "Where is Charlie?" in prompt and "Where is Mary?" in prompt  # lm-eval's few-shot, then the document
