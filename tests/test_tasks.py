"""The distperp_* tasks without a model: data loading, article splitting, process_results, YAMLs, lm-eval's table.

End-to-end runs use a stand-in LM that returns :class:`Score` values (or plain floats, as ``--model hf``).
"""

from __future__ import annotations

import copy
import importlib.util
import json
import math
import pickle
import zlib
from pathlib import Path

import numpy as np
import pytest

from distperp_harness.errors import InputError
from distperp_harness.report.results import Score

TASKS_DIR = Path(__file__).resolve().parents[1] / "tasks"
SHARED_WIKITEXT2 = Path(__file__).resolve().parents[2] / "shared" / "data" / "wikitext-2"

_spec = importlib.util.spec_from_file_location("distperp_task_utils_under_test", TASKS_DIR / "distperp" / "utils.py")
utils = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(utils)

WT2 = {"hub_path": "EleutherAI/wikitext_document_level", "hub_name": "wikitext-2-raw-v1"}
WT103 = {"hub_path": "EleutherAI/wikitext_document_level", "hub_name": "wikitext-103-raw-v1"}

# A small WikiText-format file, written for these tests: blank prelude, two articles, sections of levels 2-4,
# a line with " = " inside text, no final newline after the last blank line.
SAMPLE = (
    " \n"
    " = Alpha = \n"
    " \n"
    " Alpha is a letter @-@ like sign , first . \n"
    " \n"
    " = = History = = \n"
    " \n"
    " It came first . \n"
    " = = = Early = = = \n"
    " = = = = Very early = = = = \n"
    " Text ( in brackets ) . \n"
    " \n"
    " = Beta = \n"
    " \n"
    " Beta = second . \n"
    " = = Uses = = \n"
    " Many , many uses . \n"
    " \n"
)
SAMPLE_ARTICLES = [
    " = Alpha = \n \n Alpha is a letter @-@ like sign , first . \n \n = = History = = \n \n It came first . \n"
    " = = = Early = = = \n = = = = Very early = = = = \n Text ( in brackets ) . \n ",
    " = Beta = \n \n Beta = second . \n = = Uses = = \n Many , many uses . \n \n",
]
OTHER_SAMPLE = " = Gamma = \n Gamma only . \n"


@pytest.fixture(autouse=True)
def _no_env(monkeypatch):
    monkeypatch.delenv(utils.WIKITEXT_PATH_ENV, raising=False)
    monkeypatch.delenv(utils.DOCS_PATH_ENV, raising=False)


def pages(dataset_dict, split="test"):
    return list(dataset_dict[split]["page"])


# ---------------------------------------------------------------------------------------------------------------
# Article splitting
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "line, heading",
    [
        (" = Alpha = ", True),
        ("= Alpha =", True),
        (" = = History = = ", False),
        (" = = = Early = = = ", False),
        (" = = = = Very early = = = = ", False),
        (" Beta = second . ", False),
        (" =Alpha= ", False),
        ("", False),
    ],
)
def test_article_heading(line, heading):
    assert utils.is_article_heading(line) is heading


def test_split_articles_on_top_level_headings():
    assert utils.split_wikitext_articles(SAMPLE) == SAMPLE_ARTICLES
    # articles joined with "\n" (how the file was cut) split back into the same articles
    assert utils.split_wikitext_articles("\n".join(SAMPLE_ARTICLES * 2)) == SAMPLE_ARTICLES * 2


def test_split_keeps_non_blank_prelude_and_always_the_last_article():
    assert utils.split_wikitext_articles("intro line\n = A = \n a") == ["intro line", " = A = \n a"]
    assert utils.split_wikitext_articles("") == [""]


@pytest.mark.skipif(not (SHARED_WIKITEXT2 / "test.txt").is_file(), reason="shared WikiText-2 data absent")
def test_shared_wikitext2_article_counts():
    result = utils.load_wikitext(**WT2, split="test", wikitext_path=str(SHARED_WIKITEXT2))
    assert len(result["test"]) == 62
    result = utils.load_wikitext(**WT2, split="validation", wikitext_path=str(SHARED_WIKITEXT2))
    assert len(result["validation"]) == 60


