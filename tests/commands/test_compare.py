"""compare: the table carries the numbers of the results JSON; the plot is a valid PNG."""

import json
import sys

import pytest
from helpers import REPO_ROOT, load_results, run_command, side_by_side

from distperp_harness.commands.compare import load_run, markdown_table, per_document, plot_runs


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory):
    from distperp_harness.commands.tiny import sample_text_path

    root = tmp_path_factory.mktemp("compare")

    def run(name, extra):
        run_command(
            [
                sys.executable,
                "-m",
                "lm_eval",
                "--model",
                "distperp",
                "--model_args",
                f"pretrained={tiny_model_dir},max_length=64{extra}",
                "--tasks",
                "distperp_wikitext2",
                "--include_path",
                str(REPO_ROOT / "tasks"),
                "--metadata",
                json.dumps({"wikitext_path": str(sample_text_path())}),
                "--limit",
                "4",
                "--log_samples",
                "--output_path",
                str(root / name),
            ],
            cwd=root,
        )
        return root / name

    return side_by_side(lambda: run("base", ""), lambda: run("int8", ",quantize=int8,reference=base"))


def test_table_rows_carry_the_results(runs):
    loaded = [load_run(p) for p in runs]
    table = markdown_table(loaded).splitlines()
    assert len(table) == 2 + 2
    header = [c.strip() for c in table[0].strip("|").split("|")]
    assert {"token_perplexity", "word_perplexity", "kl_divergence", "top1_agreement", "tok/s"} <= set(header)
    for line, out in zip(table[2:], runs):
        cells = dict(zip(header, (c.strip() for c in line.strip("|").split("|"))))
        results = load_results(out)
        values = results["results"]["distperp_wikitext2"]
        value, stderr = values["token_perplexity,none"], values["token_perplexity_stderr,none"]
        assert cells["token_perplexity"] == f"{value:.4g} ± {stderr:.2g}"
        assert cells["procs"] == "1" and cells["fingerprint"] == results["config"]["distperp"]["fingerprint"]
    base, int8 = (dict(zip(header, (c.strip() for c in line.strip("|").split("|")))) for line in table[2:])
    original = load_results(runs[0])["n-samples"]["distperp_wikitext2"]["original"]
    assert base["docs"] == int8["docs"] == f"4/{original} (limit 4)" and original > 4  # --limit 4 of the articles
    assert base["scheme"] == "none" and base["kl_divergence"] == "–"
    assert int8["scheme"] == "int8" and int8["kl_divergence"] != "–"
    assert float(int8["weights MB"]) < float(base["weights MB"])


def test_per_document_values(runs):
    run = load_run(runs[1])
    docs = per_document(run, "distperp_wikitext2")
    assert len(docs["nll_per_token"]) == 4 and len(docs["kl_per_token"]) == 4
    assert all(v > 0 for v in docs["nll_per_token"]) and all(v >= 0 for v in docs["kl_per_token"])


def test_plot_is_a_png(runs, tmp_path):
    out = plot_runs([load_run(p) for p in runs], tmp_path / "cmp.png")
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    from PIL import Image

    with Image.open(out) as image:
        image.verify()
        assert image.size[0] > 600


def test_cli(runs, tmp_path):
    proc = run_command(
        [sys.executable, "-m", "distperp_harness", "compare", *map(str, runs), "--plot", str(tmp_path / "p.png")],
        cwd=tmp_path,
    )
    assert proc.stdout.startswith("| model | scheme | procs |") and (tmp_path / "p.png").exists()


def test_same_bits_says_in_one_line_whether_two_runs_are_equal_or_where_they_first_differ(runs, tmp_path, capsys):
    """--same-bits A B: a copy of a run is the same bits (fingerprint and every document's values); the int8 run
    differs from the first document on; a copy whose fingerprint is kept but one document's value is changed is
    caught at that document; exit 0 when equal, 3 when not."""
    import shutil

    from distperp_harness.commands.cli import main

    base, int8 = runs
    copy = shutil.copytree(base, tmp_path / "copy")
    assert main(["compare", "--same-bits", str(base), str(copy)]) == 0
    line = capsys.readouterr().out.strip()
    fingerprint = load_results(base)["config"]["distperp"]["fingerprint"]
    assert line == (
        f"compare: the same bits: A={load_run(base).path.parent} and B={load_run(copy).path.parent}: fingerprint "
        f"{fingerprint} and 4 documents' values in 1 task(s) equal"
    )
    assert main(["compare", "--same-bits", str(base), str(int8)]) == 3
    line = capsys.readouterr().out.strip()
    assert "\n" not in line and line.startswith("compare: not the same bits: ") and "fingerprints " in line
    assert "first difference: task distperp_wikitext2 doc 0: filtered_resps [" in line
    samples = load_run(copy).samples["distperp_wikitext2"]
    rows = [json.loads(r) for r in samples.read_text().splitlines()]
    value = float(rows[2]["filtered_resps"][0])  # lm-eval writes a rolling document's value as its repr
    rows[2]["filtered_resps"][0] = repr(value * (1 + 2**-40))  # one document, its last bits
    samples.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["compare", "--same-bits", str(base), str(copy)]) == 3
    line = capsys.readouterr().out.strip()
    assert f"first difference: task distperp_wikitext2 doc {rows[2]['doc_id']}: filtered_resps" in line


