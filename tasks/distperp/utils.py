"""Data loading and per-document results for the ``distperp_*`` perplexity tasks.

Loaded by lm-eval through ``!function utils.*`` in the task YAMLs. Importing it installs the small hook that lets
lm-eval print the standard errors of our aggregations
(:func:`distperp_harness.report.metrics.install_lm_eval_stderr_hook`).

Data sources (lm-eval passes ``--metadata`` and ``--model_args`` as keyword arguments to ``custom_dataset``):

- WikiText tasks: ``EleutherAI/wikitext_document_level`` from the hub (as lm-eval's ``wikitext``), unless
  ``--metadata '{"wikitext_path": PATH}'`` or ``$DISTPERP_WIKITEXT_PATH`` names a local WikiText file or folder
  (``sample``: the WikiText-format sample packaged with distperp).
- ``distperp_local_docs``: ``--metadata '{"docs_path": PATH}'`` or ``$DISTPERP_DOCS_PATH``.
- ``distperp_longdocs``, ``distperp_needle``, ``distperp_needle_gen``: ``docs_path`` or a local ``wikitext_path``
  (either key, or its environment variable), never the hub; see ``distperp_harness/report/longcontext.py``.

Relative paths resolve from the current directory.
"""

from __future__ import annotations

import logging
import math
import os
import re
from pathlib import Path
from typing import Any

from distperp_harness.errors import InputError, MissingInput
from distperp_harness.report import metrics as _metrics
from distperp_harness.report.results import n_tokens_of

# A child of lm-eval's logger: formatted like its own lines and following --verbosity.
logger = logging.getLogger("lm_eval.distperp")

_metrics.install_lm_eval_stderr_hook()

# Aggregations, re-exported for the YAMLs (``aggregation: !function utils.weighted_perplexity``).
weighted_perplexity = _metrics.weighted_perplexity
bits_per_byte = _metrics.bits_per_byte
ratio_mean = _metrics.ratio_mean
ln_ppl_ratio = _metrics.ln_ppl_ratio
percentile_99 = _metrics.percentile_99
maximum = _metrics.maximum
total = _metrics.total

WIKITEXT_PATH_ENV = "DISTPERP_WIKITEXT_PATH"
SAMPLE = "sample"  # wikitext_path=sample: the WikiText-format sample packaged with distperp
DOCS_PATH_ENV = "DISTPERP_DOCS_PATH"

# lm-eval's split names -> the names WikiText files use.
_FILE_SPLIT = {"test": "test", "validation": "valid", "valid": "valid", "train": "train"}


# ---------------------------------------------------------------------------------------------------------------
# WikiText articles
# ---------------------------------------------------------------------------------------------------------------


# The article rule lives in the package, shared with the benchmarks; ``utils.is_article_heading`` is its public name
# for task authors.
from distperp_harness.report.wikitext import (  # noqa: E402 - grouped with the section that uses it
    is_article_heading,  # noqa: F401 - re-exported for task authors
    split_wikitext_articles,
)


def wikitext_detokenizer(doc: dict[str, Any]) -> str:
    """The text the model scores: lm-eval's own ``wikitext_detokenizer``, so results compare with ``wikitext``."""
    from lm_eval.tasks.wikitext.preprocess_wikitext import wikitext_detokenizer as _detokenize

    return _detokenize(doc)


def doc_text(doc: dict[str, Any]) -> str:
    """The text the model scores for a local document: its ``text``, unchanged."""
    return doc["text"]


# ---------------------------------------------------------------------------------------------------------------
# Paths and files
# ---------------------------------------------------------------------------------------------------------------


def _configured_path(metadata_key: str, value: Any, env_var: str) -> tuple[Path, str] | None:
    """The path from ``--metadata`` (first) or the environment, made absolute against the current directory."""
    if value not in (None, ""):
        source = f"--metadata {metadata_key}"
    elif os.environ.get(env_var):
        value, source = os.environ[env_var], f"${env_var}"
    else:
        return None
    if not isinstance(value, (str, os.PathLike)):
        raise InputError(f"{source} must be a path string, got {value!r}")
    if metadata_key == "wikitext_path" and value == SAMPLE:
        from distperp_harness.commands.tiny import sample_text_path

        return sample_text_path(), f"{source} {SAMPLE} (the sample packaged with distperp)"
    path = Path(value).expanduser()
    if not path.is_absolute():
        path = Path.cwd() / path
    return path, source