# ---------------------------------------------------------------------------------------------------------------
# WikiText sources
# ---------------------------------------------------------------------------------------------------------------


def test_wikitext_file(tmp_path):
    (tmp_path / "wiki.test.raw").write_text(SAMPLE, encoding="utf-8")
    result = utils.load_wikitext(**WT2, split="test", wikitext_path=str(tmp_path / "wiki.test.raw"))
    assert list(result) == ["test"]
    assert pages(result) == SAMPLE_ARTICLES


def test_wikitext_folder_picks_the_split(tmp_path):
    (tmp_path / "test.txt").write_text(SAMPLE, encoding="utf-8")
    (tmp_path / "valid.txt").write_text(OTHER_SAMPLE, encoding="utf-8")
    assert pages(utils.load_wikitext(**WT2, split="test", wikitext_path=str(tmp_path))) == SAMPLE_ARTICLES
    valid = utils.load_wikitext(**WT2, split="validation", wikitext_path=str(tmp_path))
    assert pages(valid, "validation") == [OTHER_SAMPLE]


def test_wikitext_folder_prefers_raw_then_tokens_then_txt(tmp_path):
    (tmp_path / "test.txt").write_text(OTHER_SAMPLE, encoding="utf-8")
    (tmp_path / "wiki.test.tokens").write_text(OTHER_SAMPLE, encoding="utf-8")
    assert utils.wikitext_candidates(tmp_path, "wikitext-2", "test")[0].name == "wiki.test.raw"
    (tmp_path / "wiki.test.raw").write_text(SAMPLE, encoding="utf-8")
    assert pages(utils.load_wikitext(**WT2, split="test", wikitext_path=str(tmp_path))) == SAMPLE_ARTICLES


def test_wikitext_release_subfolders_pick_the_dataset(tmp_path):
    (tmp_path / "wikitext-2").mkdir()
    (tmp_path / "wikitext-2" / "wiki.test.tokens").write_text(SAMPLE, encoding="utf-8")
    (tmp_path / "wikitext-103-raw").mkdir()
    (tmp_path / "wikitext-103-raw" / "wiki.test.raw").write_text(OTHER_SAMPLE, encoding="utf-8")
    assert pages(utils.load_wikitext(**WT2, split="test", wikitext_path=str(tmp_path))) == SAMPLE_ARTICLES
    assert pages(utils.load_wikitext(**WT103, split="test", wikitext_path=str(tmp_path))) == [OTHER_SAMPLE]
    with pytest.raises(ValueError, match=r"holds no wikitext-103 validation file; looked for: wiki\.valid\.raw"):
        utils.load_wikitext(**WT103, split="validation", wikitext_path=str(tmp_path))


def test_a_path_naming_another_split_or_dataset_warns(tmp_path, monkeypatch):
    warnings = []
    monkeypatch.setattr(utils.logger, "warning", warnings.append)
    (tmp_path / "wikitext-2").mkdir()
    (tmp_path / "wikitext-2" / "valid.txt").write_text(SAMPLE, encoding="utf-8")
    utils.load_wikitext(**WT2, split="validation", wikitext_path=str(tmp_path / "wikitext-2"))
    assert warnings == []
    utils.load_wikitext(**WT103, split="test", wikitext_path=str(tmp_path / "wikitext-2" / "valid.txt"))
    assert len(warnings) == 2
    assert "whose name says valid" in warnings[0] and "whose path says wikitext-2" in warnings[1]


