"""The chat template, with ``chat_template_args`` / ``enable_thinking`` and a system role folded where a template
rejects it.

Contract of :func:`render_chat`: the tokenizer's ``apply_chat_template(history, tokenize=False, ...)`` with
lm-eval ``hf``'s arguments plus ``chat_kwargs``. When the template raises a ``jinja2`` ``TemplateError`` and the
history holds a system message, the system text is folded into the first user turn (``system + "\\n\\n" + user``)
and the template is applied again; ``hf`` drops the system message there instead, which loses the instruction.
Returns ``(text, folded)``; the caller logs a fold once. A history without a system message, or a template that
fails again, raises as it did.
"""

from __future__ import annotations

from typing import Any, Sequence


def fold_system(history: Sequence[dict[str, str]]) -> list[dict[str, str]]:
    """``history`` with its system messages joined into the first user turn (a user turn made if there is none)."""
    system = "\n\n".join(m["content"] for m in history if m["role"] == "system")
    rest = [dict(m) for m in history if m["role"] != "system"]
    for message in rest:
        if message["role"] == "user":
            message["content"] = f"{system}\n\n{message['content']}" if message["content"] else system
            return rest
    return [{"role": "user", "content": system}, *rest]


def render_chat(tokenizer: Any, history: Sequence[dict[str, str]], add_generation_prompt: bool,
                chat_kwargs: dict | None = None) -> tuple[str, bool]:
    """The templated text of ``history`` and whether the system role had to be folded (module doc)."""
    import jinja2

    kwargs = dict(tokenize=False, add_generation_prompt=add_generation_prompt,
                  continue_final_message=not add_generation_prompt, **(chat_kwargs or {}))
    try:
        return tokenizer.apply_chat_template(list(history), **kwargs), False
    except jinja2.exceptions.TemplateError:
        if not any(m["role"] == "system" for m in history):
            raise
    return tokenizer.apply_chat_template(fold_system(history), **kwargs), True
