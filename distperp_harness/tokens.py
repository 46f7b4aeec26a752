"""Tokenization with lm-eval ``hf``'s rules (parity): special tokens, the BOS-prefix check, the prefix token.

A mixin for :class:`~distperp_harness.lm.DistPerpLM`, which provides ``tokenizer`` and ``options``. Within a
``loglikelihood`` call (``_encoded`` set to a dict), each distinct string is encoded once: TemplateLM encodes a
context again for every answer of a question.
"""

from __future__ import annotations

from lm_eval.models.utils import _add_special_kwargs, has_bos_prefix

from distperp_harness.errors import InputError


class Tokenization:
    """``tok_encode`` / ``tok_decode`` / ``eot_token_id`` / ``prefix_token_id`` for lm-eval's ``TemplateLM``."""

    _encoded: dict | None = None

    def tok_encode(
        self, string: str, add_special_tokens: bool | None = None, left_truncate_len: int | None = None, **kwargs
    ) -> list[int]:
        """Token ids of ``string``, with lm-eval ``hf``'s rules for special tokens (parity)."""
        memo = self._encoded
        key = (string, add_special_tokens, left_truncate_len)
        if memo is not None and key in memo and not kwargs:
            return list(memo[key])
        special = _add_special_kwargs(add_special_tokens, self.options.add_bos_token)
        if add_special_tokens is None and has_bos_prefix(string, self.tokenizer.decode(self.prefix_token_id)):
            special["add_special_tokens"] = False
        encoding = self.tokenizer.encode(string, **special)
        encoding = encoding[-left_truncate_len:] if left_truncate_len else encoding
        if memo is not None and not kwargs:
            memo[key] = tuple(encoding)
        return encoding

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
