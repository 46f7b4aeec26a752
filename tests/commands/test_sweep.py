"""sweep: schemes parsed with clear errors; one launch evaluates every scheme against one reference loaded once;
the leaderboard is ranked by pooled KL; 2 processes give the same per-task entries as 1; compare shows flips."""

import json
import math
from pathlib import Path

import pytest
from helpers import accelerate_launch_prefix, load_results, run_command, sharpened_model

from distperp_harness.commands.cli import main
from distperp_harness.commands.compare import load_run, markdown_table, plot_runs
from distperp_harness.commands.sweep import Scheme, parse_schemes, pooled_kl
from distperp_harness.model import loading

SCHEMES = "int4:32,int8"


def test_parse_schemes():
    assert parse_schemes("int4:32, int4:128,int8,8da4w") == [
        Scheme("int4:32", "int4", 32),
        Scheme("int4:128", "int4", 128),
        Scheme("int8", "int8", None),
        Scheme("8da4w", "8da4w", None),
    ]
    assert parse_schemes("int4:32")[0].folder == "int4:32"  # the results folder is named as the leaderboard's row


@pytest.mark.parametrize(
    "text, says",
    [
        ("int3", "'int3' is not one of int4, int8, 8da4w"),
        ("int4:100", "group size '100' is not one of 32, 64, 128, 256"),
        ("int8:32", "int8 uses per-row scales"),
        ("none", "'none' is not one of"),
        ("int8,int8", "names a scheme twice"),
    ],
)
def test_bad_schemes_say_what_is_allowed(text, says):
    with pytest.raises(ValueError, match="Fix: e.g. --schemes") as info:
        parse_schemes(text)
    assert says in str(info.value)


def _sweep_args(model, tasks_dir, out, schemes=SCHEMES):
    return [
        "sweep",
        "--pretrained",
        str(model),
        "--schemes",
        schemes,
        "--tasks",
        "dptest_mc,dptest_rolling",
        "--include_path",
        str(tasks_dir),
        "--model_args",
        "max_length=128",
        "--batch_size",
        "4",
        "--output_path",
        str(out),
    ]


@pytest.fixture(scope="module")
def sweep(tiny_model_dir, tasks_dir, tmp_path_factory):
    """One in-process sweep (1 process), counting model loads; its second scheme (8da4w) fails to load (an injected
    fault, as an unreadable file would), which is a leaderboard row saying why, the sweep going on to int8 and
    exiting 3 once everything is written.

    One intra-op thread, as each of the 2 processes that ``accelerate launch --multi_gpu`` starts on a CPU machine
    gets (``OMP_NUM_THREADS=1``): the bf16 int4 CPU kernel's last bits depend on the thread count, not on the world
    size (measured on this model: the 1e-9-relative difference goes away with equal threads).
    """
    import torch

    from distperp_harness.distributed import testfaults

    root = tmp_path_factory.mktemp("sweep")
    model = sharpened_model(tiny_model_dir, root / "model")
    loads = []
    original, threads = loading.load_model, torch.get_num_threads()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(
            loading, "load_model", lambda *a, **k: loads.append(k.get("key", "pretrained")) or original(*a, **k)
        )
        torch.set_num_threads(1)
        patch.setitem(testfaults._calls, "load", 0)  # this process's model loads, counted from here
        patch.setenv("DISTPERP_TEST_FAIL_LOAD", "0:2")
        try:
            assert main(_sweep_args(model, tasks_dir, root / "out", "int4:32,8da4w,int8")) == 3
        finally:
            torch.set_num_threads(threads)
    return {"model": model, "out": root / "out", "loads": loads}


def test_reference_is_loaded_once(sweep):
    assert len(sweep["loads"]) == 3  # the reference once, then each scheme's model


