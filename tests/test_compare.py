"""compare: the table carries the numbers of the results JSON; the plot is a valid PNG."""

import json
import sys

import pytest

from distperp_harness.compare import load_run, markdown_table, per_document, plot_runs
from helpers import REPO_ROOT, load_results, run_command


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory):
    from distperp_harness.tiny import sample_text_path

    root = tmp_path_factory.mktemp("compare")
    outs = []
    for name, extra in [("base", ""), ("int8", ",quantize=int8,reference=base")]:
        out = root / name
        run_command([sys.executable, "-m", "lm_eval", "--model", "distperp", "--model_args",
                     f"pretrained={tiny_model_dir},max_length=64{extra}", "--tasks", "distperp_wikitext2",
                     "--include_path", str(REPO_ROOT / "tasks"), "--metadata",
                     json.dumps({"wikitext_path": str(sample_text_path())}), "--limit", "4", "--log_samples",
                     "--output_path", str(out)], cwd=root)
        outs.append(out)
    return outs


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
    proc = run_command([sys.executable, "-m", "distperp_harness", "compare", *map(str, runs), "--plot",
                        str(tmp_path / "p.png")], cwd=tmp_path)
    assert proc.stdout.startswith("| model | scheme | procs |") and (tmp_path / "p.png").exists()