def test_env_var_relative_path_and_metadata_precedence(tmp_path, monkeypatch):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "wiki.test.raw").write_text(SAMPLE, encoding="utf-8")
    (tmp_path / "b.raw").write_text(OTHER_SAMPLE, encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(utils.WIKITEXT_PATH_ENV, "a")
    assert pages(utils.load_wikitext(**WT2, split="test")) == SAMPLE_ARTICLES
    assert pages(utils.load_wikitext(**WT2, split="test", wikitext_path="b.raw")) == [OTHER_SAMPLE]


def test_extra_metadata_is_ignored(tmp_path):
    (tmp_path / "wiki.test.raw").write_text(SAMPLE, encoding="utf-8")
    result = utils.load_wikitext(
        **WT2, split="test", wikitext_path=str(tmp_path), pretrained="x", version=1.0, config_source="y.yaml"
    )
    assert pages(result) == SAMPLE_ARTICLES


@pytest.mark.parametrize(
    "loader, typo, key",
    [("load_wikitext", "wikitext_pth", "wikitext_path"), ("load_local_docs", "doc_path", "docs_path")],
)
def test_a_misspelled_metadata_key_is_one_line_and_never_the_hub(monkeypatch, loader, typo, key):
    import datasets

    monkeypatch.setattr(datasets, "load_dataset", lambda **kw: pytest.fail("went to the hub"))
    kwargs = {**WT2, "split": "test"} if loader == "load_wikitext" else {"split": "test"}
    with pytest.raises(InputError, match=f"--metadata key '{typo}' is not one this task reads") as info:
        getattr(utils, loader)(**kwargs, **{typo: "/some/where"}, pretrained="x", version=1.0)
    assert f"Did you mean '{key}'" in str(info.value) and info.value.same_on_every_rank


def test_hub_is_the_default(monkeypatch):
    import datasets

    calls = []
    monkeypatch.setattr(datasets, "load_dataset", lambda **kw: calls.append(kw) or {"test": "hub"})
    assert utils.load_wikitext(**WT103, split="test", pretrained="x") == {"test": "hub"}
    assert calls == [{"path": "EleutherAI/wikitext_document_level", "name": "wikitext-103-raw-v1"}]


def test_the_hub_offline_names_the_local_option():
    """Offline (the tests' environment) and not cached: the hub fallback fails in one line that names the local
    option, not datasets' ``ConnectionError``. A dataset id nobody has cached keeps it independent of the cache."""
    hub = {"hub_path": "distperp-tests/no_such_dataset", "hub_name": "wikitext-2-raw-v1"}
    with pytest.raises(InputError) as info:
        utils.load_wikitext(**hub, split="test", pretrained="x")
    message = str(info.value)
    assert "no local WikiText file was given, and distperp-tests/no_such_dataset (wikitext-2-raw-v1)" in message
    assert '--metadata \'{"wikitext_path": "PATH"}\'' in message and "$DISTPERP_WIKITEXT_PATH" in message
    assert info.value.same_on_every_rank and "\n" not in message


def test_missing_path_names_it(tmp_path):
    missing = tmp_path / "nope" / "wiki.test.raw"
    with pytest.raises(FileNotFoundError, match=f"{missing} \\(from --metadata wikitext_path\\) does not exist"):
        utils.load_wikitext(**WT2, split="test", wikitext_path=str(missing))


def test_non_utf8_file_names_it(tmp_path, monkeypatch):
    bad = tmp_path / "wiki.test.raw"
    bad.write_bytes(b" = A = \n caf\xe9 \n")
    monkeypatch.setenv(utils.WIKITEXT_PATH_ENV, str(bad))
    with pytest.raises(ValueError, match=rf"{bad} \(from \$DISTPERP_WIKITEXT_PATH\) is not UTF-8 text"):
        utils.load_wikitext(**WT2, split="test")


def test_unreadable_file_names_it(tmp_path, monkeypatch):
    def deny(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    path = tmp_path / "wiki.test.raw"
    path.write_text(SAMPLE, encoding="utf-8")
    monkeypatch.setattr("builtins.open", deny)
    with pytest.raises(ValueError, match=f"{path} .* cannot be read: Permission denied"):
        utils.read_utf8(path, "test")


# ---------------------------------------------------------------------------------------------------------------
# Local documents
# ---------------------------------------------------------------------------------------------------------------


def test_local_docs_folder(tmp_path):
    (tmp_path / "b.txt").write_bytes(b"second doc\r\nwith CRLF\r\n")
    (tmp_path / "a.txt").write_text("first doc", encoding="utf-8")
    (tmp_path / "empty.txt").write_text(" \n", encoding="utf-8")
    (tmp_path / "notes.md").write_text("not a document", encoding="utf-8")
    (tmp_path / ".hidden").mkdir()
    (tmp_path / ".hidden" / "x.txt").write_text("hidden", encoding="utf-8")
    (tmp_path / "sub").mkdir()
    lines = [json.dumps({"text": "json one", "id": 1}), "", json.dumps({"text": "json two"})]
    (tmp_path / "sub" / "c.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    result = utils.load_local_docs(docs_path=str(tmp_path), split="test", pretrained="x")
    assert list(result["test"]["text"]) == ["first doc", "second doc\r\nwith CRLF\r\n", "json one", "json two"]
    jsonl = tmp_path / "sub" / "c.jsonl"
    sources = [str(tmp_path / "a.txt"), str(tmp_path / "b.txt"), f"{jsonl}:1", f"{jsonl}:3"]
    assert list(result["test"]["source"]) == sources


def test_local_docs_errors(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="docs_path"):
        utils.load_local_docs(split="test")
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "missing")):
        utils.load_local_docs(docs_path=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="holds no .txt or .jsonl files"):
        utils.load_local_docs(docs_path=str(tmp_path))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"body": "no text"}\n', encoding="utf-8")
    monkeypatch.setenv(utils.DOCS_PATH_ENV, str(bad))
    with pytest.raises(ValueError, match=rf'{bad}:2 \(from \$DISTPERP_DOCS_PATH\) has no string field "text"'):
        utils.load_local_docs()


