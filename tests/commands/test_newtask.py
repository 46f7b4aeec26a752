"""``distperp new-task``: a task YAML written into the user's own folder runs there with ``--include_path``, on 1 and
2 processes, with the same results as the shipped ``distperp_local_docs`` on the same documents."""

from __future__ import annotations

import json
import sys

import pytest
from helpers import accelerate_launch_prefix, load_results, run_command, side_by_side

from distperp_harness.commands.newtask import write_task
from distperp_harness.errors import InputError, MissingInput

METRICS = ("token_perplexity,none", "word_perplexity,none", "bits_per_byte,none", "n_tokens,none")


def test_bad_names_and_missing_data_are_refused(tmp_path):
    with pytest.raises(InputError, match="task name 'distperp_x' is not valid"):
        write_task("distperp_x", str(tmp_path))
    with pytest.raises(InputError, match="task name '1abc' is not valid"):
        write_task("1abc", str(tmp_path))
    with pytest.raises(MissingInput, match="no such file or folder"):
        write_task("mine", str(tmp_path / "nope"))


def test_a_written_task_runs_from_its_own_folder_on_one_and_two_processes(tiny_model_dir, sample_text_path, tmp_path):
    docs = tmp_path / "my documents"
    docs.mkdir()
    text = sample_text_path.read_text(encoding="utf-8")
    (docs / "a.txt").write_text(text[:3000], encoding="utf-8")
    (docs / "b.txt").write_text(text[3000:6000], encoding="utf-8")
    work = tmp_path / "empty"
    work.mkdir()
    run_command(
        [sys.executable, "-m", "distperp_harness", "new-task", "my_docs", "--data", str(docs), "--out", "mytasks"],
        cwd=work,
    )
    common = ["-m", "lm_eval", "--model", "distperp", "--model_args", f"pretrained={tiny_model_dir},max_length=128"]

    def run(prefix, tasks, out, extra=()):
        return run_command([*prefix, *common, "--tasks", tasks, "--output_path", out, *extra], cwd=work)

    mine = ["--include_path", "mytasks"]
    shipped = ["--metadata", json.dumps({"docs_path": str(docs)})]
    side_by_side(
        lambda: run([sys.executable], "my_docs", "one", mine),
        lambda: run([sys.executable], "distperp_local_docs", "shipped", shipped),
    )
    run(accelerate_launch_prefix(2), "my_docs", "two", mine)
    ours = load_results(work / "one")["results"]["my_docs"]
    assert ours["n_tokens,none"] > 0
    for other, task in (("shipped", "distperp_local_docs"), ("two", "my_docs")):
        theirs = load_results(work / other)["results"][task]
        assert [theirs[m] for m in METRICS] == [ours[m] for m in METRICS], (other, theirs, ours)
