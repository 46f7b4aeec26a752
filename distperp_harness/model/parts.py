"""Checks that each loaded part is whole and that the parts fit each other, made when they load (before scoring).

Each check raises an :class:`~distperp_harness.errors.InputError` (one line from the command line) that names the
file or value, what is allowed and the fix, instead of a long traceback while loading or an ``IndexError`` (or a
silently different score) while scoring. Every check reads only what every rank reads alike (the folder's file
names, safetensors headers, the config, the tokenizer and the embeddings' shape), so every rank of a launch raises
the same error (``same_on_every_rank=True``). None reads a weight: a safetensors header is a few kilobytes.

- :func:`check_weight_files`: each ``*.safetensors`` file of a local checkpoint (``model.safetensors``, or every
  shard named by ``model.safetensors.index.json``) exists and its header parses and covers the file;
  :func:`refuse_damaged` says the same of a damaged file the loader meets (a hub download's cached copy).
- :func:`check_tokenizer_files`: a local folder the tokenizer is loaded from holds tokenizer files.
- :func:`check_positions`: a ``max_length`` the user gave beyond the model's positions is warned about once.
- :func:`check_vocabulary` (:func:`check_fit`: every loaded model): the tokenizer's ids all index the model's
  input embeddings.
- :func:`check_chat_template`: ``--apply_chat_template`` asks a tokenizer that has a chat template.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from distperp_harness.errors import InputError, MissingInput

SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
    "tekken.json",
)
"""Files any of which makes a folder hold a tokenizer (with ``*.tiktoken``)."""

POSITION_KEYS = ("n_positions", "max_position_embeddings", "n_ctx")
"""Config keys of a model's positions, in the order lm-eval's ``resolve_max_length`` reads them (so a defaulted
``max_length`` is exactly this limit)."""


def _local_folder(source: str, subfolder: str | None = None) -> Path | None:
    """The local folder of ``source`` (with ``subfolder``), or ``None`` for a hub id."""
    folder = Path(os.path.expanduser(source))
    if not folder.is_dir():
        return None
    return folder / subfolder if subfolder else folder


def _check_header(path: Path, key: str, source: str, named_by: str = "") -> None:
    """``path`` exists and its safetensors header parses and covers the file (nothing else is read)."""
    from safetensors import safe_open

    if not path.is_file():
        raise MissingInput(
            f"{key}={source!r}: the weight file {path.name} named by {named_by} is missing. Fix: download or copy "
            "the whole checkpoint folder again (every file its index names).",
            same_on_every_rank=True,
        )
    try:
        with safe_open(str(path), framework="pt"):
            pass
    except Exception as exc:  # safetensors' SafetensorError (not an OSError): a file cut short or not safetensors
        raise InputError(
            f"{key}={source!r}: the weight file {path} is damaged (safetensors cannot read it: {exc}); a download "
            "or copy cut short leaves this. Fix: download or copy that file again (compare its size with the "
            "source's), or give another checkpoint.",
            same_on_every_rank=True,
        ) from None


def check_weight_files(source: str, key: str = "pretrained", subfolder: str | None = None) -> None:
    """Every safetensors weight file of the local checkpoint ``source`` is present and its header is whole.

    Reads ``model.safetensors``'s header, or (sharded) the index ``model.safetensors.index.json`` and each shard's
    header. A hub id, a checkpoint of other files (``pytorch_model.bin``, GGUF) or a folder without weights is
    left to the loader. Raises :class:`InputError` naming the file (``MissingInput`` for a missing shard).
    """
    folder = _local_folder(source, subfolder)
    if folder is None:
        return
    index = folder / SAFETENSORS_INDEX
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError, OSError) as exc:
            raise InputError(
                f"{key}={source!r}: {index} is not a safetensors index (JSON with a 'weight_map': {exc}). "
                "Fix: download or copy that file again.",
                same_on_every_rank=True,
            ) from None
        for shard in shards:
            _check_header(folder / shard, key, source, named_by=SAFETENSORS_INDEX)
    elif (folder / SAFETENSORS).is_file():
        _check_header(folder / SAFETENSORS, key, source)


def refuse_damaged(exc: BaseException, key: str, source: str) -> None:
    """Raise an :class:`InputError` for the loader's ``exc`` where it is safetensors' (a cached hub file cut
    short: local folders are checked by :func:`check_weight_files` first); else return (the caller re-raises)."""
    if type(exc).__name__ == "SafetensorError":
        raise InputError(
            f"could not load a causal LM from {key}={source!r}: a weight file is damaged ({exc}). Fix: download "
            "it again (e.g. huggingface-cli download --force-download), or give another checkpoint.",
            same_on_every_rank=True,
        ) from exc


def check_tokenizer_files(source: str, key: str, subfolder: str | None = None) -> None:
    """A local folder the tokenizer is loaded from holds at least one tokenizer file (:data:`TOKENIZER_FILES` or
    ``*.tiktoken``). A hub id, and a ``pretrained`` folder without a ``config.json`` (no model at all), are left
    to transformers. Raises :class:`InputError` saying how to name a tokenizer."""
    folder = _local_folder(source, subfolder)
    if folder is None or not folder.is_dir() or (key == "pretrained" and not (folder / "config.json").is_file()):
        return  # a hub id, or a folder that holds no model either: the loaders say what is wrong
    if any((folder / name).is_file() for name in TOKENIZER_FILES) or any(folder.glob("*.tiktoken")):
        return
    raise InputError(
        f"{key}={source!r}: no tokenizer files in {folder} (looked for tokenizer.json, tokenizer_config.json, "
        "vocab/merges files, a sentencepiece or tiktoken model). Fix: copy the model's tokenizer files into that "
        "folder, or pass tokenizer=<a folder or hub id holding them> in --model_args (e.g. the hub id the model "
        "came from).",
        same_on_every_rank=True,
    )


def _extends_positions(config: Any) -> bool:
    """Whether the config's rope scaling (any type but ``default``) may carry the model beyond its stored
    positions; then its positions are not a limit this check can trust."""
    for name in ("rope_scaling", "rope_parameters"):
        value = getattr(config, name, None)
        if not isinstance(value, dict):
            continue
        inner = [v for v in value.values() if isinstance(v, dict)]  # per layer type (e.g. Gemma 3)
        for params in inner or [value]:
            if params.get("rope_type", params.get("type")) not in (None, "default"):
                return True
    return False


def position_limit(config: Any) -> tuple[str, int] | None:
    """``(key, n)``: the config's position count (its ``text_config``'s for a composite model), or ``None`` where
    it has none or its rope scaling may extend it."""
    config = getattr(config, "text_config", None) or config
    for key in POSITION_KEYS:
        value = getattr(config, key, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return None if _extends_positions(config) else (key, value)
    return None


def position_warning(max_length: int | None, config: Any, key: str, source: str) -> str | None:
    """Why a ``max_length`` the user gave is more than the model's positions (:func:`position_limit`), with the
    number and the fix; ``None`` when it is within them, defaulted (the limit itself), or the config has no plain
    limit (rope scaling)."""
    limit = position_limit(config)
    if max_length is None or limit is None or max_length <= limit[1]:
        return None
    name, n = limit
    return (
        f"max_length={max_length} is more than {key}={source!r} has positions for: its config says {name}={n}, "
        f"so windows longer than that score positions the model never learned (a RoPE model's results change; "
        f"one with learned positions fails while scoring). Fix: max_length={n} (or leave max_length out: the "
        f"default is the model's limit)."
    )


_WARNED: set[str] = set()


def check_positions(max_length: int | None, config: Any, key: str, source: str) -> None:
    """Warn once (rank 0's log) when a ``max_length`` the user gave is beyond the model's positions
    (:func:`position_warning`): said, not refused, since a model may be evaluated past its positions on purpose
    (dry runs on small models, extrapolation studies)."""
    message = position_warning(max_length, config, key, source)
    if message is None or message in _WARNED:
        return
    _WARNED.add(message)
    from accelerate.logging import get_logger

    get_logger("distperp").warning(message, main_process_only=True)


def embedding_rows(model: Any) -> int:
    """Rows of the model's input embeddings (else its config's ``vocab_size``), or the columns of its output head
    where fewer (an id past them can be read but not scored)."""
    embeddings = model.get_input_embeddings()
    rows = int(getattr(embeddings, "num_embeddings", 0) or model.config.vocab_size)
    head = getattr(model, "get_output_embeddings", lambda: None)()
    columns = getattr(head, "out_features", None)
    return min(rows, columns) if isinstance(columns, int) and columns > 0 else rows


def check_vocabulary(tokenizer: Any, tokenizer_source: str, model: Any, key: str, source: str) -> None:
    """Every id a text can tokenize to indexes ``model``'s input embeddings: the base vocabulary
    (``tokenizer.vocab_size``) and every added token that is not a special token. Special tokens a conversion
    appends past the embeddings (GGUF's tokenizers gain a pad token) pass: they reach the model only as their
    literal in a text. A tokenizer with fewer ids than embedding rows is normal (padded embeddings) and passes."""
    size, rows = len(tokenizer), embedding_rows(model)
    if size <= rows:
        return
    base = int(getattr(tokenizer, "vocab_size", size) or size)
    special = set(getattr(tokenizer, "all_special_ids", ()) or ())
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    if base <= rows and all(i < rows or i in special or getattr(t, "special", False) for i, t in added.items()):
        return
    raise InputError(
        f"the tokenizer of {tokenizer_source!r} has {size} tokens (ids 0..{size - 1}), but {key}={source!r} "
        f"embeds and predicts only {rows} (ids 0..{rows - 1}): a text with a larger id could not be scored. Allowed: a "
        f"tokenizer of at most {rows} tokens. Fix: use the model's own tokenizer (drop tokenizer=, or pass "
        "tokenizer=<the folder or hub id the model was trained with>).",
        same_on_every_rank=True,
    )


def check_fit(options: Any, tokenizer: Any, model: Any, reference: Any = None) -> None:
    """After loading: the tokenizer's ids index the model's embeddings and the reference's, and the reference has
    the positions a given ``max_length`` needs (the model's were checked from its config before loading)."""
    named = options.tokenizer or options.pretrained
    check_vocabulary(tokenizer, named, model, "pretrained", options.pretrained)
    if reference is None:
        return
    own = options.reference not in ("base", "pretrained")  # else the reference is pretrained's checkpoint
    key, source = ("reference", options.reference) if own else ("pretrained", options.pretrained)
    check_vocabulary(tokenizer, named, reference, key, str(source))
    check_positions(options.max_length, getattr(reference, "config", None), key, str(source))


def check_chat_template(tokenizer: Any, tokenizer_source: str) -> None:
    """``--apply_chat_template`` needs a chat template in the tokenizer (``chat_template`` set)."""
    if getattr(tokenizer, "chat_template", None):
        return
    raise InputError(
        f"--apply_chat_template was given, but the tokenizer of {tokenizer_source!r} has no chat template (none "
        "in its tokenizer_config.json or chat_template.jinja). Fix: drop --apply_chat_template (a base model "
        "scores plain prompts), or pass tokenizer=<a tokenizer with the model's chat template> in --model_args.",
        same_on_every_rank=True,
    )
