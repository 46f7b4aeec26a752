"""Tokenization with lm-eval ``hf``'s rules (parity): special tokens, the BOS-prefix check, the prefix token.

A mixin for :class:`~distperp_harness.lm.DistPerpLM`, which provides ``tokenizer`` and ``options``. Within a
request call (``_encoded`` set to a dict), each distinct string is encoded once (TemplateLM encodes a context again
for every answer of a question), and :meth:`Tokenization.pre_encode` encodes the strings a call will ask for in
batches first (:func:`~distperp_harness.planning.encoding.encode_many`): ``tok_encode`` then reads them.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from typing import Any, Iterable, Iterator

from lm_eval.models.utils import _add_special_kwargs, has_bos_prefix

from distperp_harness.errors import InputError
from distperp_harness.options import Options
from distperp_harness.planning.encoding import encode_many


class Tokenization:
    """``tok_encode`` / ``tok_decode`` / ``eot_token_id`` / ``prefix_token_id`` for lm-eval's ``TemplateLM``."""

    _encoded: dict | None = None
    _kept: dict | None = None
    tokenizer: Any  # a Hugging Face tokenizer, set by the class that mixes this in
    options: Options

    def tok_encode(
        self, string: str, add_special_tokens: bool | None = None, left_truncate_len: int | None = None, **kwargs
    ) -> list[int]:
        """Token ids of ``string``, with lm-eval ``hf``'s rules for special tokens (parity)."""
        memo = self._encoded
        key = (string, add_special_tokens, left_truncate_len)
        if memo is not None and key in memo and not kwargs:
            return list(memo[key])
        encoding = self.tokenizer.encode(string, **self._special(string, add_special_tokens))
        encoding = encoding[-left_truncate_len:] if left_truncate_len else encoding
        if memo is not None and not kwargs:
            memo[key] = tuple(encoding)
        return encoding

    def _special(self, string: str, add_special_tokens: bool | None, prefix_text: str | None = None) -> dict:
        """lm-eval hf's special-token keywords for ``string`` (``prefix_text``: the prefix token's text, when the
        caller decoded it already)."""
        special = _add_special_kwargs(add_special_tokens, self.options.add_bos_token)
        if prefix_text is None:
            prefix_text = self.tokenizer.decode(self.prefix_token_id)
        if add_special_tokens is None and has_bos_prefix(string, prefix_text):
            special["add_special_tokens"] = False
        return special

    @contextlib.contextmanager
    def one_call(self) -> Iterator[None]:
        """The memo of one request call: every string encoded once (:meth:`pre_encode`), nothing kept after (unless
        :meth:`keep_encodings` gave a memo to keep)."""
        self._encoded = self._kept if self._kept is not None else {}
        try:
            yield
        finally:
            self._encoded = None

    def keep_encodings(self, memo: dict) -> None:
        """Use ``memo`` as every request call's memo, kept across calls and across models (in-process callers that
        evaluate several models, ``series``): a string encoded for one model is read back for the next. Share a
        memo only between models whose :meth:`encoding_key` is equal: the ids are then the ones an encode gives."""
        self._kept = memo

    def encoding_key(self) -> str:
        """A content hash of everything :meth:`tok_encode` depends on: the tokenizer's class and pipeline (a fast
        tokenizer's whole JSON; a slow one's vocabulary, sentencepiece model and settings), its special tokens,
        ``add_bos_token`` (the tokenizer's and the option) and the prefix token. Names and paths are not in it:
        two folders with the same tokenizer files have the same key."""
        tok = self.tokenizer
        backend = getattr(tok, "backend_tokenizer", None)
        if backend is not None:
            body = backend.to_str()
        else:
            proto = getattr(getattr(tok, "sp_model", None), "serialized_model_proto", None)
            body = json.dumps(sorted(tok.get_vocab().items())) + (proto().hex() if proto is not None else "")
            body += json.dumps(getattr(tok, "init_kwargs", {}), sort_keys=True, default=str)
        parts = [
            type(tok).__name__,
            body,
            json.dumps(tok.special_tokens_map, sort_keys=True, default=str),
            repr((getattr(tok, "add_bos_token", None), getattr(tok, "add_eos_token", None))),
            repr((self.options.add_bos_token, self.prefix_token_id)),
        ]
        return hashlib.sha256("\x00".join(parts).encode("utf-8")).hexdigest()

    def pre_encode(self, keys: Iterable[tuple[str, bool | None]]) -> None:
        """Encode each distinct ``(string, add_special_tokens)`` into the call's memo, a batch per special-token
        rule; :meth:`tok_encode` of the same arguments then returns them (the same ids: one encode each would)."""
        memo = self._encoded
        if memo is None:
            return
        groups: dict[tuple, dict[str, None]] = {}
        prefix_text = self.tokenizer.decode(self.prefix_token_id)
        for string, add in keys:
            if (string, add, None) not in memo:
                rule = (add, tuple(sorted(self._special(string, add, prefix_text).items())))
                groups.setdefault(rule, {})[string] = None
        for (add, special), strings in groups.items():
            for string, ids in zip(strings, encode_many(self.tokenizer, list(strings), **dict(special))):
                memo[(string, add, None)] = tuple(ids)

    def tok_decode(self, tokens, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        if self.options.prefix_token_id is not None:
            return self.options.prefix_token_id
        if self.tokenizer.bos_token_id is not None:
            return self.tokenizer.bos_token_id
        if self.tokenizer.eos_token_id is not None:
            return self.tokenizer.eos_token_id
        raise InputError(
            "the tokenizer has neither a BOS nor an EOS token, so there is no token to condition the "
            "first token on. Fix: pass prefix_token_id=<id> in --model_args."
        )


def loglikelihood_strings(args: Iterable[tuple[str, str]]) -> Iterable[tuple[str, bool | None]]:
    """The ``tok_encode`` arguments lm-eval's ``TemplateLM.loglikelihood`` asks for, per ``(context, continuation)``:
    an empty context encodes the continuation without special tokens; otherwise trailing spaces of the context move
    to the continuation (``_encode_pair``) and both the whole text and the context are encoded. (Strings lm-eval
    asks for that this does not list are simply encoded one by one.)"""
    for context, continuation in args:
        if context == "":
            yield continuation, False
            continue
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        yield context + continuation, None
        yield context, None
