"""Every ``--model_args`` key of ``--model distperp``: its type, default and validation, in one frozen dataclass.

``Options.from_kwargs`` is the only way user input becomes options. It casts what lm-eval's argument parser
leaves as strings, rejects unknown keys and bad values with a ``ValueError`` that names the value given, what is
allowed and how to fix it, and is recorded verbatim in the results (``Options.to_dict``).
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import os
from dataclasses import dataclass, field
from typing import Any, Callable

from distperp_harness.errors import OptionError

DTYPES = ("auto", "float32", "bfloat16", "float16")
_DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}


class Word(str, enum.Enum):
    """A choice spelled as a word: compares equal to the word, shows as the word (``str``, f-strings, records)."""

    def __str__(self) -> str:
        return self.value


class QuantScheme(Word):
    """``quantize=``'s schemes: the one list of their names (``model/quantize.py`` registers a plan for each)."""

    NONE = "none"
    INT4 = "int4"
    INT8 = "int8"
    DA8W4 = "8da4w"


class CompileMode(Word):
    """``compile=``: eager (``false``) or a torch.compile mode (``compile=true`` is ``default``)."""

    OFF = "false"
    DEFAULT = "default"
    REDUCE_OVERHEAD = "reduce-overhead"
    MAX_AUTOTUNE = "max-autotune"
    MAX_AUTOTUNE_NO_CUDAGRAPHS = "max-autotune-no-cudagraphs"


QUANT_SCHEMES = tuple(s.value for s in QuantScheme)
GROUP_SIZES = (32, 64, 128, 256)
COMPILE_MODES = tuple(m.value for m in CompileMode if m is not CompileMode.OFF)
SHARD_SIZES = (
    "an integer >= 1 that divides the processes per node, or 'node' (all processes of a node share one "
    "copy of the weights)"
)
TP_SIZES = (
    "an integer >= 1 that divides the processes per node, or 'node' (all processes of a node compute "
    "each forward together)"
)
CP_SIZES = (
    "an integer >= 1 that divides the processes per node, or 'node' (all processes of a node compute each row "
    "together, each a share of its tokens)"
)
# The lm-eval CLI passes device="cuda:0" when the user gave no --device; on a machine without CUDA that default
# falls back to the CPU (with a log line). Any other CUDA device asked for on such a machine is an error.
CLI_DEFAULT_DEVICE = "cuda:0"


class BatchInvariant(Word):
    """``batch_invariant``: ``auto`` (the default): results the same bits for any batching where this run can be at
    little cost (eager layers, no context-parallel group, a CPU device, no routed experts, kernels passing the check
    at start), else as ``false``, said in one line; ``true``: invariant anywhere (a forward per row where the check
    fails); ``false``: batches as the kernels like them."""

    AUTO = "auto"
    ON = "true"
    OFF = "false"


class CpMinTokens(Word):
    """``cp_min_tokens``'s word (an integer N >= 1 is the other form: rows of at least N tokens go to the groups)."""

    AUTO = "auto"  # model/cp_attention.AUTO_TOKENS_PER_MEMBER tokens per member of the group


class Int4Prefill(Word):
    """``int4_prefill``'s words (an integer N >= 1 is the other form: products of at least N rows dequantize)."""

    AUTO = "auto"  # the device type's row count (model/int4_products.AUTO_ROWS)
    KERNEL = "kernel"  # torchao's int4 kernel for every product