def test_one_results_folder_per_scheme_ranked_by_pooled_kl(sweep):
    runs = {label: load_run(sweep["out"] / Scheme(label, "", None).folder) for label in SCHEMES.split(",")}
    assert runs["int4:32"].scheme == "int4:32" and runs["int8"].scheme == "int8"
    for label, run in runs.items():  # straight in <output_path>/<scheme>/, saying what ran
        assert run.path.parent == sweep["out"] / Scheme(label, "", None).folder
        config = json.loads(run.path.read_text())["config"]
        assert config["model"] == "distperp" and config["model_args"]["pretrained"] == str(sweep["model"])
        assert run.model == Path(str(sweep["model"])).name
    for run in runs.values():
        assert sorted(run.reference) == ["dptest_mc", "dptest_rolling"]
    kl = {
        label: sum(e["kl_divergence"] * e["n_tokens"] for e in r.reference.values())
        / sum(e["n_tokens"] for e in r.reference.values())
        for label, r in runs.items()
    }
    assert kl == {label: pytest.approx(pooled_kl(r.reference), rel=1e-12) for label, r in runs.items()}
    rows = [line.split("|")[1:-1] for line in (sweep["out"] / "leaderboard.md").read_text().splitlines()[2:]]
    order = [row[1].strip() for row in rows[:4:2]]
    assert order == sorted(kl, key=kl.get) and [row[0].strip() for row in rows[:4]] == ["1", "1", "2", "2"]
    failed = [c.strip() for c in rows[4]]  # the scheme that failed to load: last, saying why
    assert failed[:3] == ["–", "8da4w", "–"] and failed[3].startswith("failed: RuntimeError: injected failure")
    assert not (sweep["out"] / "8da4w").exists()
    mc = runs["int4:32"].reference["dptest_mc"]
    cells = next(row for row in rows if row[1].strip() == "int4:32" and row[2].strip() == "dptest_mc")
    assert cells[5].strip() == f"{mc['flips']:.3f} ({mc['n_flips']}/20)" and mc["n_flips"] >= 1
    ratio, se = mc["ln_ppl_ratio"], mc["ln_ppl_ratio_stderr"]
    assert cells[7].strip() == f"{mc['n_correct_to_wrong']} / {mc['n_wrong_to_correct']}"
    assert cells[9].strip() == f"{100 * math.expm1(ratio):+.2f} ± {100 * math.exp(ratio) * se:.2f}"
    assert float(cells[10]) == pytest.approx(runs["int4:32"].weight_bytes / 1e6, abs=0.005)


def test_compare_shows_flips_for_every_task_and_plots_them(sweep, tmp_path):
    runs = [load_run(p) for p in sorted(sweep["out"].iterdir()) if p.is_dir()]
    table = markdown_table(runs).splitlines()
    header = [c.strip() for c in table[0].strip("|").split("|")]
    assert {"kl_divergence", "top1_agreement", "flips", "flips_norm"} <= set(header)
    for line in table[2:]:
        cells = dict(zip(header, (c.strip() for c in line.strip("|").split("|"))))
        assert cells["kl_divergence"] != "–"  # the MC task too, from config.distperp.reference.tasks
        assert (cells["flips"] != "–") == (cells["task"] == "dptest_mc")
    png = plot_runs(runs, tmp_path / "flips.png")  # no --log_samples: the flips panel alone
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.distributed
def test_two_processes_give_the_same_entries(sweep, tasks_dir, tmp_path):
    out = tmp_path / "out2"
    cmd = [*accelerate_launch_prefix(2), "-m", "distperp_harness", *_sweep_args(sweep["model"], tasks_dir, out)]
    proc = run_command(cmd, cwd=tmp_path)
    assert "| rank | scheme | task |" in proc.stdout and "reference reused" in proc.stderr + proc.stdout
    for label in SCHEMES.split(","):
        folder = Scheme(label, "", None).folder
        one, two = (load_results(o / folder)["config"]["distperp"] for o in (sweep["out"], out))
        assert two["world_size"] == 2 and two["fingerprint"] == one["fingerprint"]
        assert json.dumps(two["reference"]["tasks"]) == json.dumps(one["reference"]["tasks"])


# --- the leaderboard figure, from fixed results JSONs -------------------------------------------------------------

TWELVE = [
    "int4:32",
    "int4:64",
    "int4:128",
    "int4:256",
    "8da4w:32",
    "8da4w:64",
    "8da4w:128",
    "8da4w:256",
    "int8",
    "int8 bf16",
    "int4:32 hqq",
    "int4:128 awq",
]
MB = [1.42, 1.39, 1.36, 1.35, 1.42, 1.39, 1.36, 1.35, 2.71, 2.71, 1.42, 1.36]  # clusters of equal weight bytes
KL = [0.0127, 0.015, 0.0214, 0.025, 0.014, 0.017, 0.0252, 0.03, 9.4e-5, 1.0e-4, 0.0128, 0.02]


def _fixed_runs(root, labels, tasks):
    """``(label, Run)`` from results JSONs written with given numbers; ``tasks``: names → entry(kl) builders."""
    from helpers import write_results_json

    runs = []
    for i, label in enumerate(labels):
        reference = {task: make(KL[i]) for task, make in tasks.items()}
        path = write_results_json(
            root / f"s{i}",
            quantize="int4",
            weight_bytes=int(MB[i] * 1e6),
            reference=reference,
            reference_bytes=4_461_056,
        )
        runs.append((label, load_run(path)))
    return runs


def _tasks(kind):
    from helpers import mc_entry, rolling_entry

    rolling = {"wiki": lambda kl: rolling_entry(kl, 6000, ln_ppl_ratio=kl / 2)}
    mc = {"hellaswag": lambda kl: mc_entry(kl, min(1.0, 8 * kl), delta_acc=-2 * kl)}
    mc_no_gold = {"mc_no_gold": lambda kl: mc_entry(kl, min(1.0, 6 * kl))}
    return {"rolling": rolling, "mc": mc, "mc_no_gold": mc_no_gold, "both": {**rolling, **mc}}[kind]


