"""Batched tokenization: many strings through one call of a fast tokenizer, the same ids as one ``encode`` each.

A fast (Rust) tokenizer encodes a batch in one call, on every core unless ``TOKENIZERS_PARALLELISM=false``; a
Python loop of ``encode`` pays the call's overhead per string and uses one core. lm-eval tokenizes request by
request; distperp collects the strings a call will need and encodes them here first (``Tokenization.pre_encode``,
generation's ``local_jobs``).

A few-shot block shared by a task's questions is tokenized once (:func:`shared_prefix_groups`,
:class:`PrefixSplit`): strings sharing a prefix of at least ``MIN_SHARED_CHARS`` characters are cut at a
pre-token boundary inside it, and each string's ids are the shared head's ids followed by the ids of its own tail,
encoded alone. That equals encoding the whole string only where tokens never cross pre-tokens and pre-tokens
depend on nothing before them: byte-level BPE with regex pre-tokenization and no normalizer (GPT-2, Llama 3, Qwen,
SmolLM), which :func:`local_pipeline` checks in the tokenizer's own configuration; every group is also checked
on samples against whole encodes, and any difference encodes the group whole.
"""

from __future__ import annotations

import json
import weakref
from dataclasses import dataclass
from typing import Any, Sequence

from distperp_harness.planning.rows import common_prefix_length as _common  # works on strings as on ids

CHUNK = 1024
"""Strings per tokenizer call (bounds the batch's transient memory)."""
MIN_SHARED_CHARS = 256
"""The shortest shared prefix worth tokenizing once."""
MIN_GROUP = 8
"""The fewest strings sharing a prefix worth it (the check encodes ``CHECKED`` of them whole)."""
CHECKED = 4

_LOCAL_PRE_TOKENIZERS = {"ByteLevel", "Split", "Digits"}


def encode_many(tokenizer: Any, strings: Sequence[str], **special: Any) -> list[list[int]]:
    """Token ids of each string, equal to ``tokenizer.encode(string, **special)``; a slow tokenizer encodes them one
    by one."""
    if not getattr(tokenizer, "is_fast", False):
        return [tokenizer.encode(s, **special) for s in strings]
    out: list[list[int] | None] = [None] * len(strings)
    if local_pipeline(tokenizer) is None:
        for members, shared in shared_prefix_groups(strings):
            split = PrefixSplit.find(tokenizer, [strings[i] for i in members], shared, special)
            if split is None:
                continue
            for i, ids in zip(members, split.encode([strings[i] for i in members])):
                out[i] = ids
    rest = [i for i, ids in enumerate(out) if ids is None]
    for i, ids in zip(rest, _batched(tokenizer, [strings[i] for i in rest], **special)):
        out[i] = ids
    return out  # type: ignore[return-value]  # every slot is filled above


def _batched(tokenizer: Any, strings: list[str], **special: Any) -> list[list[int]]:
    out: list[list[int]] = []
    for start in range(0, len(strings), CHUNK):
        out += [list(ids) for ids in tokenizer(strings[start : start + CHUNK], **special)["input_ids"]]
    return out


_VERDICTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def local_pipeline(tokenizer: Any) -> str | None:
    """:func:`read_pipeline`, once per tokenizer (its configuration is the whole vocabulary as JSON)."""
    try:
        return _VERDICTS[tokenizer]
    except KeyError:
        verdict = _VERDICTS[tokenizer] = read_pipeline(tokenizer)
        return verdict
    except TypeError:  # not weakly referable
        return read_pipeline(tokenizer)