# ---------------------------------------------------------------------------------------------------------------
# process_results
# ---------------------------------------------------------------------------------------------------------------

BASE_KEYS = {"token_perplexity", "word_perplexity", "byte_perplexity", "bits_per_byte", "n_tokens"}
REFERENCE_KEYS = {"kl_divergence", "kl_p99", "kl_max", "top1_agreement", "ref_token_perplexity", "ln_ppl_ratio"}


def test_process_results_plain_float_matches_lm_eval_wikitext():
    from lm_eval.tasks.wikitext.preprocess_wikitext import process_results as lm_eval_process_results

    doc = {"page": SAMPLE_ARTICLES[0] + " caf\u00e9 \u2014 \u00fc"}
    items = utils.process_results(doc, [-123.5])
    assert set(items) == BASE_KEYS
    assert items["token_perplexity"] == (-123.5, None) and items["n_tokens"] is None
    for key, value in lm_eval_process_results(doc, [-123.5]).items():
        assert items[key] == value


def test_process_results_score_without_reference():
    doc = {"text": "a  b\tc\n"}
    items = utils.process_results(doc, [Score(-7.25, 5)])
    assert set(items) == BASE_KEYS
    assert items["token_perplexity"] == (-7.25, 5)
    assert items["word_perplexity"] == (-7.25, 4)  # re.split(r"\s+") keeps the trailing empty string
    assert items["byte_perplexity"] == (-7.25, 7)
    assert items["n_tokens"] == 5
    assert type(items["token_perplexity"][0]) is float


def test_process_results_score_with_reference():
    kl = np.array([0.5, 0.0, 0.25, 1.5])
    items = utils.process_results({"page": "x y"}, [Score(-10.0, 4, ref_loglikelihood=-9.0, kl=kl, top1_agree=3)])
    assert set(items) == BASE_KEYS | REFERENCE_KEYS
    assert items["kl_divergence"] == (2.25, 4)
    assert np.array_equal(items["kl_p99"], kl)
    assert items["kl_max"] == 1.5
    assert items["top1_agreement"] == (3, 4)
    assert items["ref_token_perplexity"] == (-9.0, 4)
    assert items["ln_ppl_ratio"] == (-10.0, -9.0, 4)
    with pytest.raises(ValueError, match="3 KL values for 4"):
        utils.process_results({"page": "x"}, [Score(-1.0, 4, ref_loglikelihood=-1.0, kl=kl[:3], top1_agree=1)])


