"""A float64 miniature of a loaded causal LM: the same configuration and model class, every positional and attention
setting kept, the widths shrunk, at least one layer of each kind, random weights sharp enough that a wrong mask or
position moves a log-probability far past float64 rounding.

Rules (the key lists are ``miniature_keys.py``'s):

- The loaded configuration is copied whole (``to_dict``) and only width keys change: per-head sizes divide by one
  power of two down to ~16 (kept where a rope array, a rope section or an absolute ``rotary_dim`` depends on them,
  halved less where a ``partial_rotary_factor`` would leave an odd rotary size), query heads become 2 with key-value
  heads of the same kind (multi-head 2/2, multi-query 2/1, grouped 4/2), model and feed-forward widths and low-rank
  sizes divide by the model width's factor (at most 8 times the new width), experts are at most 4 (2 per token), the
  vocabulary 128 (special ids past it move into its last 16 ids), state sizes at most 16.
- Depth: the shortest prefix of each block of the real layer stack (one block, or blocks of their own such as Gemma
  3n's layers sharing keys and values) that holds every kind of layer: kinds come from per-layer lists
  (``layer_types``, ``no_rope_layers``, …), lists of layer indices, integer patterns (``first_k_dense_replace``,
  interleave steps, window patterns) and the modules each layer builds (on the meta device: classes, attributes and
  parameter shapes). Per-layer lists are cut to the kept layers.
- Towers besides the text model (vision, audio) get their own factors and one layer; their sizes equal to a width
  (theirs or the text model's) follow it.
"""

from __future__ import annotations

import json
import math
from typing import Any

from distperp_harness.model import miniature_keys as keys
from distperp_harness.model.miniature_layers import keep_layers, layer_plan
from distperp_harness.model.miniature_widths import remap_special_ids, shrink_tree

GAIN = 2.0
"""Weights are drawn with standard deviation ``GAIN / sqrt(fan_in)`` (embeddings 0.5): attention scores and logits
of order several units, so attention is far from uniform and log-probabilities spread over several nats."""
EMBEDDING_STD = 0.5


def miniature_config(config: Any) -> Any:
    """A configuration of the same class as ``config`` (the loaded model's, any transformers causal LM), with every
    positional and attention setting kept and the widths shrunk, or the one-line reason none can be built."""
    module = type(config).__module__
    if not module.startswith("transformers."):
        return f"remote code ({module}.{type(config).__name__}): no miniature of a class transformers does not ship"
    try:
        return _miniature(config)
    except Exception as error:  # a foreign class's failure is a reason, not a crash
        return _reason(error)


def _reason(error: BaseException) -> str:
    """``error`` in one line: its type and first line (with the next where the first ends with a colon)."""
    text = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    first = " ".join(text[:2]) if len(text) > 1 and text[0].endswith(":") else (text[0] if text else "")
    return f"{type(error).__name__}: {first[:300]}"


def _miniature(config: Any) -> Any:
    whole = {k: v for k, v in config.to_dict().items() if k not in keys.DROPPED_KEYS}
    text_key = _text_key(config)
    text = whole[text_key] if text_key else whole
    count_key = next((k for k in keys.LAYER_COUNT_KEYS if isinstance(text.get(k), int)), None)
    shrunk = shrink_tree(whole, text_key)
    vocab = min(int(text.get("vocab_size") or keys.VOCAB), keys.VOCAB)
    remap_special_ids(shrunk, vocab)

    def at_layers(kept: list[int]) -> Any:
        tree = json.loads(json.dumps(shrunk))  # a deep copy of plain values
        level = tree[text_key] if text_key else tree
        if count_key is not None:
            keep_layers(level, count_key, text[count_key], kept)
        return type(config).from_dict(tree)

    if count_key is None or text[count_key] <= 1:
        return at_layers([0])
    kept = layer_plan(text, count_key, at_layers)
    return kept if isinstance(kept, str) else at_layers(kept)