@dataclass(frozen=True)
class Options:
    """Validated configuration of one distperp model instance.

    Attributes mirror the ``--model_args`` keys one to one; see the README's options table.
    """

    pretrained: str
    revision: str = "main"
    tokenizer: str | None = None
    dtype: str = "auto"
    device: str | None = None
    device_from_cli: bool = field(default=False, repr=False)
    max_length: int | None = None
    add_bos_token: bool | None = None
    prefix_token_id: int | None = None
    trust_remote_code: bool = False
    attn_implementation: str | None = None
    batch_size: int | str = 1
    max_batch_size: int = 64
    # distributed
    timeout: float = 1800.0
    # quantization
    quantize: QuantScheme = QuantScheme.NONE
    group_size: int = 128
    quantize_lm_head: bool = False
    # packed int4 products of >= N rows dequantize the layer and multiply densely; auto: per device; kernel: never
    int4_prefill: Int4Prefill | int = Int4Prefill.AUTO
    # perplexity
    stride: int | None = None
    reference: str | None = None
    # reliability
    resume_dir: str | None = None
    # multiple choice: units of one context share rows; false computes every unit on its own row
    share_prefix: bool = True
    # models bigger than one device: processes that together hold one copy of the weights
    shard_size: int | str = 1
    # tensor parallelism: processes that together compute each forward, each holding a slice of every
    # large matrix; tp_plan=auto is lm-eval hf's spelling (= tp_size=node unless tp_size is given)
    tp_size: int | str = 1
    tp_plan: str | None = None
    # context parallelism: processes that together compute each row, each its share of the row's tokens, gathering
    # every layer's keys and values (long windows)
    cp_size: int | str = 1
    # rows of at least this many tokens are computed by a context-parallel group; shorter rows stay data parallel
    cp_min_tokens: CpMinTokens | int = CpMinTokens.AUTO
    # compiled decoder layers: "false" (eager) or a torch.compile mode; compile=true is "default"
    compile: CompileMode = CompileMode.OFF
    # generation on CUDA: the decode step replayed as CUDA graphs (checked against the eager step once per bucket)
    cuda_graphs: bool = True
    # stragglers: ranks take batches as they go (a slow rank computes fewer); false: the static plan
    claim: bool = True
    # every row and generated sequence attending alone: results independent of batch_size and memory (auto: where
    # this run can be at little cost, said at start)
    batch_invariant: BatchInvariant = BatchInvariant.AUTO
    # checkpoints as users have them
    subfolder: str | None = None
    gguf_file: str | None = None
    peft: str | None = None
    merge_adapter: bool = True
    delta: str | None = None
    think_end_token: str | int | None = None
    enable_thinking: bool | None = None
    chat_template_args: dict | None = None
    # not a --model_args key: set when simple_evaluate passed a model object as pretrained (model/given.py)
    in_memory: bool = field(default=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.batch_invariant, BatchInvariant):  # a bool (Python callers) reads as its word
            word = _CASTS["batch_invariant"]("batch_invariant", self.batch_invariant)
            object.__setattr__(self, "batch_invariant", word)
        _require(
            isinstance(self.pretrained, str) and self.pretrained.strip() != "",
            "pretrained",
            self.pretrained,
            "a Hugging Face hub id or a local model folder",
            "pass pretrained=<hub id or path>",
        )
        _require(self.dtype in DTYPES, "dtype", self.dtype, f"one of {', '.join(DTYPES)}", "e.g. dtype=bfloat16")
        if self.max_length is not None:
            _require(
                self.max_length > 1,
                "max_length",
                self.max_length,
                "an integer > 1",
                "leave it unset to use the model's context length",
            )
        if self.prefix_token_id is not None:
            _require(self.prefix_token_id >= 0, "prefix_token_id", self.prefix_token_id, "a token id >= 0", "")
        bs = self.batch_size
        if isinstance(bs, int):
            _require(bs >= 1, "batch_size", bs, "an integer >= 1, 'auto' or 'auto:N'", "e.g. batch_size=8")
        _require(self.max_batch_size >= 1, "max_batch_size", self.max_batch_size, "an integer >= 1", "")
        _require(self.timeout > 0, "timeout", self.timeout, "a number of seconds > 0", "e.g. timeout=600")
        _require(
            self.quantize in QUANT_SCHEMES,
            "quantize",
            self.quantize,
            f"one of {', '.join(QUANT_SCHEMES)}",
            "e.g. quantize=int4,group_size=128",
        )
        _require(
            self.group_size in GROUP_SIZES,
            "group_size",
            self.group_size,
            f"one of {', '.join(map(str, GROUP_SIZES))}",
            "e.g. group_size=128",
        )
        _require(
            isinstance(self.int4_prefill, Int4Prefill)
            or (
                isinstance(self.int4_prefill, int)
                and not isinstance(self.int4_prefill, bool)
                and self.int4_prefill >= 1
            ),
            "int4_prefill",
            self.int4_prefill,
            "auto, kernel, or an integer N >= 1 (products of at least N rows dequantize the int4 weights)",
            "e.g. int4_prefill=auto, or int4_prefill=kernel for torchao's kernel everywhere",
        )
        if self.stride is not None:
            _require(
                self.stride > 0,
                "stride",
                self.stride,
                "an integer with 0 < stride <= max_length",
                "e.g. stride=512 for windows that overlap by max_length - 512 tokens",
            )
            if self.max_length is not None:
                _require(
                    self.stride <= self.max_length,
                    "stride",
                    self.stride,
                    f"an integer with 0 < stride <= max_length ({self.max_length})",
                    "lower stride or raise max_length",
                )
        _require(
            isinstance(self.cuda_graphs, bool),
            "cuda_graphs",
            self.cuda_graphs,
            "true or false",
            "cuda_graphs=false decodes with the eager step on CUDA",
        )
        _require(
            isinstance(self.share_prefix, bool),
            "share_prefix",
            self.share_prefix,
            "true or false",
            "share_prefix=false computes every answer of a multiple-choice question on its own row",
        )
        if isinstance(self.shard_size, str):
            _require(
                self.shard_size == "node",
                "shard_size",
                self.shard_size,
                SHARD_SIZES,
                "e.g. shard_size=node, or shard_size=8 on nodes of 8 GPUs",
            )
        else:
            _require(
                isinstance(self.shard_size, int) and self.shard_size >= 1,
                "shard_size",
                self.shard_size,
                SHARD_SIZES,
                "shard_size=1 (every process holds all weights) or a divisor of the processes per node",
            )
        self._check_tensor_parallel()
        self._check_context_parallel()
        _require(
            isinstance(self.claim, bool),
            "claim",
            self.claim,
            "true or false",
            "claim=false makes every batch's planned owner compute it (no batches taken over from slow ranks)",
        )
        _require(
            self.compile == "false" or self.compile in COMPILE_MODES,
            "compile",
            self.compile,
            f"true, false or a torch.compile mode ({', '.join(COMPILE_MODES)})",
            "e.g. compile=true (mode default) or compile=max-autotune",
        )
        self._check_batch_invariant()
        if self.reference is not None:
            _require(
                isinstance(self.reference, str) and self.reference.strip() != "",
                "reference",
                self.reference,
                "'base' (the same checkpoint, unquantized), 'pretrained' (the checkpoint without its peft= "
                "adapter or delta= weights) or a model path / hub id",
                "",
            )
        self._check_checkpoint_keys()

    def _check_batch_invariant(self) -> None:
        """``batch_invariant``: auto, true or false; ``true`` only eager (compiled graphs are chosen by the order
        shapes arrive in, so their kernels, and the bits, would depend on what ran before)."""
        _require(
            isinstance(self.batch_invariant, BatchInvariant),
            "batch_invariant",
            self.batch_invariant,
            "auto, true or false",
            "batch_invariant=true makes results independent of batch_size and the device's memory; auto does "
            "where it costs little",
        )
        _require(
            not (self.batch_invariant is BatchInvariant.ON and self.compile != "false"),
            "compile",
            self.compile,
            "false with batch_invariant=true (a compiled graph's kernels depend on the shapes compiled before it)",
            "drop compile= or batch_invariant=true",
        )

    def _check_tensor_parallel(self) -> None:
        """``tp_size``/``tp_plan``: a divisor of the processes per node or ``node``; not with ``shard_size``, nor
        with what is applied to whole weights after loading (adapters, delta weights, a GGUF file)."""
        if isinstance(self.tp_size, str):
            _require(
                self.tp_size == "node",
                "tp_size",
                self.tp_size,
                TP_SIZES,
                "e.g. tp_size=node, or tp_size=8 on nodes of 8 GPUs",
            )
        else:
            _require(
                isinstance(self.tp_size, int) and self.tp_size >= 1,
                "tp_size",
                self.tp_size,
                TP_SIZES,
                "tp_size=1 (every process computes its own forwards) or a divisor of the processes per node",
            )
        _require(
            self.tp_plan in (None, "auto"),
            "tp_plan",
            self.tp_plan,
            "'auto' (the model's own tensor-parallel plan, lm-eval hf's spelling of tp_size=node)",
            "tp_plan=auto, or tp_size=N",
        )
        if self.tensor_parallel == 1:
            return
        _require(
            self.shard_size == 1,
            "shard_size",
            self.shard_size,
            f"shard_size=1 with tp_size={self.tensor_parallel} (a model is either sharded by FSDP2 or split "
            "by its tensor-parallel plan, not both)",
            "drop one of shard_size and tp_size",
        )
        for key in ("peft", "delta", "gguf_file"):
            _require(
                getattr(self, key) is None,
                key,
                getattr(self, key),
                f"{key}= only with tp_size=1: it is applied to whole weights after loading, and a "
                f"tensor-parallel process holds a slice of each",
                f"save the merged model and load that with tp_size, or use shard_size={self.tensor_parallel}",
            )

    def _check_context_parallel(self) -> None:
        """``cp_size``: a divisor of the processes per node or ``node``; with whole weights on every process (not
        ``shard_size``/``tp_size``), rows computed in batches (not ``batch_invariant=true``) and eager layers (not
        ``compile``)."""
        if isinstance(self.cp_size, str):
            _require(self.cp_size == "node", "cp_size", self.cp_size, CP_SIZES, "e.g. cp_size=node, or cp_size=2")
        else:
            _require(
                isinstance(self.cp_size, int) and self.cp_size >= 1,
                "cp_size",
                self.cp_size,
                CP_SIZES,
                "cp_size=1 (every process computes its own rows) or a divisor of the processes per node",
            )
        _require(
            isinstance(self.cp_min_tokens, CpMinTokens)
            or (isinstance(self.cp_min_tokens, int) and self.cp_min_tokens >= 1 and self.cp_size != 1),
            "cp_min_tokens",
            self.cp_min_tokens,
            "auto, or with cp_size > 1 an integer N >= 1 (rows of at least N tokens are computed by a group)",
            "e.g. cp_size=2,cp_min_tokens=8192 (cp_min_tokens has no effect with cp_size=1)",
        )
        if self.cp_size == 1:
            return
        for key, value, ok, what in (
            ("shard_size", self.shard_size, self.shard_size == 1, "whole weights on every member"),
            ("tp_size", self.tensor_parallel, self.tensor_parallel == 1, "whole weights on every member"),
            (
                "batch_invariant",
                self.batch_invariant,
                self.batch_invariant is not BatchInvariant.ON,
                "rows computed in batches (batch_invariant=auto or false)",
            ),
            ("compile", self.compile, self.compile == "false", "eager layers (the gathers are not compiled)"),
        ):
            _require(
                ok,
                key,
                value,
                f"the default with cp_size={self.cp_size}: context parallelism needs {what}",
                f"drop {key}= or use cp_size=1",
            )

    @property
    def tensor_parallel(self) -> int | str:
        """The TP group size asked for: ``tp_size``, or ``"node"`` for ``tp_plan=auto`` alone (1: none)."""
        if self.tp_size != 1:
            return self.tp_size
        return "node" if self.tp_plan == "auto" else 1

    def _check_checkpoint_keys(self) -> None:
        """The checkpoint keys: adapters, GGUF, thinking and chat template arguments."""
        for key in ("subfolder", "gguf_file", "peft", "delta"):
            value = getattr(self, key)
            if value is not None:
                _require(
                    isinstance(value, str) and value.strip() != "",
                    key,
                    value,
                    "a non-empty path or name",
                    f"leave {key} unset, or give {key}=<path or hub id>",
                )
        _require(
            not (self.peft and self.delta),
            "delta",
            self.delta,
            "delta= or peft=, not both (as lm-eval hf)",
            "run the adapter and the delta weights as two runs",
        )
        _require(isinstance(self.merge_adapter, bool), "merge_adapter", self.merge_adapter, "true or false", "")
        if self.reference == "base" and self.quantize == "none":
            raise OptionError(
                "reference=base compares against the unquantized checkpoint, but quantize=none: "
                "nothing is quantized by this run, and a checkpoint saved already quantized holds no "
                "unquantized copy (reference=base means the same weights unquantized). Fix: give "
                "reference=<the full-precision model path>, or add quantize=int4 (or int8, 8da4w) to "
                "a full-precision pretrained="
                + (", or reference=pretrained (the base without the adapter)" if self.peft or self.delta else "")
                + "."
            )
        if self.reference == "pretrained":
            _require(
                bool(self.peft or self.delta),
                "reference",
                self.reference,
                "reference=pretrained only with peft= or delta= (it is the checkpoint without them)",
                "add peft=<adapter path>, or use reference=base with quantize=",
            )
        if not self.merge_adapter:
            _require(
                bool(self.peft),
                "merge_adapter",
                self.merge_adapter,
                "merge_adapter=false only with peft= (there is no adapter to keep unmerged)",
                "drop merge_adapter, or add peft=<adapter path>",
            )
            _require(
                self.quantize == "none",
                "merge_adapter",
                self.merge_adapter,
                f"merge_adapter=false only with quantize=none: the adapter is merged before quantize="
                f"{self.quantize} so that its weights are quantized with the base's",
                "drop merge_adapter=false, or quantize=none",
            )
            _require(
                self.shard_size == 1,
                "merge_adapter",
                self.merge_adapter,
                "merge_adapter=false only with shard_size=1 (an unmerged adapter's layers are not sharded)",
                "drop merge_adapter=false, or shard_size=1",
            )
        if self.think_end_token is not None:
            token = self.think_end_token
            _require(
                (isinstance(token, int) and not isinstance(token, bool) and token >= 0)
                or (isinstance(token, str) and token != ""),
                "think_end_token",
                token,
                "a string (e.g. '</think>') or a token id >= 0",
                "e.g. think_end_token=</think>",
            )
        _require(
            self.enable_thinking is None or isinstance(self.enable_thinking, bool),
            "enable_thinking",
            self.enable_thinking,
            "true or false",
            "",
        )
        _require(
            not (self.enable_thinking and self.think_end_token is None),
            "enable_thinking",
            self.enable_thinking,
            "enable_thinking=true together with think_end_token (as lm-eval hf "
            "requires): else the thinking trace stays in the scored answer",
            "add think_end_token=</think> (or the model's end-of-thinking token or id)",
        )
        if self.chat_template_args is not None:
            _require(
                isinstance(self.chat_template_args, dict),
                "chat_template_args",
                self.chat_template_args,
                "a JSON object of keyword arguments for the chat template",
                'e.g. chat_template_args={"x":1}',
            )

    @property
    def chat_kwargs(self) -> dict:
        """Keyword arguments for ``tokenizer.apply_chat_template``: ``chat_template_args`` plus ``enable_thinking``
        when given (lm-eval hf's rule)."""
        out = dict(self.chat_template_args or {})
        if self.enable_thinking is not None:
            out["enable_thinking"] = self.enable_thinking
        return out

    @property
    def compile_mode(self) -> str | None:
        """The torch.compile mode of ``compile=``, or None for eager."""
        return None if self.compile == CompileMode.OFF else CompileMode(self.compile).value

    @property
    def auto_batch(self) -> bool:
        return isinstance(self.batch_size, str)

    @property
    def auto_batch_schedule(self) -> int:
        """N of ``batch_size=auto:N`` (1 for plain ``auto``)."""
        if not isinstance(self.batch_size, str):
            return 0
        return int(self.batch_size.split(":")[1]) if ":" in self.batch_size else 1

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "Options":
        """Build options from lm-eval's keyword arguments (model_args plus the CLI's batch_size/device)."""
        internal = ("device_from_cli", "in_memory")
        known = {f.name: f for f in dataclasses.fields(cls) if f.name not in internal}
        unknown = sorted(k for k in kwargs if k not in known and k not in internal)
        if unknown:
            hints = []
            for key in unknown:
                close = difflib.get_close_matches(key, known, n=1)
                hints.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
            raise OptionError(
                f"Unknown --model_args key(s) for --model distperp: {', '.join(hints)}. "
                f"Allowed keys: {', '.join(sorted(known))}."
            )
        if "pretrained" not in kwargs or kwargs["pretrained"] in (None, ""):
            raise OptionError(
                "--model distperp needs pretrained=<hub id or local model folder>, "
                "e.g. --model_args pretrained=EleutherAI/pythia-160m"
            )
        values: dict[str, Any] = {}
        for key, value in kwargs.items():
            if key in internal:
                values[key] = bool(value)
                continue
            values[key] = _cast(key, value)
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly view, recorded in the results."""
        out = dataclasses.asdict(self)
        out.pop("device_from_cli")
        for key, value in out.items():  # the enums' words, as given
            if isinstance(value, enum.Enum):
                out[key] = value.value
        if out.pop("in_memory"):
            out["pretrained_in_memory"] = True
        return out


_INT_KEYS = {"max_length", "prefix_token_id", "max_batch_size", "group_size", "stride"}
_BOOL_KEYS = {
    "add_bos_token",
    "trust_remote_code",
    "quantize_lm_head",
    "share_prefix",
    "cuda_graphs",
    "claim",
    "merge_adapter",
    "enable_thinking",
}
_FLOAT_KEYS = {"timeout"}
_STR_KEYS = {
    "pretrained",
    "revision",
    "tokenizer",
    "device",
    "attn_implementation",
    "reference",
    "resume_dir",
    "subfolder",
    "gguf_file",
    "peft",
    "delta",
}


def _cast(key: str, value: Any) -> Any:
    """``value`` of ``key`` as :class:`Options` holds it (strings from ``--model_args`` parsed, aliases resolved);
    an :class:`OptionError` when it cannot be read as the key's type."""
    if value is None:
        return None
    if key in _INT_KEYS:
        return _as_int(key, value)
    if key in _BOOL_KEYS:
        return _as_bool(key, value)
    if key in _FLOAT_KEYS:
        return _as_float(key, value)
    if key in _CASTS:
        return _CASTS[key](key, value)
    return str(value) if key in _STR_KEYS else value