def read_utf8(path: Path, source: str, *, newline: str | None = None) -> str:
    """Read a whole text file, turning every failure into one error that names the path.

    Raises:
        FileNotFoundError: the path does not exist.
        ValueError: it is a folder, unreadable, or not UTF-8.
    """
    try:
        with open(path, encoding="utf-8", newline=newline) as f:
            return f.read()
    except FileNotFoundError:
        raise MissingInput(f"{path} (from {source}) does not exist") from None
    except IsADirectoryError:
        raise InputError(f"{path} (from {source}) is a folder where a file was expected") from None
    except UnicodeDecodeError as e:
        raise InputError(
            f"{path} (from {source}) is not UTF-8 text: invalid byte at offset {e.start}; convert it with "
            f"e.g. `iconv -t UTF-8`"
        ) from None
    except OSError as e:
        raise InputError(f"{path} (from {source}) cannot be read: {e.strerror or e}") from None


def wikitext_candidates(folder: Path, dataset: str, split: str) -> list[Path]:
    """Files that may hold ``split`` of ``dataset`` (``wikitext-2`` / ``wikitext-103``) in ``folder``, in order.

    First the folder itself (``wiki.{s}.raw``, ``wiki.{s}.tokens``, ``{s}.txt``), then the sub-folders of the
    official releases (``{dataset}-raw/wiki.{s}.raw``, ``{dataset}/wiki.{s}.tokens``, ``{dataset}/{s}.txt``), where
    ``s`` is ``test``, ``valid`` or ``train``.
    """
    s = _FILE_SPLIT.get(split, split)
    return [
        folder / f"wiki.{s}.raw",
        folder / f"wiki.{s}.tokens",
        folder / f"{s}.txt",
        folder / f"{dataset}-raw" / f"wiki.{s}.raw",
        folder / dataset / f"wiki.{s}.tokens",
        folder / dataset / f"{s}.txt",
    ]


def _wikitext_file(path: Path, source: str, dataset: str, split: str) -> Path:
    """The file to read for ``dataset``/``split``: ``path`` itself, or the first candidate in the folder."""
    if not path.exists():
        raise MissingInput(f"{path} (from {source}) does not exist")
    if path.is_dir():
        candidates = wikitext_candidates(path, dataset, split)
        found = next((c for c in candidates if c.is_file()), None)
        if found is None:
            tried = ", ".join(str(c.relative_to(path)) for c in candidates)
            raise InputError(f"{path} (from {source}) holds no {dataset} {split} file; looked for: {tried}")
        path = found
    _warn_on_suspicious_name(path, dataset, split)
    return path


def _warn_on_suspicious_name(file: Path, dataset: str, split: str) -> None:
    """Warn when the file's path names the other split or the other WikiText (one path serves every task)."""
    wanted = _FILE_SPLIT.get(split, split)
    other = {"test": "valid", "valid": "test"}.get(wanted)
    if other and other in file.name and wanted not in file.name:
        logger.warning(f"distperp: the {split} split of {dataset} is read from {file}, whose name says {other}")
    other_dataset = "wikitext-103" if dataset == "wikitext-2" else "wikitext-2"
    if _path_names(file, other_dataset) and not _path_names(file, dataset):
        logger.warning(f"distperp: {dataset} is read from {file}, whose path says {other_dataset}")


def _path_names(file: Path, dataset: str) -> bool:
    return re.search(rf"{re.escape(dataset)}(?!\d)", str(file)) is not None


def _to_dataset_dict(split: str, column: str, texts: list[str], extra: dict[str, list] | None = None):
    import datasets

    data = {column: texts, **(extra or {})}
    return datasets.DatasetDict({split: datasets.Dataset.from_dict(data)})


