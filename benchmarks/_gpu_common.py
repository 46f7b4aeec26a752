"""What the prepared device checks share (``gpu_check``, ``shard_check``): the models they build, their documents,
their options and the GiB format."""

from __future__ import annotations

import argparse
from pathlib import Path

from distperp_harness.commands.tiny import CHECK_SPEC, TinySpec, build_tiny_model, sample_text

LLAMA_1B = TinySpec(
    vocab_size=128256,
    hidden_size=2048,
    num_layers=16,
    num_heads=32,
    num_kv_heads=8,
    intermediate_size=8192,
    max_position_embeddings=2048,
    tie_word_embeddings=True,
    seed=0,
    name="gpu-check-llama-1b",
)
DRY_SPEC = CHECK_SPEC
"""The dry-run model: ``distperp check``'s own (every Linear int4-quantizable, so quantize=int4 quantizes every Linear
layer of the decoder; the test model quantizes 2 of 15)."""


def build_model(args: argparse.Namespace) -> Path:
    """``--model``, else the random Llama-3.2-1B-shaped model (cuda) or the dry-run model (cpu), built once into
    ``args.work``."""
    if args.model:
        return Path(args.model)
    spec = LLAMA_1B if args.device == "cuda" else DRY_SPEC
    out = Path(args.work) / spec.name
    if not (out / "config.json").exists():
        build_tiny_model(spec, out)
    return out


def documents(tokens: int) -> list[str]:
    """Copies of the packaged sample, each a separate document, about ``tokens`` tokens in all (~4 chars/token)."""
    text = sample_text()
    return [f"{text}\n(copy {i})" for i in range(max(1, tokens * 4 // len(text)))]


def model_args(args: argparse.Namespace, model: Path, scheme: str, compiled: bool = False) -> dict:
    kwargs = dict(
        pretrained=str(model), device=args.device, batch_size="auto", max_length=args.max_length, compile=compiled
    )
    if args.device == "cuda":
        kwargs["dtype"] = "bfloat16"
    if scheme == "int4-kernel":  # torchao's int4 kernel for every product (no dense prefill path)
        kwargs.update(quantize="int4", int4_prefill="kernel")
    elif scheme != "none":
        kwargs["quantize"] = scheme
    return kwargs


def gib(value: float | None) -> str:
    """``value`` bytes in GiB with two decimals; ``n/a`` for None."""
    return "n/a" if value is None else f"{value / 2**30:.2f}"


def base_parser(doc: str, launch_timeout: float) -> argparse.ArgumentParser:
    """The options every prepared GPU check shares (``shard_check`` too)."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--model", default=None, help="checkpoint folder (default: random Llama-3.2-1B shape)")
    parser.add_argument("--work", default=None, help="folder for the built model (default: a temporary one)")
    parser.add_argument("--json", default=None, help="also write the rows here")
    parser.add_argument("--launch-timeout", type=float, default=launch_timeout)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--max-length", type=int, default=None, help="cuda 2048, cpu 64")
    return parser


def parse(parser: argparse.ArgumentParser, argv: list[str] | None, tokens: tuple[int, int]) -> argparse.Namespace:
    """Parsed arguments with the device-dependent defaults filled in (``tokens``: cuda, cpu)."""
    args = parser.parse_args(argv)
    cuda = args.device == "cuda"
    args.tokens = args.tokens or tokens[0 if cuda else 1]
    args.max_length = args.max_length or (2048 if cuda else 64)
    return args