def test_score_survives_pickle_and_deepcopy():
    score = Score(-10.0, 4, ref_loglikelihood=-9.0, kl=np.array([0.5, 0.0, 0.25, 1.5]), top1_agree=3)
    for clone in (pickle.loads(pickle.dumps(score)), copy.deepcopy(score)):
        assert type(clone) is Score and float(clone) == -10.0
        assert (clone.n_tokens, clone.ref_loglikelihood, clone.top1_agree) == (4, -9.0, 3)
        assert clone.kl.dtype == np.float64 and np.array_equal(clone.kl, score.kl)
        a, b = utils.process_results({"page": "x"}, [clone]), utils.process_results({"page": "x"}, [score])
        assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a if k != "kl_p99")


# ---------------------------------------------------------------------------------------------------------------
# The YAMLs through lm-eval, with a stand-in model
# ---------------------------------------------------------------------------------------------------------------

TASKS = ["distperp_wikitext2", "distperp_wikitext2_val", "distperp_wikitext103", "distperp_wikitext103_val"]


def fake_score(text: str, reference: bool) -> Score:
    """A deterministic Score for ``text`` (what a model might return), independent of call order."""
    n = len(text.split()) + 3
    rng = np.random.default_rng(zlib.crc32(text.encode()))
    ll = -2.5 * n * rng.uniform(0.7, 1.3)
    if not reference:
        return Score(ll, n)
    return Score(ll, n, ref_loglikelihood=ll * 0.95, kl=rng.exponential(0.05, n), top1_agree=int(0.8 * n))


def make_lm(mode: str):
    from lm_eval.api.model import LM

    class StandIn(LM):
        def loglikelihood(self, requests, disable_tqdm=False):
            raise NotImplementedError

        def generate_until(self, requests, disable_tqdm=False):
            raise NotImplementedError

        def loglikelihood_rolling(self, requests, disable_tqdm=False):
            out = []
            for request in requests:
                (text,) = request.args
                score = fake_score(text, mode == "reference")
                out.append(float(score) if mode == "plain" else score)
            return out

    return StandIn()


@pytest.fixture(scope="module")
def task_manager(tmp_path_factory):
    from lm_eval.tasks import TaskManager

    folder = tmp_path_factory.mktemp("wikitext")
    (folder / "wiki.test.raw").write_text("\n".join(SAMPLE_ARTICLES * 3), encoding="utf-8")
    (folder / "wiki.valid.raw").write_text(OTHER_SAMPLE, encoding="utf-8")
    return TaskManager(include_path=str(TASKS_DIR), metadata={"wikitext_path": str(folder)})


def test_task_index(task_manager):
    names = set(task_manager.all_tasks)
    assert set(TASKS) | {"distperp_local_docs", "distperp_ppl", "distperp_ppl_val"} <= names
    loaded = task_manager.load(["distperp_ppl"])["tasks"]
    assert sorted(loaded) == ["distperp_wikitext103", "distperp_wikitext2"]
    for _name, task in loaded.items():
        assert task.config.metadata["version"] == 1.0
        assert task.config.output_type == "loglikelihood_rolling"
        docs = list(task.test_docs())
        assert [d["page"] for d in docs] == SAMPLE_ARTICLES * 3
        assert task.doc_to_target(docs[0]).startswith(" = Alpha =\n")  # lm-eval's detokenizer


