"""Batched tokenization: many strings through one call of a fast tokenizer, the same ids as one ``encode`` each.

A fast (Rust) tokenizer encodes a batch in one call, on every core unless ``TOKENIZERS_PARALLELISM=false``; a
Python loop of ``encode`` pays the call's overhead per string and uses one core. lm-eval tokenizes request by
request; distperp collects the strings a call will need and encodes them here first (``Tokenization.pre_encode``,
generation's ``local_jobs``).
"""

from __future__ import annotations

from typing import Any, Sequence

CHUNK = 1024
"""Strings per tokenizer call (bounds the batch's transient memory)."""


def encode_many(tokenizer: Any, strings: Sequence[str], **special: Any) -> list[list[int]]:
    """Token ids of each string, equal to ``tokenizer.encode(string, **special)``; a slow tokenizer encodes them one
    by one."""
    if not getattr(tokenizer, "is_fast", False):
        return [tokenizer.encode(s, **special) for s in strings]
    out: list[list[int]] = []
    for start in range(0, len(strings), CHUNK):
        batch = list(strings[start : start + CHUNK])
        out += [list(ids) for ids in tokenizer(batch, **special)["input_ids"]]
    return out
