"""Small, deterministic Llama-architecture causal LMs for tests and the demo.

Contracts:
* :func:`build_tiny_model` is a pure function of ``(spec, text, library versions)``: two builds give identical
  weights and tokenizer files. The model is initialised from ``torch.manual_seed(spec.seed)`` and, when
  ``spec.train_steps > 0``, trained single-threaded on random windows of ``text``.
* The saved directory loads offline with ``AutoModelForCausalLM`` / ``AutoTokenizer`` (float32 safetensors).
* The tokenizer is a byte-level BPE that adds no special tokens when encoding (no BOS), so lm-eval's
  prefix-token logic is exercised; ``model_max_length`` equals ``max_position_embeddings``.
* :func:`cached_tiny_model` builds at most once per key and is safe when several processes call it at once.
* ``python -m distperp_harness.commands.tiny [--demo|--test] [--out DIR]`` builds one and prints its path.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # heavy imports stay inside the functions
    from transformers import PreTrainedTokenizerFast

CODE_VERSION = 1
"""Bump on any change that alters what :func:`build_tiny_model` writes; it is part of the cache key."""

SPECIAL_TOKENS = ("<s>", "</s>", "<unk>", "<pad>")
"""Special tokens, with ids 0..3 in this order: bos, eos, unk, pad."""


@dataclass(frozen=True)
class TinySpec:
    """Everything that determines a tiny model (together with the training text).

    All ``nn.Linear`` input sizes are ``hidden_size``, ``num_heads * head_dim`` (= ``hidden_size``) and
    ``intermediate_size``; keep them multiples of 128 where int4 quantization with group size 128 is wanted.
    """

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    max_position_embeddings: int
    seed: int = 0
    train_steps: int = 0
    tie_word_embeddings: bool = False
    batch_size: int = 8
    seq_len: int = 128
    learning_rate: float = 3e-3
    name: str = "tiny-llama"

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"hidden_size={self.hidden_size} must be divisible by num_heads={self.num_heads}, and num_heads "
                f"by num_kv_heads={self.num_kv_heads}"
            )
        if self.vocab_size < 256 + len(SPECIAL_TOKENS):
            raise ValueError(f"vocab_size={self.vocab_size} must be >= 260 (256 bytes + 4 special tokens)")
        if self.train_steps > 0 and not 2 <= self.seq_len <= self.max_position_embeddings:
            raise ValueError(f"seq_len={self.seq_len} must be in [2, max_position_embeddings]")


DEMO_SPEC = TinySpec(
    vocab_size=2048, hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=256,
    max_position_embeddings=256, seed=1234, train_steps=250, batch_size=8, seq_len=128, learning_rate=3e-3,
    name="demo-llama",
)  # fmt: skip
"""The demo model: ~1.1M parameters, trained on the packaged sample (about 25-30 s of one CPU core)."""

TEST_SPEC = TinySpec(
    vocab_size=512, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128,
    max_position_embeddings=128, seed=0, train_steps=0, name="test-llama",
)  # fmt: skip
"""The test model: random init, builds in about a second."""


CHECK_SPEC = TinySpec(
    vocab_size=512, hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=256,
    max_position_embeddings=128, seed=0, train_steps=0, name="check-llama",
)  # fmt: skip
"""``distperp check``'s model: random init; every Linear input width (128, 256) a multiple of int4's group size 128,
so ``quantize=int4`` quantizes every Linear layer of the decoder."""


def sample_text_path() -> Path:
    """Path of the packaged WikiText-formatted sample (original text, see ``distperp_harness/data/README.md``)."""
    return Path(str(resources.files("distperp_harness").joinpath("data").joinpath("sample_wikitext.txt")))


def sample_text() -> str:
    """The packaged sample as one string."""
    return sample_text_path().read_text(encoding="utf-8")


def train_tokenizer(texts: Iterable[str], vocab_size: int, model_max_length: int = 128) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer on ``texts``.

    Returns a fast tokenizer with at most ``vocab_size`` entries (fewer if the text runs out of merges),
    ``<s>``/``</s>``/``<unk>``/``<pad>`` at ids 0..3 and no post-processor: ``encode`` never adds BOS/EOS.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )  # fmt: skip
    tok.train_from_iterator(list(texts), trainer=trainer)
    bos, eos, unk, pad = SPECIAL_TOKENS
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=bos, eos_token=eos, unk_token=unk, pad_token=pad,
        model_max_length=model_max_length, add_bos_token=False, add_eos_token=False,
        clean_up_tokenization_spaces=False,
    )  # fmt: skip


def _train(model, ids: list[int], spec: TinySpec) -> None:
    """Train ``model`` in place for ``spec.train_steps`` AdamW steps on random windows of ``ids`` (one thread)."""
    import torch

    data = torch.tensor(ids, dtype=torch.long)
    if len(data) <= spec.seq_len:
        raise ValueError(f"training text has {len(data)} tokens; need more than seq_len={spec.seq_len}")
    gen = torch.Generator().manual_seed(spec.seed + 1)
    opt = torch.optim.AdamW(model.parameters(), lr=spec.learning_rate, weight_decay=0.01, betas=(0.9, 0.95))
    warmup = max(1, spec.train_steps // 10)

    def schedule(step: int) -> float:
        return min(1.0, (step + 1) / warmup) * max(0.05, 1.0 - step / spec.train_steps)

    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    model.train()
    for _ in range(spec.train_steps):
        starts = torch.randint(0, len(data) - spec.seq_len, (spec.batch_size,), generator=gen)
        batch = torch.stack([data[s : s + spec.seq_len] for s in starts.tolist()])
        loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
    model.eval()


def build_tiny_model(spec: TinySpec, out_dir: str | os.PathLike[str], text: str | None = None) -> Path:
    """Build the model described by ``spec`` into ``out_dir`` (created if missing) and return it as a Path.

    ``text`` (default: the packaged sample) trains the tokenizer and, when ``spec.train_steps > 0``, the model.
    Writes ``config.json``, ``generation_config.json``, ``model.safetensors`` (float32) and the tokenizer files.
    Deterministic: uses one CPU thread while building and restores the previous thread count afterwards.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    text = sample_text() if text is None else text
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer([text], spec.vocab_size, model_max_length=spec.max_position_embeddings)
    config = LlamaConfig(
        vocab_size=spec.vocab_size, hidden_size=spec.hidden_size, num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads,
        intermediate_size=spec.intermediate_size, max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, rms_norm_eps=1e-5,
        dtype="float32",
    )  # fmt: skip
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(spec.seed)
        model = LlamaForCausalLM(config).float()
        if spec.train_steps > 0:
            _train(model, tokenizer(text, verbose=False)["input_ids"], spec)
        model.generation_config.do_sample = False
        model.save_pretrained(out, safe_serialization=True)
    finally:
        torch.set_num_threads(threads)
    tokenizer.save_pretrained(out)
    return out