def _as_float(key: str, value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        raise OptionError(f"{key}={value!r} is not a number; give seconds, e.g. {key}=600") from None


def _aliased(aliases: dict[str, str]) -> Callable[[str, Any], str]:
    """A cast to the lower-cased text, with ``aliases`` mapped to their canonical name."""
    return lambda key, value: aliases.get(str(value).strip().lower(), str(value).strip().lower())


def _enum(kind: type[enum.Enum], aliases: dict[str, str]) -> Callable[[str, Any], Any]:
    """A cast to ``kind``'s member of the lower-cased text (``aliases`` mapped first); text that names none is kept,
    for validation to refuse with the allowed values."""
    words = _aliased(aliases)

    def cast(key: str, value: Any) -> Any:
        text = words(key, value)
        try:
            return kind(text)
        except ValueError:
            return text

    return cast


def _as_dtype(key: str, value: Any) -> str:
    text = str(value).strip().lower().removeprefix("torch.")
    return _DTYPE_ALIASES.get(text, text)


def _as_tp_plan(key: str, value: Any) -> str | None:
    text = str(value).strip().lower()
    return None if text in ("none", "") else text


def _as_size(key: str, value: Any) -> int | str:
    """``shard_size``/``tp_size``: a number, or a word (``auto``, ``node``) left for validation."""
    text = str(value).strip().lower()
    return text if not text.lstrip("-").isdigit() else _as_int(key, text)


def _as_cp_min_tokens(key: str, value: Any) -> CpMinTokens | int | str:
    """``cp_min_tokens``: ``auto`` or a token count (other text is kept for validation to refuse)."""
    if isinstance(value, (CpMinTokens, int)) and not isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text.lstrip("-").isdigit():
        return int(text)
    try:
        return CpMinTokens(text)
    except ValueError:
        return text


def _as_int4_prefill(key: str, value: Any) -> Int4Prefill | int:
    """``int4_prefill``: ``auto``, ``kernel`` or a row count."""
    if isinstance(value, (Int4Prefill, int)) and not isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text.isdigit():
        return int(text)
    try:
        return Int4Prefill(text)
    except ValueError:
        raise OptionError(
            f"int4_prefill={value!r} is not valid for --model distperp; allowed: auto, kernel, or an integer N >= 1 "
            "(products of at least N rows dequantize the int4 weights). Fix: e.g. int4_prefill=auto."
        ) from None


def _as_token(key: str, value: Any) -> int | str:
    """``think_end_token``: a digit string is a token id, as lm-eval hf reads it."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    text = str(value)
    return int(text) if text.isdigit() else text


_CASTS: dict[str, Callable[[str, Any], Any]] = {
    "cp_min_tokens": _as_cp_min_tokens,
    "dtype": _as_dtype,
    "quantize": _enum(QuantScheme, {"false": "none", "int4wo": "int4", "int8wo": "int8", "int8da4w": "8da4w"}),
    "batch_size": lambda key, value: _as_batch_size(value),
    "batch_invariant": _enum(BatchInvariant, {"1": "true", "yes": "true", "0": "false", "no": "false"}),
    "compile": _enum(
        CompileMode, {"true": "default", "1": "default", "yes": "default", "0": "false", "no": "false", "none": "false"}
    ),
    "tp_plan": _as_tp_plan,
    "shard_size": _as_size,
    "tp_size": _as_size,
    "cp_size": _as_size,
    "think_end_token": _as_token,
    "int4_prefill": _as_int4_prefill,
    "chat_template_args": lambda key, value: _as_json_object(key, value),
}
"""Keys read by a cast of their own (the others by their type's set above, or kept as given)."""


def _as_json_object(key: str, value: Any) -> dict:
    """A dict as given (``simple_evaluate``), or a JSON object string (``--model_args``, where a comma would split
    the value: one key per string there)."""
    if isinstance(value, dict):
        return dict(value)
    import json

    try:
        parsed = json.loads(str(value))
    except ValueError:
        parsed = None
    if not isinstance(parsed, dict):
        raise OptionError(
            f"{key}={value!r} is not a JSON object; allowed: a dict (simple_evaluate) or a JSON "
            f"object string. Fix: e.g. {key}='{{\"enable_thinking\": false}}' (lm-eval splits "
            "--model_args on commas, so one key per --model_args value; pass more from Python)"
        )
    return parsed


def _as_int(key: str, value: Any) -> int:
    if isinstance(value, bool):
        raise OptionError(f"{key}={value!r} is not an integer; e.g. {key}=128")
    if isinstance(value, float) and value.is_integer():
        return int(value)
    try:
        return int(str(value).strip())
    except ValueError:
        raise OptionError(f"{key}={value!r} is not an integer; e.g. {key}=128") from None


def _as_bool(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "1", "yes"):
        return True
    if text in ("false", "0", "no"):
        return False
    raise OptionError(f"{key}={value!r} is not a boolean; use {key}=true or {key}=false")


def _as_batch_size(value: Any) -> int | str:
    """Accept 8, "8", "auto" and "auto:N" (the strings lm-eval's CLI passes)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text.isdigit():
        return int(text)
    if text == "auto":
        return "auto"
    if text.startswith("auto:") and text[5:].isdigit() and int(text[5:]) >= 1:
        return f"auto:{int(text[5:])}"
    raise OptionError(
        f"batch_size={value!r} is not valid; allowed: an integer >= 1, 'auto' or 'auto:N' "
        "(N >= 1), e.g. --batch_size 8 or --batch_size auto"
    )


def _require(ok: bool, key: str, value: Any, allowed: str, fix: str) -> None:
    if not ok:
        value = value.value if isinstance(value, enum.Enum) else value  # the word given, not the member's repr
        message = f"{key}={value!r} is not valid for --model distperp; allowed: {allowed}."
        if fix:
            message += f" Fix: {fix}."
        raise OptionError(message)


# ---------------------------------------------------------------------------------------------------------------
# A launch's command line, checked before lm-eval indexes its tasks or any model loads
# ---------------------------------------------------------------------------------------------------------------

WIKITEXT_KEYS = ("wikitext_path",)
DOCS_KEYS = ("docs_path",)
LONGDOCS_KEYS = ("docs_path", "wikitext_path", "min_chars")
NEEDLE_KEYS = ("docs_path", "wikitext_path", "context_chars", "depths", "docs_per_depth", "seed", "n_choices", "digits")
TASK_METADATA_KEYS: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(
        ("distperp_wikitext2", "distperp_wikitext2_val", "distperp_wikitext103", "distperp_wikitext103_val"),
        WIKITEXT_KEYS,
    ),
    **dict.fromkeys(("distperp_ppl", "distperp_ppl_val"), WIKITEXT_KEYS),  # the WikiText tasks' tags
    "distperp_local_docs": DOCS_KEYS,
    "distperp_longdocs": LONGDOCS_KEYS,
    "distperp_needle": NEEDLE_KEYS,
    "distperp_needle_gen": NEEDLE_KEYS,
}
"""The ``--metadata`` keys each of distperp's tasks (and tags) reads (``tests/test_options.py`` holds it to the
shipped YAMLs)."""
ALL_METADATA_KEYS = frozenset(k for keys in TASK_METADATA_KEYS.values() for k in keys)


def metadata_key_error(task_keys: tuple[str, ...], given: Any) -> str | None:
    """Why a key of lm-eval's metadata cannot be meant for a task reading ``task_keys``, or ``None``: a key that looks
    like a misspelling of one of them (else the task would silently read another source, the hub for WikiText, or a
    default). The rest (``--model_args`` keys, the task version, other distperp tasks' keys: one ``--metadata``
    serves every task of a run, and other tasks' keys are theirs) is not refused."""
    for key in given if task_keys else ():
        if key in task_keys or key in ALL_METADATA_KEYS:
            continue
        ratios = {k: difflib.SequenceMatcher(None, key, k).ratio() for k in task_keys}
        meant = max(task_keys, key=ratios.__getitem__)
        if ratios[meant] >= 0.75:
            allowed = ", ".join(repr(k) for k in task_keys)
            value = '"PATH"' if meant.endswith("_path") else "VALUE"
            return (
                f"--metadata key {key!r} is not one this task reads; allowed: {allowed}. Did you mean {meant!r}? "
                f"Fix: --metadata '{{\"{meant}\": {value}}}'"
            )
    return None


def limit_error(limit: Any) -> str | None:
    """Why ``limit`` (lm-eval's ``--limit``: documents per task, or a fraction of them below 1) cannot run, or
    ``None``. 0 or below would select no document, and lm-eval then fails after the model has loaded."""
    if limit is None or isinstance(limit, bool) or not isinstance(limit, (int, float)) or limit > 0:
        return None
    return (
        f"--limit {limit:g} selects no document: allowed are a number of documents per task (1 or more) or a "
        "fraction of them (above 0, below 1). Fix: e.g. --limit 10 or --limit 0.1, or no --limit for every document"
    )


def resolve_group_size(key: str, option: int | str, world_size: int, local_world_size: int, group: str) -> int:
    """The size of the groups of consecutive ranks that ``key=option`` asks for (``"node"``/``"auto"``: the
    processes per node); an :class:`OptionError` naming ``group`` (what must lie within one node) when it does not
    divide the processes per node (every rank computes it alike from the launch)."""
    size = local_world_size if option in ("node", "auto") else int(option)
    if size == 1:
        return 1
    divisors = [d for d in range(1, local_world_size + 1) if local_world_size % d == 0]
    if local_world_size % size or world_size % size:
        raise OptionError(
            f"{key}={option!r} is not valid with {world_size} process(es), {local_world_size} per node: "
            f"{key} must divide the processes per node, so that {group} lies within one node; allowed here: "
            f"{', '.join(map(str, divisors))} or 'node'. Fix: {key}=node, or launch a multiple of {size} processes "
            f"per node."
        )
    return size


GROUPS = {
    "shard_size": "each group of processes sharing one copy of the weights",
    "tp_size": "each tensor-parallel group (all-reduces at every layer)",
    "cp_size": "each context-parallel group (gathers at every layer)",
}
"""What each group-size key's groups are, for :func:`resolve_group_size`'s message."""


_SOURCES = ("pretrained", "tokenizer", "peft", "delta", "reference")


def _missing_path(key: str, value: Any) -> str | None:
    """A model source that looks local (``./``, ``/``, ``~``, or more than one ``/``) and is no folder; a hub id
    (``org/name``) is left to the load."""
    if not isinstance(value, str) or value in ("base", "pretrained") and key == "reference":
        return None
    path = os.path.expanduser(value)
    if os.path.isdir(path) or key in ("peft", "delta") and os.path.isfile(path):
        return None
    if value.startswith((".", "/", "~")) or value.count("/") > 1 or os.path.exists(path):
        return (
            f"{key}={value!r}: no such model folder (expected a directory with config.json); give an existing "
            "local folder or a Hugging Face hub id like 'org/name'"
        )
    return None


def cli_extras(model_args: dict[str, Any], cli: dict[str, Any] | None) -> dict[str, Any]:
    """The keyword arguments lm-eval adds to ``--model_args`` (the CLI's ``batch_size``, ``max_batch_size``,
    ``device``): a value given in ``--model_args`` wins, and the CLI's device is marked ``device_from_cli`` (its
    default ``cuda:0`` falls back to the CPU on a machine without CUDA)."""
    extra = {k: v for k, v in (cli or {}).items() if v is not None and k not in model_args}
    if "device" in extra:
        extra["device_from_cli"] = True
    return extra


def check_command_line(
    model_args: dict[str, Any],
    cli: dict[str, Any],
    *,
    tasks: Any = (),
    metadata: dict[str, Any] | None = None,
    use_cache: str | None = None,
    limit: Any = None,
    environ: Any = None,
) -> Options:
    """What a run of ``--model distperp`` can be refused for from its command line alone, checked by the start-up
    hook (``distperp_harness/_hook.py``) before lm-eval indexes its tasks or any model loads, so that a typo costs
    a second, not the 15-25 s of start-up; every rank of a launch meets the same error (:class:`OptionError`,
    printed once, by rank 0).

    Checks: every ``--model_args`` key and value (:class:`Options`, with the CLI's ``batch_size``,
    ``max_batch_size`` and ``device`` in ``cli`` as lm-eval passes them), local model paths that do not exist,
    ``shard_size``/``tp_size``/``cp_size`` against the launch's processes (``environ``'s ``WORLD_SIZE``,
    ``LOCAL_WORLD_SIZE``), ``--use_cache`` on several processes, ``--limit``, and the ``--metadata`` keys of the
    distperp tasks among ``tasks`` (:data:`TASK_METADATA_KEYS`). Returns the options."""
    environ = os.environ if environ is None else environ
    options = Options.from_kwargs(**model_args, **cli_extras(model_args, cli))
    for problem in (limit_error(limit), *(_missing_path(k, getattr(options, k)) for k in _SOURCES)):
        if problem:
            raise OptionError(problem)
    world = int(environ.get("WORLD_SIZE", "1") or 1)
    local = int(environ.get("LOCAL_WORLD_SIZE", world) or world)
    for key, value in (("shard_size", options.shard_size), ("tp_size", options.tensor_parallel)):
        resolve_group_size(key, value, world, local, GROUPS[key])
    resolve_group_size("cp_size", options.cp_size, world, local, GROUPS["cp_size"])
    if use_cache and world > 1:
        raise OptionError(use_cache_error(world))
    problem, given = None, [k for k in metadata or {} if k not in model_args]  # lm-eval merges model_args in
    names = tasks.split(",") if isinstance(tasks, str) else list(tasks or ())
    for name in (n.strip() for n in names):
        problem = problem or metadata_key_error(TASK_METADATA_KEYS.get(name, ()), given)
    if problem:
        raise OptionError(problem)
    return options


def use_cache_error(world_size: int) -> str:
    """lm-eval's ``--use_cache`` on several processes, refused."""
    return (
        f"--use_cache with {world_size} processes is not supported by --model distperp: each rank would skip the "
        "requests it finds in its own cache, and the ranks would no longer score the same global plan together. "
        "Fix: run without --use_cache (results are exact and reproducible), or with one process."
    )