# ---------------------------------------------------------------------------------------------------------------
# custom_dataset loaders (lm-eval calls them with **metadata, **dataset_kwargs)
# ---------------------------------------------------------------------------------------------------------------


def _check_keys(task_keys: str | tuple[str, ...], given: dict[str, Any]) -> None:
    """A key of lm-eval's metadata that looks like a misspelling of one of ``task_keys`` is refused in one line
    (:func:`distperp_harness.options.metadata_key_error`, the rule the start-up hook applies before lm-eval indexes
    its tasks; here for a run that did not come through lm-eval's command line)."""
    from distperp_harness.options import metadata_key_error

    problem = metadata_key_error((task_keys,) if isinstance(task_keys, str) else task_keys, given)
    if problem:
        raise InputError(problem, same_on_every_rank=True)


def _from_hub(hub_path: str, hub_name: str):
    """The hub dataset (as lm-eval's ``wikitext``); where it cannot be reached (offline, not in the datasets cache)
    an :class:`InputError` naming the local option instead of datasets' ``ConnectionError``."""
    import datasets

    try:
        return datasets.load_dataset(path=hub_path, name=hub_name)
    except OSError as exc:  # ConnectionError (offline, no network), a dataset not found
        raise InputError(
            f"no local WikiText file was given, and {hub_path} ({hub_name}) could not be read from the Hugging Face "
            f'hub: {exc}. Fix: give a local WikiText file or folder with --metadata \'{{"wikitext_path": "PATH"}}\' '
            f"or ${WIKITEXT_PATH_ENV}=PATH (wikitext_path=sample: the sample packaged with distperp), or go online "
            "once so that datasets caches it.",
            same_on_every_rank=True,
        ) from exc


def load_wikitext(
    *,
    hub_path: str,
    hub_name: str,
    split: str,
    wikitext_path: str | None = None,
    **_ignored: Any,
):
    """Documents of one WikiText split: ``{split: Dataset}`` with a ``page`` column, one article per row.

    Args:
        hub_path, hub_name: the hub dataset and config (``EleutherAI/wikitext_document_level``,
            ``wikitext-2-raw-v1``), used when no local path is configured.
        split: ``"test"`` or ``"validation"``.
        wikitext_path: a WikiText file (``wiki.test.raw``, ``test.txt``, ``wiki.test.tokens``: used as given, for
            whatever split the task evaluates) or a folder searched by :func:`wikitext_candidates`; falls back to
            ``$DISTPERP_WIKITEXT_PATH``.
        _ignored: the rest of lm-eval's metadata (model args, task version), not used.
    """
    _check_keys("wikitext_path", _ignored)
    configured = _configured_path("wikitext_path", wikitext_path, WIKITEXT_PATH_ENV)
    if configured is None:
        return _from_hub(hub_path, hub_name)
    dataset = "wikitext-103" if "103" in hub_name else "wikitext-2"
    file = _wikitext_file(*configured, dataset=dataset, split=split)
    articles = split_wikitext_articles(read_utf8(file, configured[1]))
    if not any(a.strip() for a in articles):
        raise InputError(f"{file} (from {configured[1]}) holds no text")
    logger.info(f"distperp: {dataset} {split}: {len(articles)} articles from {file}")
    return _to_dataset_dict(split, "page", articles)


def _docs_from_jsonl(path: Path, source: str) -> list[tuple[str, str]]:
    from distperp_harness.report.jsonl import jsonl_documents

    text = read_utf8(path, source)
    return [(doc, f"{path}:{n}") for doc, n in jsonl_documents(text, lambda n: f"{path}:{n} (from {source})")]