def read_pipeline(tokenizer: Any) -> str | None:
    """None when ``tokenizer``'s ids of a string are its pre-tokens' ids, each pre-token found from the text at and
    after it (byte-level BPE, regex pre-tokenization without look-behind, no normalizer, special tokens only in
    front); else why not."""
    try:
        config = json.loads(tokenizer.backend_tokenizer.to_str())
    except (AttributeError, ValueError):
        return "no tokenizers configuration to read"
    if config.get("normalizer") is not None:
        return f"a {config['normalizer'].get('type')} normalizer"
    if (config.get("model") or {}).get("type") != "BPE" or config["model"].get("dropout"):
        return "not a deterministic BPE model"
    pre = config.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    for step in steps:
        if step.get("type") not in _LOCAL_PRE_TOKENIZERS or step.get("add_prefix_space"):
            return f"a {step.get('type')} pre-tokenizer" + (" adding a prefix space" if step.get("type") else "")
        if "(?<" in json.dumps(step.get("pattern")):
            return "a pre-tokenizer pattern with look-behind"
    post = config.get("post_processor") or {}
    single = post.get("single") or []
    if post.get("type") not in (None, "ByteLevel", "TemplateProcessing") or (single and "Sequence" not in single[-1]):
        return "special tokens after the text"
    return None


def shared_prefix_groups(
    strings: Sequence[str], min_chars: int | None = None, min_group: int | None = None
) -> list[tuple[list[int], int]]:
    """Groups of at least ``min_group`` strings (their indices) that share a prefix of at least ``min_chars``
    characters, with its length: neighbours in sorted order, joined while their common prefix is long enough
    (defaults: ``MIN_GROUP``, ``MIN_SHARED_CHARS`` as they are at the call)."""
    min_chars = MIN_SHARED_CHARS if min_chars is None else min_chars
    min_group = MIN_GROUP if min_group is None else min_group
    order = sorted(range(len(strings)), key=strings.__getitem__)
    groups: list[tuple[list[int], int]] = []
    members: list[int] = []
    shared = 0
    for index in order:
        if members:
            common = _common(strings[members[-1]], strings[index])
            if common >= min_chars:
                members.append(index)
                shared = min(shared, common)
                continue
            if len(members) >= min_group:
                groups.append((members, shared))
        members, shared = [index], len(strings[index])
    if len(members) >= min_group:
        groups.append((members, shared))
    return groups


@dataclass(frozen=True)
class PrefixSplit:
    """Strings cut at character ``cut`` (a pre-token boundary of their shared prefix): ``head`` is the ids of
    what comes before it, special tokens included; a string's ids are ``head`` + its tail's ids encoded alone."""

    tokenizer: Any
    head: tuple[int, ...]
    cut: int

    @classmethod
    def find(cls, tokenizer: Any, group: list[str], shared: int, special: dict) -> PrefixSplit | None:
        """The split of ``group`` (strings sharing ``shared`` characters) before the last two pre-tokens of the
        shared prefix (those may still grow into the text after it), :meth:`checked`; None when there is none."""
        pieces = tokenizer.backend_tokenizer.pre_tokenizer.pre_tokenize_str(group[0][:shared])
        return None if len(pieces) < 3 else cls.checked(tokenizer, group, pieces[-2][1][0], special)

    @classmethod
    def checked(cls, tokenizer: Any, group: list[str], cut: int, special: dict) -> PrefixSplit | None:
        """The split of ``group`` at ``cut``, checked against whole encodes of ``CHECKED`` of its strings (the
        shortest, the longest and others between); None when any differs."""
        by_length = sorted(group, key=len)
        step = max(1, (len(by_length) - 1) // (CHECKED - 1))
        sample = list(dict.fromkeys([*by_length[::step][: CHECKED - 1], by_length[-1]]))
        whole = _batched(tokenizer, sample, **special)
        tails = _batched(tokenizer, [s[cut:] for s in sample], add_special_tokens=False)
        head = tuple(whole[0][: len(whole[0]) - len(tails[0])])
        if any(list(head) + tail != ids for tail, ids in zip(tails, whole)):
            return None
        return cls(tokenizer, head, cut)

    def encode(self, strings: list[str]) -> list[list[int]]:
        head = list(self.head)
        return [
            head + tail for tail in _batched(self.tokenizer, [s[self.cut :] for s in strings], add_special_tokens=False)
        ]