def _text_key(config: Any) -> str | None:
    """The key of the text model's sub-configuration in a composite configuration, ``None`` when it is the whole."""
    text = config.get_text_config()
    if text is config:
        return None
    return next((k for k in getattr(config, "sub_configs", {}) or {} if getattr(config, k, None) is text), None)


def build_miniature(config: Any, *, attn_implementation: str, device: Any, seed: int = 0) -> Any:
    """The miniature causal LM of ``config`` (the model class ``AutoModelForCausalLM.from_config`` builds for its
    type) on ``device`` in float64 (but for the parts the class keeps in float32, as in the real model: its code
    computes them in float32), random weights drawn from ``seed`` (:func:`sharpen`), eval mode; or the one-line
    reason none can be built. The same weights on every call and every rank; the global random state is left as it
    was. Experts run their eager loop (grouped matrix products have no float64 kernel)."""
    mini = miniature_config(config)
    if isinstance(mini, str):
        return mini
    import torch
    from transformers import AutoModelForCausalLM

    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(
                mini, attn_implementation=attn_implementation, experts_implementation="eager", dtype=torch.float64
            )
        sharpen(model, seed)
        return model.to(device).eval()
    except Exception as error:  # a foreign class's failure is a reason, not a crash
        return _reason(error)


def sharpen(model: Any, seed: int = 0) -> None:
    """Redraws ``model``'s matrices from a generator seeded with ``seed``: linear maps (and expert stacks) with
    standard deviation ``GAIN / sqrt(fan_in)``, embedding tables (tokens, learned positions) with
    :data:`EMBEDDING_STD`, a token table tied to the output head as the head; the head is scaled against the model's
    own logit map (:func:`_logit_gain`). A matrix shared by two modules is drawn once. Norms,
    biases, convolutions and state-space parameters keep the model's own initialization."""
    import torch
    from transformers.pytorch_utils import Conv1D

    generator = torch.Generator().manual_seed(seed)
    seen: set[int] = set()

    def draw(parameter: Any, std: float) -> None:
        if id(parameter) in seen or not parameter.is_floating_point():
            return
        seen.add(id(parameter))
        noise = torch.randn(parameter.shape, generator=generator, dtype=torch.float64)
        with torch.no_grad():
            parameter.copy_(noise * std)

    output = model.get_output_embeddings()
    head = getattr(output, "weight", None)
    gain = _logit_gain(model.config)
    for module in model.modules():
        if isinstance(module, torch.nn.Embedding):  # a table tied to the output head is drawn as the head
            tied = module.weight is head
            draw(module.weight, gain * GAIN / math.sqrt(module.embedding_dim) if tied else EMBEDDING_STD)
        elif isinstance(module, torch.nn.Linear):
            draw(module.weight, (gain if module is output else 1.0) * GAIN / math.sqrt(module.in_features))
        elif isinstance(module, Conv1D):
            draw(module.weight, GAIN / math.sqrt(module.weight.shape[0]))
        elif not isinstance(module, (torch.nn.modules.conv._ConvNd,)):
            for parameter in module.parameters(recurse=False):
                if parameter.dim() == 3:  # an expert stack: (experts, in, out) or (experts, out, in)
                    draw(parameter, GAIN / math.sqrt(math.sqrt(parameter.shape[1] * parameter.shape[2])))


def _logit_gain(config: Any) -> float:
    """The factor undoing the configuration's fixed logit map (Cohere's ``logit_scale`` multiplies logits,
    Granite's and MiniCPM's ``logits_scaling`` and Inkling's ``logits_mup_width_multiplier`` divide them), within
    [1/100, 100]: the miniature's logits spread over several nats whatever the map, which stays in place."""
    text = config.get_text_config()
    factor = 1.0
    scale = getattr(text, "logit_scale", None)
    if isinstance(scale, (int, float)) and not isinstance(scale, bool) and scale > 0:
        factor *= scale
    for key in ("logits_scaling", "logits_mup_width_multiplier"):
        divisor = getattr(text, key, None)
        if isinstance(divisor, (int, float)) and not isinstance(divisor, bool) and divisor > 0:
            factor /= divisor
    return min(100.0, max(0.01, 1.0 / factor))