def read_local_docs(path: Path, source: str) -> list[tuple[str, str]]:
    """``(text, origin)`` of every document under ``path``, sorted by file path.

    A ``.txt`` file is one document, read exactly (no newline translation); a ``.jsonl`` file holds one document
    per line in its ``text`` field. ``path`` may be one such file or a folder searched recursively (hidden
    entries skipped). Blank documents are skipped with a warning.
    """
    if not path.exists():
        raise MissingInput(f"{path} (from {source}) does not exist")
    if path.is_dir():
        files = sorted(
            p
            for p in path.rglob("*")
            if p.suffix in (".txt", ".jsonl")
            and p.is_file()
            and not any(part.startswith(".") for part in p.relative_to(path).parts)
        )
        if not files:
            raise InputError(f"{path} (from {source}) holds no .txt or .jsonl files")
    elif path.suffix in (".txt", ".jsonl"):
        files = [path]
    else:
        raise InputError(f"{path} (from {source}) is neither a folder nor a .txt or .jsonl file")
    docs: list[tuple[str, str]] = []
    for file in files:
        if file.suffix == ".jsonl":
            docs.extend(_docs_from_jsonl(file, source))
        else:
            docs.append((read_utf8(file, source, newline=""), str(file)))
    kept = [(text, origin) for text, origin in docs if text.strip()]
    if len(kept) < len(docs):
        logger.warning(f"distperp: skipped {len(docs) - len(kept)} blank document(s) under {path}")
    if not kept:
        raise InputError(f"{path} (from {source}) holds no non-blank documents")
    return kept


def load_local_docs(*, split: str = "test", docs_path: str | None = None, **_ignored: Any):
    """``{split: Dataset}`` with ``text`` and ``source`` columns from ``docs_path`` or ``$DISTPERP_DOCS_PATH``."""
    _check_keys("docs_path", _ignored)
    configured = _configured_path("docs_path", docs_path, DOCS_PATH_ENV)
    if configured is None:
        raise InputError(
            'distperp_local_docs needs documents: pass --metadata \'{"docs_path": "FOLDER"}\' or set '
            f'${DOCS_PATH_ENV} (a folder of .txt files, one document each, and/or .jsonl files with a "text" field)'
        )
    docs = read_local_docs(*configured)
    logger.info(f"distperp: {len(docs)} local documents from {configured[0]}")
    return _to_dataset_dict(split, "text", [t for t, _ in docs], {"source": [o for _, o in docs]})


# ---------------------------------------------------------------------------------------------------------------
# Long-context tasks: distperp_longdocs, distperp_needle, distperp_needle_gen (local files only)
# ---------------------------------------------------------------------------------------------------------------

from distperp_harness.options import LONGDOCS_KEYS, NEEDLE_KEYS  # noqa: E402 - the keys these loaders read


def _long_context_source(task: str, docs_path: Any, wikitext_path: Any) -> tuple[str, Path, str]:
    """Which local text a long-context task reads: ``("docs" | "wikitext", path, source)``.

    ``--metadata`` keys win over the environment; giving both ``docs_path`` and ``wikitext_path`` at the same level
    is refused. Nothing given: an :class:`InputError` that names both options (these tasks never go to the hub).
    """
    given = [k for k, v in (("docs_path", docs_path), ("wikitext_path", wikitext_path)) if v not in (None, "")]
    if len(given) == 2:
        raise InputError(
            f"{task} reads one source, but --metadata gives both docs_path={docs_path!r} and "
            f"wikitext_path={wikitext_path!r}. Fix: drop one of them",
            same_on_every_rank=True,
        )
    if not given:
        given = [
            k for k, env in (("docs_path", DOCS_PATH_ENV), ("wikitext_path", WIKITEXT_PATH_ENV)) if os.environ.get(env)
        ]
        if len(given) == 2:
            raise InputError(
                f"{task} reads one source, but both ${DOCS_PATH_ENV} and ${WIKITEXT_PATH_ENV} are set. Fix: unset "
                'one, or choose with --metadata \'{"docs_path": "PATH"}\' or \'{"wikitext_path": "PATH"}\'',
                same_on_every_rank=True,
            )
    if not given:
        raise InputError(
            f'{task} needs local text: pass --metadata \'{{"wikitext_path": "PATH"}}\' (a WikiText file or folder; '
            f'"sample": the sample packaged with distperp) or \'{{"docs_path": "FOLDER"}}\' (your .txt / .jsonl '
            f"documents), or set ${WIKITEXT_PATH_ENV} or ${DOCS_PATH_ENV}",
            same_on_every_rank=True,
        )
    if given[0] == "docs_path":
        configured = _configured_path("docs_path", docs_path, DOCS_PATH_ENV)
    else:
        configured = _configured_path("wikitext_path", wikitext_path, WIKITEXT_PATH_ENV)
    assert configured is not None
    return given[0].split("_")[0], *configured