# --- compare --plot from fixed results JSONs ------------------------------------------------------------------------


def _fixed(root, with_reference=True, perplexity=True):
    """A base run and an int8 run (reference= on a perplexity task and a multiple-choice task, when asked)."""
    from helpers import mc_entry, rolling_entry, write_results_json

    results = {
        "wiki": {"token_perplexity,none": 42.0, "token_perplexity_stderr,none": 3.0} if perplexity else {},
        "mc": {"acc,none": 0.45, "acc_stderr,none": 0.1},
    }
    base = write_results_json(root / "base", results=results)
    reference = {"wiki": rolling_entry(1e-4, 6000), "mc": mc_entry(2e-4, 0.05, 0.0)} if with_reference else None
    int8 = write_results_json(
        root / "int8",
        quantize="int8",
        weight_bytes=2_700_000,
        reference=reference,
        results={"wiki": {"token_perplexity,none": 41.9, "token_perplexity_stderr,none": 3.0}, "mc": results["mc"]}
        if perplexity
        else results,
    )
    return [load_run(base), load_run(int8)]


@pytest.mark.parametrize(
    "with_reference, panels, skipped",
    [
        (True, ["kl_divergence", "top1_agreement", "perplexity", "flips"], []),
        (False, ["perplexity"], ["kl_divergence", "top1_agreement", "flips"]),
    ],
)
def test_plot_draws_the_panels_that_have_data(with_reference, panels, skipped, tmp_path):
    pytest.importorskip("matplotlib")
    from PIL import Image

    from distperp_harness.commands.compare import compare_panels
    from distperp_harness.commands.plots import compare_figure, plot_compare, text_overlaps

    runs = _fixed(tmp_path, with_reference)
    fig, names, skips = compare_figure(runs)
    assert names == panels and [ax.get_gid() for ax in fig.axes] == panels
    assert [s.split(" ")[0] for s in skips] == [*skipped, "per-document"]
    fig.canvas.draw()
    assert text_overlaps(fig) == []
    drawn = plot_compare(runs, tmp_path / "c.png")
    with Image.open(drawn.path) as image:
        assert image.text["Description"] == "panels: " + ", ".join(panels)
    dots = {p.name: p for p in compare_panels(runs)[0]}
    assert dots["perplexity"].values[("wiki", runs[0].label)] == (42.0, 3.0)
    if with_reference:  # only the int8 run has a reference; flips only on the multiple-choice task
        assert dots["kl_divergence"].series == (runs[1].label,) and dots["flips"].rows == ("mc",)
        assert dots["flips"].values[("mc", runs[1].label)] == (5.0, 5.0)


