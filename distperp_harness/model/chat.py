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


def render_chat(
    tokenizer: Any, history: Sequence[dict[str, str]], add_generation_prompt: bool, chat_kwargs: dict | None = None
) -> tuple[str, bool]:
    """The templated text of ``history`` and whether the system role had to be folded (module doc)."""
    import jinja2

    kwargs = dict(
        tokenize=False,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=not add_generation_prompt,
        **(chat_kwargs or {}),
    )
    try:
        return tokenizer.apply_chat_template(list(history), **kwargs), False
    except jinja2.exceptions.TemplateError:
        if not any(m["role"] == "system" for m in history):
            raise
    return tokenizer.apply_chat_template(fold_system(history), **kwargs), True


class ChatTemplate:
    """The run's chat template: :func:`render_chat` with the run's ``chat_kwargs``; ``log`` (rank 0's warning)
    is called once, at the first fold. ``to_dict`` is what the results record."""

    def __init__(self, chat_kwargs: dict, think_end_token: Any, log: Any) -> None:
        self.chat_kwargs, self.think_end_token, self.log = chat_kwargs, think_end_token, log
        self.folded_system = False

    def __call__(self, tokenizer: Any, history: Sequence[dict[str, str]], add_generation_prompt: bool) -> str:
        text, folded = render_chat(tokenizer, history, add_generation_prompt, self.chat_kwargs)
        if folded and not self.folded_system:
            self.folded_system = True
            self.log(
                "distperp: the chat template rejects a system role; the system instruction is folded into the "
                "first user turn (lm-eval hf drops it)"
            )
        return text

    def to_dict(self) -> dict:
        return {
            "template_args": self.chat_kwargs,
            "folded_system": self.folded_system,
            "think_end_token": self.think_end_token,
        }