def read_wikitext_articles(path: Path, source: str, split: str = "test") -> tuple[list[str], Path]:
    """The raw articles of a local WikiText file (or of the ``split`` file found in a folder: WikiText-2's
    candidates first, then WikiText-103's; their test and validation sets are the same text) and the file read."""
    if not path.exists():
        raise MissingInput(f"{path} (from {source}) does not exist")
    file = path
    if path.is_dir():
        candidates = list(
            dict.fromkeys(
                wikitext_candidates(path, "wikitext-2", split) + wikitext_candidates(path, "wikitext-103", split)
            )
        )
        found = next((c for c in candidates if c.is_file()), None)
        if found is None:
            tried = ", ".join(str(c.relative_to(path)) for c in candidates)
            raise InputError(f"{path} (from {source}) holds no WikiText {split} file; looked for: {tried}")
        file = found
    articles = [a for a in split_wikitext_articles(read_utf8(file, source)) if a.strip()]
    if not articles:
        raise InputError(f"{file} (from {source}) holds no text")
    return articles, file


def load_longdocs(
    *,
    split: str = "test",
    docs_path: str | None = None,
    wikitext_path: str | None = None,
    min_chars: Any = None,
    **_ignored: Any,
):
    """``distperp_longdocs``: ``{split: Dataset}`` of long documents for rolling perplexity.

    ``docs_path`` (or ``$DISTPERP_DOCS_PATH``): your documents, one per ``.txt`` file or ``.jsonl`` line, scored as
    written (``text`` and ``source`` columns, as ``distperp_local_docs``). ``wikitext_path`` (or
    ``$DISTPERP_WIKITEXT_PATH``; ``sample``: the packaged sample): the file's articles joined, in order, into
    documents of at least ``min_chars`` characters (default 131,072; :func:`join_to_length`), in a ``page``
    column scored through lm-eval's WikiText detokenizer, with ``source`` naming the file and article range.
    """
    from distperp_harness.report.longcontext import DEFAULT_MIN_CHARS, join_to_length, positive_int

    _check_keys(LONGDOCS_KEYS, _ignored)
    min_chars = positive_int("min_chars", DEFAULT_MIN_CHARS if min_chars is None else min_chars)
    kind, path, source = _long_context_source("distperp_longdocs", docs_path, wikitext_path)
    if kind == "docs":
        docs = read_local_docs(path, source)
        short = sum(len(t) < min_chars for t, _ in docs)
        logger.info(f"distperp: {len(docs)} long documents from {path} ({short} shorter than min_chars={min_chars})")
        return _to_dataset_dict(split, "text", [t for t, _ in docs], {"source": [o for _, o in docs]})
    articles, file = read_wikitext_articles(path, source, split)
    pages = join_to_length(articles, min_chars)
    origins, first = [], 0
    for page in pages:
        count = len(split_wikitext_articles(page))
        origins.append(f"{file} articles {first + 1}-{first + count} of {len(articles)}")
        first += count
    if len(pages[-1]) < min_chars:
        logger.warning(
            f"distperp: {file} holds {len(pages[-1]):,} characters, fewer than min_chars={min_chars:,}: "
            "distperp_longdocs scores it as one shorter document"
        )
    logger.info(f"distperp: {len(pages)} long documents of >= {min_chars:,} characters from {file}")
    return _to_dataset_dict(split, "page", pages, {"source": origins})


def longdoc_text(doc: dict[str, Any]) -> str:
    """The text the model scores for a long document: lm-eval's WikiText detokenizer on a joined ``page``, a local
    document's ``text`` unchanged."""
    return wikitext_detokenizer(doc) if "page" in doc else doc["text"]


