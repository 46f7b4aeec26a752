"""WikiText-2 articles for the benchmarks, read from the shared folder at run time (never copied into the repo).

Shared by ``bench_scoring.py`` and ``balance.py``. Pure Python; no torch, no lm-eval.
"""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
WIKITEXT_TEST = REPO_ROOT.parent / "shared" / "data" / "wikitext-2" / "test.txt"
"""``../shared/data/wikitext-2/test.txt`` relative to the repository: 62 articles, 241,211 words."""
SHARED_MODEL = REPO_ROOT.parent / "shared" / "models" / "wt2-llama-5m"
"""``../shared/models/wt2-llama-5m``: 5.5M-parameter Llama (vocab 8,192) with its tokenizer."""


def is_article_heading(line: str) -> bool:
    """True for a top-level heading `` = Title = `` (not `` = = Section = = ``), the rule of
    ``EleutherAI/wikitext_document_level``."""
    collapsed = line.replace("= = =", "===").replace("= =", "==").strip()
    return collapsed.startswith("= ") and collapsed.endswith(" =")


def split_articles(text: str) -> list[str]:
    """Articles of a WikiText file: each starts at a top-level heading line and runs to the next one.

    Lines are joined back with ``"\\n"``; a blank preamble before the first heading is dropped.
    """
    articles: list[str] = []
    lines: list[str] = []
    for line in text.split("\n"):
        if is_article_heading(line):
            article = "\n".join(lines)
            if article.strip():
                articles.append(article)
            lines = []
        lines.append(line)
    articles.append("\n".join(lines))
    return articles


def load_articles(path: Path = WIKITEXT_TEST) -> list[str]:
    """The articles of ``path``.

    Raises:
        FileNotFoundError: with the path and what to pass instead, when the file is missing.
    """
    if not path.is_file():
        raise FileNotFoundError(f"WikiText file {path} not found; pass --text PATH (a WikiText test.txt)")
    return split_articles(path.read_text(encoding="utf-8"))
