"""WikiText files → articles, with the rule of ``EleutherAI/wikitext_document_level`` (pure Python).

Used by the ``distperp_wikitext*`` tasks (``tasks/distperp/utils.py``) and the benchmarks.
"""

from __future__ import annotations


def is_article_heading(line: str) -> bool:
    """True for a top-level WikiText heading line (`` = Title = ``), false for `` = = Section = = `` and text.

    The rule of ``EleutherAI/wikitext_document_level`` (and lm-eval 0.3's wikitext): collapse ``"= = ="`` to
    ``"==="`` and ``"= ="`` to ``"=="``, strip, then the line must start with ``"= "`` and end with ``" ="``.
    """
    collapsed = line.replace("= = =", "===").replace("= =", "==").strip()
    return collapsed.startswith("= ") and collapsed.endswith(" =")


def split_wikitext_articles(text: str) -> list[str]:
    """Split WikiText file contents into articles exactly as ``EleutherAI/wikitext_document_level`` does.

    Lines are ``text.split("\\n")``. Each top-level heading starts a new article that includes the heading line
    and every following line up to the next heading, joined with ``"\\n"`` (blank lines and the trailing empty
    string included). Text before the first heading is an article only if it is not blank. The last article is
    always kept.
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
