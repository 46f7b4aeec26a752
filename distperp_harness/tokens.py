"""Tokenization with lm-eval ``hf``'s rules (parity): special tokens, the BOS-prefix check, the prefix token.

A mixin for :class:`~distperp_harness.lm.DistPerpLM`, which provides ``tokenizer`` and ``options``. Within a
request call (``_encoded`` set to a dict), each distinct string is encoded once (TemplateLM encodes a context again
for every answer of a question), and :meth:`Tokenization.pre_encode` encodes the strings a call will ask for in
batches first (:func:`~distperp_harness.planning.encoding.encode_many`): ``tok_encode`` then reads them.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterable, Iterator

from lm_eval.models.utils import _add_special_kwargs, has_bos_prefix

from distperp_harness.errors import InputError
from distperp_harness.options import Options
from distperp_harness.planning.encoding import encode_many


class Tokenization:
    """``tok_encode`` / ``tok_decode`` / ``eot_token_id`` / ``prefix_token_id`` for lm-eval's ``TemplateLM``."""

    _encoded: dict | None = None
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
        """The memo of one request call: every string encoded once (:meth:`pre_encode`), nothing kept after."""
        self._encoded = {}
        try:
            yield
        finally:
            self._encoded = None

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
