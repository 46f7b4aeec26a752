"""The chat template: ``chat_template_args`` and ``enable_thinking`` reach it (the same text as lm-eval ``hf`` with
the same arguments), and a template that rejects a system role gets the instruction folded into the first user
turn (``hf`` drops it)."""

from __future__ import annotations

import pytest
from helpers import make_lm

from distperp_harness.model.chat import fold_system, render_chat

NO_SYSTEM = (
    "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% if enable_thinking is defined and not enable_thinking %}"
    "<think></think>{% endif %}{% if style is defined %}[{{ style }}]{% endif %}{% endif %}"
)
HISTORY = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is 2+2?"}]


@pytest.fixture(scope="module", autouse=True)
def accelerate_state():
    from accelerate import PartialState

    PartialState(cpu=True)


def test_fold_system_joins_the_instruction_to_the_first_user_turn():
    assert fold_system(HISTORY) == [{"role": "user", "content": "Answer briefly.\n\nWhat is 2+2?"}]
    assert fold_system([{"role": "system", "content": "S"}, {"role": "assistant", "content": "A"}]) == [
        {"role": "user", "content": "S"},
        {"role": "assistant", "content": "A"},
    ]


def test_a_template_that_rejects_system_gets_it_folded(tiny_tokenizer):
    import copy

    tokenizer = copy.deepcopy(tiny_tokenizer)  # the session fixture stays without a template
    tokenizer.chat_template = NO_SYSTEM
    text, folded = render_chat(tokenizer, HISTORY, True)
    assert folded and text == "<|user|>Answer briefly.\n\nWhat is 2+2?\n<|assistant|>"
    with pytest.raises(Exception, match="System role not supported"):
        tokenizer.apply_chat_template(HISTORY, tokenize=False)
    assert render_chat(tokenizer, HISTORY[1:], True) == ("<|user|>What is 2+2?\n<|assistant|>", False)


def test_template_arguments_reach_the_template_as_in_hf(tiny_model_dir):
    from lm_eval.api.registry import get_model
    from lm_eval.models.huggingface import HFLM

    args = {"enable_thinking": False, "think_end_token": "</think>", "chat_template_args": {"style": "terse"}}

    ours = get_model("distperp").create_from_arg_obj({"pretrained": str(tiny_model_dir), **args})
    hf = HFLM(pretrained=str(tiny_model_dir), device="cpu", batch_size=1, **args)
    for lm in (ours, hf):
        lm.tokenizer.chat_template = NO_SYSTEM
    history = HISTORY[1:]
    assert (
        ours.apply_chat_template(history)
        == hf.apply_chat_template(history)
        == "<|user|>What is 2+2?\n<|assistant|><think></think>[terse]"
    )
    assert ours.apply_chat_template(HISTORY).startswith("<|user|>Answer briefly.\n\n")  # hf: the instruction lost
    assert hf.apply_chat_template(HISTORY) == "<|user|>What is 2+2?\n<|assistant|><think></think>[terse]"
    chat = ours.get_model_info()["distperp"]["chat"]
    assert chat == {
        "template_args": {"style": "terse", "enable_thinking": False},
        "folded_system": True,
        "think_end_token": "</think>",
    }


def test_chat_template_args_from_the_command_line(tiny_model_dir):
    lm = make_lm(tiny_model_dir, ',chat_template_args={"style": "terse"}')
    assert lm.options.chat_kwargs == {"style": "terse"}
    with pytest.raises(ValueError, match=r"chat_template_args=.* is not a JSON object.*Fix"):
        make_lm(tiny_model_dir, ",chat_template_args=style")
