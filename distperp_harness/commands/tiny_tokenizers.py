"""Small tokenizers in the layouts of real tokenizer families, trained on the text given (beside the tiny models of
:mod:`~distperp_harness.commands.tiny`): the layouts the cuts of
:mod:`~distperp_harness.planning.tokenizer_cuts` are tested on (``tests/planning``) and timed on
(``benchmarks/tokenize_families.py``).

=============  ==========================  ===================================  ==================================
family         normalizer                  pre-tokenizer                        model, post-processor
=============  ==========================  ===================================  ==================================
``gpt2``       none                        ByteLevel (GPT-2's regex)            BPE; ByteLevel (GPT-2, SmolLM2)
``llama3``     none                        Split (cl100k) + ByteLevel           BPE ``ignore_merges``; Sequence of
                                                                                ByteLevel and a BOS template
``qwen2``      NFC                         Split (Qwen2) + ByteLevel            BPE; ByteLevel (Qwen2, 2.5, 3)
``gemma``      Replace ``' '`` -> ``▁``    none (trained split before ``▁``)    BPE ``byte_fallback``; BOS template
``metaspace``  none                        Metaspace (``first``, split)         BPE; BOS template
=============  ==========================  ===================================  ==================================

Each has its family's chat markers as special tokens (:data:`SPECIALS`); :func:`with_markup_tokens` adds an added
vocabulary shaped like Gemma 3's (thousands of ``<...>`` contents) and :func:`markup_text` text full of ``<``.
"""

from __future__ import annotations

import enum
import json
from typing import Any, Sequence


class Family(enum.Enum):
    GPT2 = "gpt2"
    LLAMA3 = "llama3"
    QWEN2 = "qwen2"
    GEMMA = "gemma"
    METASPACE = "metaspace"