def needle_settings(metadata: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments of :func:`~distperp_harness.report.longcontext.needle_docs` from ``--metadata``
    (``context_chars``, ``depths``, ``docs_per_depth``, ``seed``, ``n_choices``, ``digits``), defaults for the keys
    not given; a value out of range is an :class:`InputError` naming its key."""
    from distperp_harness.report import longcontext as lc

    def given(key: str, default: Any) -> Any:
        value = metadata.get(key)
        return default if value is None else value

    return {
        "context_chars": lc.positive_int("context_chars", given("context_chars", lc.DEFAULT_CONTEXT_CHARS)),
        "depths": lc.depths_percent(given("depths", list(lc.DEFAULT_DEPTHS))),
        "docs_per_depth": lc.positive_int("docs_per_depth", given("docs_per_depth", lc.DEFAULT_DOCS_PER_DEPTH)),
        "seed": lc.positive_int("seed", given("seed", lc.DEFAULT_SEED), minimum=0),
        "n_choices": lc.positive_int("n_choices", given("n_choices", lc.DEFAULT_CHOICES), minimum=2, maximum=20),
        "digits": lc.positive_int("digits", given("digits", lc.DEFAULT_DIGITS), minimum=4, maximum=18),
    }


def load_needle(
    *, split: str = "test", docs_path: str | None = None, wikitext_path: str | None = None, **metadata: Any
):
    """``distperp_needle`` / ``distperp_needle_gen``: ``{split: Dataset}`` of needle documents
    (:func:`distperp_harness.report.longcontext.needle_docs`; one row per document, depth-major).

    The filler is ``docs_path``'s documents as written, or ``wikitext_path``'s articles through lm-eval's WikiText
    detokenizer, joined with blank lines. ``metadata``: the settings of :func:`needle_settings` (defaults:
    ``context_chars`` 100,000, ``depths`` [0, 25, 50, 75, 100], ``docs_per_depth`` 4, ``seed`` 1234, ``n_choices``
    4, ``digits`` 7); the rest of lm-eval's metadata is not used.
    """
    from distperp_harness.report import longcontext as lc

    _check_keys(NEEDLE_KEYS, metadata)
    settings = needle_settings(metadata)
    kind, path, source = _long_context_source("distperp_needle", docs_path, wikitext_path)
    if kind == "docs":
        texts = [t for t, _ in read_local_docs(path, source)]
    else:
        articles, path = read_wikitext_articles(path, source, split)
        texts = [wikitext_detokenizer({"page": a}) for a in articles]
    total = sum(len(t) for t in texts)
    if total < settings["context_chars"]:
        logger.warning(
            f"distperp: {path} holds {total:,} characters, fewer than context_chars={settings['context_chars']:,}: "
            "the needle's filler repeats it"
        )
    docs = lc.needle_docs(texts, **settings)
    logger.info(
        f"distperp: {len(docs)} needle documents ({len(settings['depths'])} depths x {settings['docs_per_depth']}) "
        f"of {settings['context_chars']:,} characters of filler from {path}"
    )
    import datasets

    return datasets.DatasetDict({split: datasets.Dataset.from_dict(lc.as_columns(docs))})


def needle_prompt(doc: dict[str, Any]) -> str:
    """The filler with the needle, then the question (ends with ``"Answer:"``)."""
    return doc["prompt"]


def needle_choices(doc: dict[str, Any]) -> list[str]:
    """The candidate numbers (lm-eval puts its ``target_delimiter``, a space, before each)."""
    return list(doc["choices"])


def by_depth(name: str, value: float, depth: float) -> dict[str, float | None]:
    """``<name>_depth_<percent>`` for each default depth (the YAMLs' per-depth metrics): ``value`` at the
    document's depth, ``None`` (skipped by :func:`mean_present`) at the others. Every document gives every key:
    lm-eval gathers each rank's values per key and fails on a key one rank lacks. Other depths are in ``name``
    and in the samples (``doc.depth``)."""
    from distperp_harness.report.longcontext import DEFAULT_DEPTHS, depth_label

    return {f"{name}_depth_{depth_label(d)}": (value if d == float(depth) else None) for d in DEFAULT_DEPTHS}


def mean_present(values: list[float | None]) -> float:
    """The mean of the values that are not ``None`` (a per-depth metric over that depth's documents); NaN when
    no document has that depth."""
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else float("nan")


def needle_mc_results(doc: dict[str, Any], results: list[Any]) -> dict[str, float | None]:
    """``acc`` (the right number has the highest log-likelihood; ties go to the first, as lm-eval's ``acc``) and
    per default depth (:func:`by_depth`)."""
    lls = [float(r[0]) if isinstance(r, (tuple, list)) else float(r) for r in results]
    acc = float(max(range(len(lls)), key=lls.__getitem__) == doc["label"])
    return {"acc": acc, **by_depth("acc", acc, doc["depth"])}


def needle_gen_results(doc: dict[str, Any], results: list[str]) -> dict[str, float | None]:
    """``exact_match``: the first number in the generated answer is the needle's number; and per default depth
    (:func:`by_depth`)."""
    from distperp_harness.report.longcontext import first_number

    match = float(first_number(results[0]) == doc["answer"])
    return {"exact_match": match, **by_depth("exact_match", match, doc["depth"])}


# ---------------------------------------------------------------------------------------------------------------
# process_results
# ---------------------------------------------------------------------------------------------------------------


def original_text(doc: dict[str, Any]) -> str:
    """The document as stored (WikiText ``page`` or local ``text``), before any detokenization."""
    return doc["page"] if "page" in doc else doc["text"]


def count_words(text: str) -> int:
    """Words as lm-eval's ``wikitext`` counts them: ``len(re.split(r"\\s+", text))`` on the original text."""
    return len(re.split(r"\s+", text))


def count_bytes(text: str) -> int:
    """UTF-8 bytes of the original text, as lm-eval's ``wikitext``."""
    return len(text.encode("utf-8"))


def process_results(doc: dict[str, Any], results: list[Any]) -> dict[str, Any]:
    """Per-document items for the aggregations in :mod:`distperp_harness.report.metrics`.

    ``results`` holds one rolling log-likelihood: a :class:`~distperp_harness.report.results.Score` from
    ``--model distperp`` or a plain float from other backends. Always returned: ``token_perplexity`` and
    ``n_tokens`` (token count ``None`` for a plain float), ``word_perplexity``, ``byte_perplexity``,
    ``bits_per_byte``. With a reference model also ``kl_divergence``, ``kl_p99``, ``kl_max``, ``top1_agreement``,
    ``ref_token_perplexity`` and ``ln_ppl_ratio``; without one these keys are absent, so lm-eval prints no row.
    """
    (result,) = results
    loglikelihood = float(result)
    text = original_text(doc)
    words, n_bytes = count_words(text), count_bytes(text)
    n_tokens = n_tokens_of(result)
    items: dict[str, Any] = {
        "token_perplexity": (loglikelihood, n_tokens),
        "word_perplexity": (loglikelihood, words),
        "byte_perplexity": (loglikelihood, n_bytes),
        "bits_per_byte": (loglikelihood, n_bytes),
        "n_tokens": n_tokens,
    }
    kl = getattr(result, "kl", None)
    if kl is None:
        return items
    if len(kl) != n_tokens:
        raise ValueError(f"a Score carries {len(kl)} KL values for {n_tokens} scored tokens")
    if result.ref_loglikelihood is None or result.top1_agree is None:
        raise ValueError("a Score with KL values must also carry ref_loglikelihood and top1_agree")
    ref_loglikelihood = float(result.ref_loglikelihood)
    items.update(
        {
            "kl_divergence": (math.fsum(kl), n_tokens),
            "kl_p99": [float(x) for x in kl],  # JSON numbers in --log_samples (an array would be its repr)
            "kl_max": float(kl.max()) if len(kl) else None,
            "top1_agreement": (result.top1_agree, n_tokens),
            "ref_token_perplexity": (ref_loglikelihood, n_tokens),
            "ln_ppl_ratio": (loglikelihood, ref_loglikelihood, n_tokens),
        }
    )
    return items