def spec_key(spec: TinySpec, text: str | None = None) -> str:
    """Cache key ``<name>-<16 hex>``: a hash of the spec, the text, CODE_VERSION, and torch/transformers versions."""
    import tokenizers
    import torch
    import transformers

    text = sample_text() if text is None else text
    payload = json.dumps(
        {
            "spec": dataclasses.asdict(spec), "code_version": CODE_VERSION,
            "text_sha256": hashlib.sha256(text.encode("utf-8")).hexdigest(),
            "versions": [torch.__version__, transformers.__version__, tokenizers.__version__],
        },
        sort_keys=True,
    )  # fmt: skip
    return f"{spec.name}-{hashlib.sha256(payload.encode('utf-8')).hexdigest()[:16]}"


def default_cache_dir() -> Path:
    """``$DISTPERP_CACHE`` if set, else ``~/.cache/distperp``."""
    return Path(os.environ.get("DISTPERP_CACHE") or Path.home() / ".cache" / "distperp")


def cached_tiny_model(spec: TinySpec, cache_dir: str | os.PathLike[str] | None = None, text: str | None = None) -> Path:
    """Return ``<cache_dir>/models/<spec_key(spec, text)>``, building it first if it does not exist.

    The build happens in a temporary directory beside the target, which is then renamed into place; the rename
    is atomic, so a directory at the target is always complete. If another process renamed first, its copy is
    used and ours is discarded. ``cache_dir`` defaults to :func:`default_cache_dir`.
    """
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    final = root / "models" / spec_key(spec, text)
    if (final / "config.json").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        build_tiny_model(spec, tmp, text)
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0o700
        try:
            os.rename(tmp, final)
        except OSError:  # another process renamed first: use theirs
            if not (final / "config.json").is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


DEMO_BUILD = "about a minute on 2 CPU cores"
"""How long building :data:`DEMO_SPEC` takes (measured: README, "First command")."""


def demo_model() -> Path:
    """:func:`cached_tiny_model` of :data:`DEMO_SPEC`; when it has to build, one line on stderr says so and one
    how long it took (the folder alone goes to stdout: ``$(distperp demo-model)``)."""
    import sys
    import time

    built = (default_cache_dir() / "models" / spec_key(DEMO_SPEC) / "config.json").is_file()
    if not built:
        print(f"distperp demo-model: building the demo model once ({DEMO_BUILD}); then cached", file=sys.stderr)
    t0 = time.perf_counter()
    folder = cached_tiny_model(DEMO_SPEC)
    if not built:
        print(f"distperp demo-model: built in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return folder


def main(argv: list[str] | None = None) -> None:
    """CLI: build (or reuse from the cache) the demo or test model and print its directory."""
    parser = argparse.ArgumentParser(prog="python -m distperp_harness.commands.tiny", description=main.__doc__)
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--demo", action="store_true", help="the trained demo model (default)")
    which.add_argument("--test", action="store_true", help="the tiny random test model")
    parser.add_argument("--out", help="build into this directory instead of the cache")
    args = parser.parse_args(argv)
    spec = TEST_SPEC if args.test else DEMO_SPEC
    print(build_tiny_model(spec, args.out) if args.out else cached_tiny_model(spec))


if __name__ == "__main__":
    main()
