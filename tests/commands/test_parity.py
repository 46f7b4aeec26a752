"""``distperp parity``: the request-by-request comparison (pure, on hand-made samples) and the whole command on the
tiny model (hf and distperp in this process, offline tasks)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import TASKS_DIR

from distperp_harness.commands import parity
from distperp_harness.commands.cli import main
from distperp_harness.commands.parity import (
    TOLERANCES,
    Tolerance,
    Verdict,
    check_model_args,
    compare_task,
    metrics,
    task_metadata,
)
from distperp_harness.errors import InputError

TIGHT = Tolerance(*TOLERANCES["float32"])


def _mc(doc: int, values: list[float], greedy: bool = False) -> dict:
    return {"doc_id": doc, "resps": [[(v, greedy)] for v in values]}


def test_values_within_tolerance_and_same_choices_agree() -> None:
    hf = [_mc(0, [-1.0, -2.0]), _mc(1, [-3.0, -0.5])]
    dp = [_mc(0, [-1.0005, -2.0]), _mc(1, [-3.0, -0.5002])]
    parity = compare_task("mc", hf, dp, TIGHT)
    assert (parity.values, parity.values_outside, parity.choices, parity.choices_differ) == (4, 0, 2, 0)
    assert parity.verdict is Verdict.AGREE
    assert parity.max_abs_diff == pytest.approx(5e-4)


def test_a_value_outside_tolerance_or_another_choice_differs() -> None:
    hf = [_mc(0, [-1.0, -2.0])]
    outside = compare_task("mc", hf, [_mc(0, [-1.01, -2.0])], TIGHT)
    assert outside.values_outside == 1 and outside.choices_differ == 0 and outside.verdict is Verdict.DIFFER
    swapped = compare_task("mc", hf, [_mc(0, [-2.0, -1.0])], Tolerance(0.6, 0.0))
    assert swapped.values_outside == 2 and swapped.choices_differ == 1 and swapped.verdict is Verdict.DIFFER
    greedy = compare_task("mc", hf, [_mc(0, [-1.0, -2.0], greedy=True)], TIGHT)
    assert greedy.greedy_differ == 2 and greedy.verdict is Verdict.DIFFER


def test_a_flip_between_answers_within_the_tolerance_is_a_near_tie() -> None:
    loose = Tolerance(0.1, 0.0)
    tie = compare_task("mc", [_mc(0, [-1.0, -1.05, -3.0])], [_mc(0, [-1.04, -1.0, -3.0])], loose)
    assert (tie.choices_differ, tie.near_ties, tie.values_outside, tie.verdict) == (0, 1, 0, Verdict.AGREE)
    # hf's gap 0.5 is more than the tolerance 0.3: a flip with every value within it still differs
    apart = compare_task("mc", [_mc(0, [-1.0, -1.5])], [_mc(0, [-1.28, -1.22])], Tolerance(0.3, 0.0))
    assert (apart.values_outside, apart.choices_differ, apart.near_ties) == (0, 1, 0)
    assert apart.verdict is Verdict.DIFFER


def test_rolling_totals_use_the_relative_part_and_generations_compare_as_text() -> None:
    rolling = compare_task(
        "r", [{"doc_id": 0, "resps": [[-10_000.0]]}], [{"doc_id": 0, "resps": [[-10_000.05]]}], TIGHT
    )
    assert rolling.values == 1 and rolling.values_outside == 0  # 0.05 <= 1e-3 + 1e-5 x 10,000
    assert rolling.max_abs_diff == pytest.approx(0.05) and rolling.max_diff_tolerance == pytest.approx(0.101)
    not_finite = compare_task(
        "r", [{"doc_id": 0, "resps": [[-1.0]]}], [{"doc_id": 0, "resps": [[float("nan")]]}], TIGHT
    )
    assert not_finite.verdict is Verdict.DIFFER and not_finite.max_abs_diff == float("inf")
    gen = compare_task(
        "g",
        [{"doc_id": 0, "resps": [["a b"]]}, {"doc_id": 1, "resps": [["c"]]}],
        [{"doc_id": 0, "resps": [["a b"]]}, {"doc_id": 1, "resps": [["d"]]}],
        TIGHT,
    )
    assert (gen.generations, gen.generations_differ, gen.verdict) == (2, 1, Verdict.DIFFER)


def test_other_documents_are_refused_and_nothing_compared_is_no_agreement() -> None:
    with pytest.raises(ValueError, match="different documents"):
        compare_task("mc", [_mc(0, [-1.0])], [_mc(1, [-1.0])], TIGHT)
    assert compare_task("empty", [], [], TIGHT).verdict is Verdict.DIFFER


def test_metrics_leave_out_standard_errors_and_names() -> None:
    hf = {"alias": "t", "acc,none": 0.5, "acc_stderr,none": 0.1, "n,none": "N/A"}
    assert metrics(hf, {"acc,none": 0.25, "acc_stderr,none": 0.2}) == {"acc,none": (0.5, 0.25)}


def test_parity_of_the_tiny_model_agrees_on_three_request_types(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "parity.json"
    tasks = "distperp_wikitext2,dptest_mc,dptest_gen"
    argv = ["parity", "--model", str(tiny_model_dir), "--tasks", tasks, "--include_path", str(TASKS_DIR)]
    assert main([*argv, "--limit", "3", "--device", "cpu", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    rows = {row["task"]: row for row in report["tasks"]}
    assert {task: row["verdict"] for task, row in rows.items()} == dict.fromkeys(tasks.split(","), "agree")
    assert rows["distperp_wikitext2"]["values"] == 3 and rows["dptest_gen"]["generations"] == 3
    assert rows["dptest_mc"]["choices"] == 3 and rows["dptest_mc"]["metrics"]["acc,none"][0] is not None
    assert "AGREE: 3 of 3 tasks agree" in capsys.readouterr().out


def test_model_args_cannot_contradict_the_flags_and_metadata_adds_to_the_default() -> None:
    check_model_args("trust_remote_code=True,revision=main")
    with pytest.raises(InputError, match=r"dtype \(use --dtype\)"):
        check_model_args("dtype=bfloat16")
    with pytest.raises(InputError, match=r"batch_size \(use --batch_size\)"):
        check_model_args("batch_size=4")
    merged = task_metadata('{"other": 1}')
    assert merged["other"] == 1 and merged["wikitext_path"].endswith("sample_wikitext.txt")
    for bad in ("{oops", "[1]"):
        with pytest.raises(InputError, match="--metadata"):
            task_metadata(bad)


def test_a_task_that_differs_exits_3_and_says_which(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    logged = {"hf": [_mc(0, [-1.0, -2.0])], "distperp": [_mc(0, [-2.0, -1.0])]}

    def evaluate(model, args, device, manager):
        return {"samples": {"mc": logged[model]}, "results": {"mc": {"acc,none": 1.0 if model == "hf" else 0.0}}}

    monkeypatch.setattr(parity, "_evaluate", evaluate)
    assert main(["parity", "--model", str(tmp_path), "--device", "cpu"]) == 3  # ran to its end, a task differs
    out = capsys.readouterr().out
    assert "DIFFER: mc: 0 of 1 tasks agree" in out and "| mc | acc,none | 1 | 0 |" in out
    assert "| max abs diff (tolerance there) |" in out and "| mc | 2/2 | 1 (0.00101) |" in out  # 1e-3 + 1e-5 x |-1|
