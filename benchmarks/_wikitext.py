"""WikiText-2 articles for the benchmarks, read from the shared folder at run time (never copied into the repo).

Shared by ``bench_scoring.py`` and ``balance.py``. Pure Python; no torch, no lm-eval.
"""

from __future__ import annotations

from pathlib import Path

from distperp_harness.report.wikitext import split_wikitext_articles as split_articles

REPO_ROOT = Path(__file__).resolve().parents[1]
WIKITEXT_TEST = REPO_ROOT.parent / "shared" / "data" / "wikitext-2" / "test.txt"
"""``../shared/data/wikitext-2/test.txt`` relative to the repository: 62 articles, 241,211 words."""
SHARED_MODEL = REPO_ROOT.parent / "shared" / "models" / "wt2-llama-5m"
"""``../shared/models/wt2-llama-5m``: 5.5M-parameter Llama (vocab 8,192) with its tokenizer."""


def load_articles(path: Path = WIKITEXT_TEST) -> list[str]:
    """The articles of ``path``.

    Raises:
        FileNotFoundError: with the path and what to pass instead, when the file is missing.
    """
    if not path.is_file():
        raise FileNotFoundError(f"WikiText file {path} not found; pass --text PATH (a WikiText test.txt)")
    return split_articles(path.read_text(encoding="utf-8"))