SPECIALS: dict[Family, tuple[str, ...]] = {
    Family.GPT2: ("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
    Family.LLAMA3: ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
    Family.QWEN2: ("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
    Family.GEMMA: ("<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"),
    Family.METASPACE: ("<unk>", "<s>", "</s>", "[INST]", "[/INST]"),
}
"""Each family's special tokens (the first ``bos``/``eos`` of :data:`ROLES` among them)."""
ROLES: dict[Family, dict[str, str]] = {
    Family.GPT2: {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>"},
    Family.LLAMA3: {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
    Family.QWEN2: {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
    Family.GEMMA: {"bos_token": "<bos>", "eos_token": "<eos>", "unk_token": "<unk>", "pad_token": "<pad>"},
    Family.METASPACE: {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"},
}
BOS_IN_FRONT = (Family.LLAMA3, Family.GEMMA, Family.METASPACE)


def family_tokenizer(family: Family, texts: Sequence[str], vocab_size: int) -> Any:
    """A ``PreTrainedTokenizerFast`` in ``family``'s layout (module docstring), its BPE trained on ``texts`` up to
    ``vocab_size`` entries."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    unk = ROLES[family].get("unk_token")
    tok = Tokenizer(models.BPE(unk_token=unk))
    byte_level = family in (Family.GPT2, Family.LLAMA3, Family.QWEN2)
    if family is Family.QWEN2:
        tok.normalizer = normalizers.NFC()
    if family is Family.GEMMA:
        tok.normalizer = normalizers.Replace(" ", "▁")
    tok.pre_tokenizer = _training_pre_tokenizer(family)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, special_tokens=list(SPECIALS[family]), show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet() if byte_level else [],
    )  # fmt: skip
    tok.train_from_iterator(list(texts), trainer=trainer)
    config = json.loads(tok.to_str())
    if family is Family.LLAMA3:
        config["model"]["ignore_merges"] = True
    if family is Family.GEMMA:  # Gemma's layout: the whole text one BPE word, unknown characters as bytes
        config["pre_tokenizer"] = None
        vocab = config["model"]["vocab"]
        for byte in range(256):
            vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
        config["model"].update(byte_fallback=True, fuse_unk=True)
    tok = Tokenizer.from_str(json.dumps(config))
    tok.post_processor = _post_processor(family, tok)
    return PreTrainedTokenizerFast(tokenizer_object=tok, clean_up_tokenization_spaces=False, **ROLES[family])


def _training_pre_tokenizer(family: Family) -> Any:
    from tokenizers import Regex, pre_tokenizers

    from distperp_harness.planning.pretoken_steps import CL100K, QWEN2

    if family is Family.GPT2:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if family in (Family.LLAMA3, Family.QWEN2):
        pattern = Regex(CL100K if family is Family.LLAMA3 else QWEN2)
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(pattern, "isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    if family is Family.GEMMA:  # SentencePiece's whitespace split, so no merge spans a space (as in Gemma's merges)
        return pre_tokenizers.Split("▁", "merged_with_next")
    return pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=True)


def _post_processor(family: Family, tok: Any) -> Any:
    from tokenizers import processors

    byte_level = processors.ByteLevel(trim_offsets=False)
    if family not in BOS_IN_FRONT:
        return byte_level
    bos = ROLES[family]["bos_token"]
    template = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.token_to_id(bos))]
    )
    return processors.Sequence([byte_level, template]) if family is Family.LLAMA3 else template


MARKUP_TAGS = (
    "a", "b", "i", "u", "p", "em", "strong", "code", "pre", "sub", "sup", "div", "span", "li", "ul", "ol", "table",
    "caption", "thead", "tbody", "tr", "th", "td", "h1", "h2", "h3", "h4", "h5", "h6", "blockquote", "br", "hr",
    "img", "small", "big", "center", "font", "s", "del",
)  # fmt: skip
"""Markup tags added as tokens (Gemma 3 has HTML-like tags among its added tokens)."""


def with_markup_tokens(tokenizer: Any, unused: int = 6242) -> Any:
    """``tokenizer`` with an added vocabulary shaped like Gemma 3's: ``unused`` special ``<unusedN>`` tokens and each
    of :data:`MARKUP_TAGS` opening and closing as plain added tokens, all matched on the raw text
    (``normalized=False``): with the defaults 6,320 more contents that start with ``<`` (Gemma 3 has 6,321 in all)."""
    from tokenizers import AddedToken

    tags = sorted({f"<{t}>" for t in MARKUP_TAGS} | {f"</{t}>" for t in MARKUP_TAGS})
    tokenizer.add_tokens([AddedToken(t, normalized=False) for t in tags])
    specials = [AddedToken(f"<unused{i}>", normalized=False, special=True) for i in range(unused)]
    tokenizer.add_special_tokens({"additional_special_tokens": specials})
    return tokenizer


def markup_text(words: Sequence[str], length: int, brackets: int) -> str:
    """``length`` characters of ``words`` (their own ``<`` made ``(``) with exactly ``brackets`` ``<`` in them, one
    every ``length // brackets`` characters (at least 8): markup tags that are added tokens of
    :func:`with_markup_tokens`, tags that are not, comparisons (``a < b``) and an unfinished ``<unu``."""
    marks = ["<td>", "</td>", "<tr>", "<x>", " < ", "<b>", "</b>", "<unu", "<li>", "<br>"]
    gap = length // brackets
    if gap < 8:
        raise ValueError(f"{brackets} brackets in {length} characters: at most one every 8 characters")
    filler = " ".join(words).replace("<", "(")
    out = [marks[n % len(marks)] for n in range(brackets)]
    out = [m + filler[(n * gap) % (len(filler) - gap) :][: gap - len(m)] for n, m in enumerate(out)]
    return "".join(out) + filler[: length - gap * brackets]


MMLU_DESCRIPTION = "The following are multiple choice questions (with answers) about {}.\n\n"


def mmlu_random_prompts(
    words: Sequence[str], subjects: int, questions: int, pool: int = 5, seed: int = 1234
) -> list[str]:
    """The distinct strings lm-eval's ``loglikelihood`` encodes for MMLU-shaped 5-shot questions whose examples
    lm-eval's default sampler draws (``ContextSampler``, ``fewshot_random_seed`` ``seed``): per subject ``pool`` dev
    examples (MMLU: 5), each question's prompt the description, five of them in the sampler's random order (of all
    five for MMLU), then the question; lm-eval's MMLU template (``question\\nA. ..\\nB. ..\\nC. ..\\nD. ..
    \\nAnswer:``, target `` X``, examples joined by ``\\n\\n``), four answers per question. The texts are runs
    of ``words`` (about 2,200 characters a prompt)."""
    from lm_eval.api.samplers import ContextSampler

    from distperp_harness.tokens import loglikelihood_strings

    cursor = iter(range(0, 10**9, 97))

    def doc() -> dict:
        take = lambda n: " ".join(words[(k := next(cursor) % (len(words) - n)) : k + n])  # noqa: E731
        return {"question": take(44) + "?", "choices": [take(5) for _ in range(4)], "answer": next(cursor) % 4}

    def text(d: dict) -> str:
        options = "".join(f"\n{letter}. {choice}" for letter, choice in zip("ABCD", d["choices"]))
        return f"{d['question'].strip()}{options}\nAnswer:"

    pairs = []
    for subject in range(subjects):
        sampler = ContextSampler([doc() for _ in range(pool)], rnd=seed)
        for _ in range(questions):
            shots = "".join(f"{text(d)} {'ABCD'[d['answer']]}\n\n" for d in sampler.sample(5))
            context = MMLU_DESCRIPTION.format(f"subject {subject}") + shots + text(doc())
            pairs += [(context, f" {letter}") for letter in "ABCD"]
    return list(dict.fromkeys(s for s, _ in loglikelihood_strings(pairs)))