def test_plot_cli_says_in_one_line_what_it_drew(tmp_path, capsys, monkeypatch):
    pytest.importorskip("matplotlib")
    import sys

    from distperp_harness.commands.compare import run_compare

    _fixed(tmp_path)
    assert run_compare([str(tmp_path / "base"), str(tmp_path / "int8")], plot=str(tmp_path / "p.png")) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("| model | scheme |") and (tmp_path / "p.png").exists()
    assert out[-1] == (
        f"compare: figure {tmp_path / 'p.png'}: drew KL divergence, top-1 agreement, perplexity, "
        "flips; skipped per-document panels (no samples: run lm-eval with --log_samples)"
    )
    _fixed(tmp_path / "bare", with_reference=False, perplexity=False)
    assert run_compare([str(tmp_path / "bare" / "base")], plot=str(tmp_path / "q.png")) == 3  # no figure
    assert capsys.readouterr().out.splitlines()[-1].startswith("compare: no plot: nothing to plot")
    for name in ("matplotlib", "matplotlib.figure", "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(sys.modules, name, None)
    assert run_compare([str(tmp_path / "int8")], plot=str(tmp_path / "r.png")) == 3
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("| model |") and out[-1].startswith("compare: no plot: matplotlib is not installed")


def test_plot_with_samples_adds_per_document_panels(runs):
    pytest.importorskip("matplotlib")
    from distperp_harness.commands.plots import compare_figure, text_overlaps

    fig, names, skipped = compare_figure([load_run(p) for p in runs])
    assert names == [
        "kl_divergence",
        "top1_agreement",
        "perplexity",
        "nll_per_document:distperp_wikitext2",
        "kl_per_document:distperp_wikitext2",
    ]
    assert skipped == ["flips (no multiple-choice task with reference=)"]
    fig.canvas.draw()
    assert text_overlaps(fig) == []
    for ax in fig.axes:
        if "per_document" in str(ax.get_gid()):
            assert all(float(t).is_integer() for t in ax.get_xticks())  # documents are counted


def _write(folder, name, config):
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"results_{name}.json"
    path.write_text(json.dumps({"results": {"t": {"word_perplexity,none": 2.0}}, "config": config}))
    return path


def test_runs_are_labelled_by_model_and_backend_whatever_form_model_args_takes(tmp_path):
    from distperp_harness.commands.compare import load_run

    as_dict = _write(tmp_path / "a", "1", {"model": "hf", "model_args": {"pretrained": "/m/wt2-llama-5m"}})
    as_text = _write(tmp_path / "b", "1", {"model": "hf", "model_args": "pretrained=org/wt2-llama-5m,dtype=float32"})
    ours = _write(
        tmp_path / "c",
        "1",
        {
            "model": "distperp",
            "distperp": {
                "options": {"pretrained": "/m/wt2-llama-5m/", "quantize": "int4", "group_size": 128},
                "world_size": 2,
            },
        },
    )
    assert [load_run(p).label for p in (as_dict, as_text, ours)] == [
        "wt2-llama-5m hf x1",
        "wt2-llama-5m hf x1",
        "wt2-llama-5m int4:128 x2",
    ]


def test_a_folder_of_several_results_compares_them_all_and_a_missing_path_is_one_line(tmp_path, capsys):
    from distperp_harness.commands.compare import run_compare
    from distperp_harness.errors import InputError

    _write(
        tmp_path / "sweep" / "int8",
        "1",
        {"model": "distperp", "distperp": {"options": {"pretrained": "m", "quantize": "int8"}}},
    )
    _write(
        tmp_path / "sweep" / "int4",
        "2",
        {"model": "distperp", "distperp": {"options": {"pretrained": "m", "quantize": "int4", "group_size": 32}}},
    )
    assert run_compare([str(tmp_path / "sweep")]) == 0
    table = capsys.readouterr().out
    assert "int8" in table and "int4:32" in table
    with pytest.raises(InputError, match="no such results file or folder. Fix: give a results_"):
        run_compare([str(tmp_path / "nowhere")])
    proc = run_command([sys.executable, "-m", "distperp_harness", "compare", "nowhere"], cwd=tmp_path, check=False)
    assert proc.returncode == 1 and proc.stderr.strip().splitlines() == [
        "distperp: error: nowhere: no such results file or folder. Fix: give a results_*.json file or a folder "
        "lm-eval wrote with --output_path"
    ]


def test_the_legend_lists_the_runs_a_panel_shows_and_names_the_others(tmp_path):
    """A run with no value in any drawn panel (an ``hf`` run with accuracy only) is left out of the legend and
    named among the skipped; the per-document axis counts whole documents."""
    pytest.importorskip("matplotlib")
    from distperp_harness.commands.plots import compare_figure

    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "results_1.json").write_text(
        json.dumps(
            {"results": {"mc": {"acc,none": 0.4}}, "config": {"model": "hf", "model_args": {"pretrained": "/m/other"}}}
        )
    )
    runs = [*_fixed(tmp_path, with_reference=False), load_run(folder)]
    fig, names, skips = compare_figure(runs)
    assert names == ["perplexity"]
    assert [t.get_text() for t in fig.legends[0].get_texts()] == [runs[0].label, runs[1].label]
    assert f"run {runs[2].label} (no value in any panel)" in skips


def test_a_cut_short_results_file_is_named_in_one_line_not_a_traceback(tmp_path):
    from distperp_harness.errors import InputError

    folder = tmp_path / "out" / "model"
    folder.mkdir(parents=True)
    cut = folder / "results_2026.json"
    cut.write_text('{"results": {"task": {"acc,n')  # what a full disk leaves
    with pytest.raises(InputError, match=r"not a results file \(JSONDecodeError at line 1 col \d+") as info:
        load_run(tmp_path / "out")
    assert str(cut) in str(info.value) and "Fix:" in str(info.value)
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(InputError, match="a JSON list, not an object"):
        load_run(tmp_path / "list.json")

    proc = run_command([sys.executable, "-m", "distperp_harness", "compare", str(cut)], cwd=tmp_path, check=False)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("distperp: error")]
    assert proc.returncode == 1 and len(lines) == 1 and str(cut) in lines[0], proc.stderr[-2000:]
    assert "JSONDecodeError at line 1" in lines[0] and "Traceback" not in proc.stderr