def test_pooled_kl_stderr():
    from distperp_harness.commands.sweep import pooled_kl_stderr

    entries = {
        "a": {"kl_divergence": 0.1, "kl_divergence_stderr": 0.01, "n_tokens": 300},
        "b": {"kl_divergence": 0.2, "kl_divergence_stderr": 0.04, "n_tokens": 100},
        "c": {"n_docs": 3},
    }
    assert pooled_kl_stderr(entries) == pytest.approx(math.sqrt((300 * 0.01) ** 2 + (100 * 0.04) ** 2) / 400, rel=1e-12)
    entries["b"]["kl_divergence_stderr"] = None
    assert pooled_kl_stderr(entries) is None and pooled_kl_stderr({}) is None


@pytest.mark.parametrize(
    "kind, panels",
    [
        ("rolling", ["kl_vs_weight_bytes", "delta_ppl"]),
        ("mc", ["kl_vs_weight_bytes", "flips", "delta_acc"]),
        ("mc_no_gold", ["kl_vs_weight_bytes", "flips"]),
        ("both", ["kl_vs_weight_bytes", "delta_ppl", "flips", "delta_acc"]),
    ],
)
def test_leaderboard_figure_has_the_panels_of_its_data(kind, panels, tmp_path):
    pytest.importorskip("matplotlib")
    from PIL import Image

    from distperp_harness.commands.plots import leaderboard_figure
    from distperp_harness.commands.sweep import leaderboard_panels, write_leaderboard

    runs = _fixed_runs(tmp_path, TWELVE[:2], _tasks(kind))
    lines = write_leaderboard(tmp_path / "out", runs)
    png = tmp_path / "out" / "leaderboard.png"
    assert (tmp_path / "out" / "leaderboard.md").read_text().startswith("| rank | scheme |")
    assert lines[-1].startswith(f"sweep: figure {png}: drew KL vs weight bytes")
    with Image.open(png) as image:
        assert image.text["Description"] == "panels: " + ", ".join(panels)
    fig, names = leaderboard_figure(runs)
    assert names == panels and [ax.get_gid() for ax in fig.axes] == panels
    points, dots = leaderboard_panels(runs)
    assert [p[0] for p in points] == ["int4:32", "int4:64"]  # ranked by pooled KL
    assert points[0][1:3] == (1.42, pytest.approx(KL[0], rel=1e-12))
    if "delta_ppl" in panels:
        assert dots[0].values[("int4:32", "wiki")][0] == pytest.approx(100 * math.expm1(KL[0] / 2), rel=1e-12)


@pytest.mark.parametrize("n", [2, 12])
def test_leaderboard_figure_is_readable_with_2_or_12_schemes(n, tmp_path):
    """No two texts overlap (scheme labels, row names, task names, titles, legends); each scheme label is inside the
    KL panel and on no marker."""
    pytest.importorskip("matplotlib")
    from matplotlib.text import Text
    from matplotlib.transforms import Bbox

    from distperp_harness.commands.plots import leaderboard_figure, text_overlaps

    runs = _fixed_runs(tmp_path, TWELVE[:n], _tasks("both"))
    fig, _ = leaderboard_figure(runs)
    fig.canvas.draw()
    assert text_overlaps(fig) == []
    ax, renderer = fig.axes[0], fig.canvas.get_renderer()
    labels = {a.get_text(): Text.get_window_extent(a, renderer) for a in ax.texts}
    assert sorted(labels) == sorted(TWELVE[:n])
    inside = ax.get_window_extent(renderer)
    markers = [
        Bbox.from_extents(*(ax.transData.transform((MB[i], KL[i])) - 4), *(ax.transData.transform((MB[i], KL[i])) + 4))
        for i in range(n)
    ]
    for box in labels.values():
        assert inside.x0 <= box.x0 and box.x1 <= inside.x1 and inside.y0 <= box.y0 and box.y1 <= inside.y1
        assert not any(box.overlaps(m) for m in markers)
    rows = [t.get_text() for t in fig.axes[1].get_yticklabels()]
    assert rows[::-1] == [label for label, _ in sorted(runs, key=lambda p: (KL[TWELVE.index(p[0])], p[0]))]


def test_without_matplotlib_the_markdown_is_still_written(tmp_path, monkeypatch):
    import sys

    from distperp_harness.commands.sweep import write_leaderboard

    runs = _fixed_runs(tmp_path, TWELVE[:2], _tasks("both"))
    for name in ("matplotlib", "matplotlib.figure", "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(sys.modules, name, None)
    lines = write_leaderboard(tmp_path / "out", runs)
    assert (tmp_path / "out" / "leaderboard.md").exists() and not (tmp_path / "out" / "leaderboard.png").exists()
    assert lines[-1].startswith("sweep: no figure: matplotlib is not installed; pip install")


def test_the_sweep_writes_its_figure(sweep):
    pytest.importorskip("matplotlib")
    from PIL import Image

    with Image.open(sweep["out"] / "leaderboard.png") as image:
        assert image.text["Description"] == "panels: kl_vs_weight_bytes, delta_ppl, flips, delta_acc"
