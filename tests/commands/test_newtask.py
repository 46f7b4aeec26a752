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


@pytest.fixture
def no_lm_eval_index(monkeypatch):
    """lm-eval's own names, without building its index (seconds): the tests that need it build it."""
    from distperp_harness.commands import newtask

    monkeypatch.setattr(newtask, "known_task_names", lambda: {"hellaswag", "mmlu"}, raising=False)


def _docs(folder, **files: bytes):
    folder.mkdir(exist_ok=True)
    for name, body in files.items():
        (folder / name).write_bytes(body)
    return folder


def test_a_name_lm_eval_already_has_is_refused_with_the_fix(tmp_path):
    docs = _docs(tmp_path / "docs", **{"a.txt": b"hello"})
    with pytest.raises(InputError, match="'hellaswag' is already one of lm-eval's tasks.*pick another name"):
        write_task("hellaswag", str(docs), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_an_existing_task_file_needs_force_and_an_out_file_is_refused(tmp_path, no_lm_eval_index):
    docs = _docs(tmp_path / "docs", **{"a.txt": b"hello"})
    out = tmp_path / "out"
    written = write_task("mine", str(docs), str(out))
    written.write_text("edited", encoding="utf-8")
    with pytest.raises(InputError, match=r"mine\.yaml already exists.*--force"):
        write_task("mine", str(docs), str(out))
    assert written.read_text(encoding="utf-8") == "edited"
    assert write_task("mine", str(docs), str(out), force=True) == written and "task: mine" in written.read_text()
    with pytest.raises(InputError, match=r"--out '.*mine\.yaml' is a file"):
        write_task("other", str(docs), str(written))


def test_the_cli_takes_force_and_prints_one_error_line(tmp_path, no_lm_eval_index, capsys):
    from distperp_harness.commands.cli import main

    docs = _docs(tmp_path / "docs", **{"a.txt": b"hello"})
    args = ["new-task", "mine", "--data", str(docs), "--out", str(tmp_path)]
    assert main(args) == 0
    with pytest.raises(InputError, match="already exists"):
        main(args)
    assert main([*args, "--force"]) == 0


@pytest.mark.parametrize(
    ("files", "bad"),
    [
        ({"a.txt": b"fine", "b.txt": b"one\ntwo \xe9t\xe9\n"}, r"b\.txt:2 is not UTF-8"),
        ({"a.jsonl": b'{"text": "x"}\n\n{"text": "caf\xe9"}\n'}, r"a\.jsonl:3 is not UTF-8"),
        ({"a.jsonl": b'{"text": "x"}\n{"text": 1}\n'}, r'a\.jsonl:2 has no string field "text"'),
        ({"a.jsonl": b'{"text": "x"}\nnot json\n'}, r"a\.jsonl:2 is not valid JSON"),
        ({"a.csv": b"x"}, "holds no .txt or .jsonl files"),
    ],
)
def test_data_files_are_checked_when_the_task_is_written(tmp_path, no_lm_eval_index, files, bad):
    docs = _docs(tmp_path / "docs", **files)
    with pytest.raises(InputError, match=bad):
        write_task("mine", str(docs), str(tmp_path / "out"))
    assert not (tmp_path / "out" / "mine.yaml").exists()


def test_metadata_docs_path_overrides_the_written_one(tmp_path, no_lm_eval_index):
    from lm_eval.tasks import TaskManager

    written = write_task("mine", str(_docs(tmp_path / "docs", **{"a.txt": b"written documents"})), str(tmp_path))
    other = _docs(tmp_path / "other", **{"b.txt": b"the other one", "c.txt": b"and another"})
    for metadata, texts in (
        (None, ["written documents"]),
        ({"docs_path": str(other)}, ["the other one", "and another"]),
    ):
        manager = TaskManager(include_defaults=False, include_path=str(written.parent), metadata=metadata)
        task = manager.load_task_or_group(["mine"])["mine"]
        assert [doc["text"] for doc in task.eval_docs] == texts