def hand_results(docs: list[str], reference: bool) -> dict[str, float]:
    """Every metric and stderr for ``docs`` scored by :func:`fake_score`, in plain float64 loops."""
    from lm_eval.tasks.wikitext.preprocess_wikitext import wikitext_detokenizer

    scores = [fake_score(wikitext_detokenizer({"page": d}), reference) for d in docs]
    n = len(docs)

    def ratio(a, b):
        r = math.fsum(a) / math.fsum(b)
        var = n / (n - 1) * math.fsum([(x - r * y) ** 2 for x, y in zip(a, b)]) / math.fsum(b) ** 2
        return r, math.sqrt(var)

    nll = [-float(s) for s in scores]
    out = {}
    for name, counts in [
        ("token_perplexity", [s.n_tokens for s in scores]),
        ("word_perplexity", [len(d.split()) + (d[:1].isspace()) + (d[-1:].isspace()) for d in docs]),
        ("byte_perplexity", [len(d.encode()) for d in docs]),
    ]:
        r, se = ratio(nll, counts)
        out[name], out[name + "_stderr"] = math.exp(r), math.exp(r) * se
    r, se = ratio(nll, [len(d.encode()) for d in docs])
    out["bits_per_byte"], out["bits_per_byte_stderr"] = r / math.log(2), se / math.log(2)
    out["n_tokens"] = sum(s.n_tokens for s in scores)
    if reference:
        tokens = [s.n_tokens for s in scores]
        out["kl_divergence"], out["kl_divergence_stderr"] = ratio([math.fsum(s.kl) for s in scores], tokens)
        out["top1_agreement"], out["top1_agreement_stderr"] = ratio([s.top1_agree for s in scores], tokens)
        r, se = ratio([-s.ref_loglikelihood for s in scores], tokens)
        out["ref_token_perplexity"], out["ref_token_perplexity_stderr"] = math.exp(r), math.exp(r) * se
        diffs = [s.ref_loglikelihood - float(s) for s in scores]
        out["ln_ppl_ratio"], out["ln_ppl_ratio_stderr"] = ratio(diffs, tokens)
        values = sorted(float(x) for s in scores for x in s.kl)
        pos = 0.99 * (len(values) - 1)
        lo = math.floor(pos)
        out["kl_p99"] = values[lo] + (values[lo + 1] - values[lo]) * (pos - lo)
        out["kl_max"] = values[-1]
    return out


@pytest.mark.parametrize("mode", ["plain", "score", "reference"])
def test_end_to_end_table(task_manager, mode):
    from lm_eval import simple_evaluate
    from lm_eval.utils import make_table

    results = simple_evaluate(model=make_lm(mode), tasks=["distperp_wikitext2"], task_manager=task_manager)
    got = results["results"]["distperp_wikitext2"]
    expected = hand_results(SAMPLE_ARTICLES * 3, reference=mode == "reference")
    table = make_table(results)
    if mode == "plain":
        assert got["token_perplexity,none"] == "N/A" and got["token_perplexity_stderr,none"] == "N/A"
        assert got["n_tokens,none"] == "N/A"
        for key in ("token_perplexity", "token_perplexity_stderr", "n_tokens"):
            expected.pop(key)
    for key, value in expected.items():
        assert got[f"{key},none"] == pytest.approx(value, rel=1e-12), key
    for key in ("kl_p99", "kl_max", "n_tokens"):  # no stderr for these
        if f"{key},none" in got:
            assert got[f"{key}_stderr,none"] == "N/A"
    metric_names = {k.split(",")[0] for k in got if "," in k and "_stderr" not in k}
    assert metric_names == BASE_KEYS | (REFERENCE_KEYS if mode == "reference" else set())
    # the standard errors reach lm-eval's printed table
    row = next(line for line in table.splitlines() if "|word_perplexity" in line)
    assert f"{expected['word_perplexity_stderr']:.4f}" in row and "N/A" not in row
    assert ("|kl_divergence" in table) is (mode == "reference")
    json.dumps(results["results"])  # strict JSON: no NaN, no arrays
