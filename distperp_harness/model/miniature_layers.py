"""A miniature's depth: the shortest prefix of the real layer stack holding every kind of layer, and the per-layer
settings cut to it.

A layer's kind is what the configuration says of it (its entry in each per-layer list, whether a list of layer
indices names it, where integer patterns put it: a first dense block, every n-th layer) and what it builds: the
classes, integer/string/boolean attributes and parameter shapes of its modules, read from a build on the meta device
(no memory, no initialization). Layer indices themselves are not a kind.
"""

from __future__ import annotations

import json
from typing import Any, Callable, TypeGuard

from distperp_harness.model import miniature_keys as keys

CAP = 12
"""The depth a miniature aims to stay within; a prefix the configuration's lists need may reach :data:`HARD_CAP`."""
HARD_CAP = 24
_INDEX_WORDS = ("idx", "index", "layer_id", "layer_num", "layer_number", "block_id")
_DERIVED = ("store_full_length_kv", "training")
"""Module attributes that follow from where a layer sits, not from its kind (the last layer of each type before a
shared block keeps its keys and values for it: the miniature's own stack marks its own)."""


def layer_plan(text: dict[str, Any], count_key: str, at_layers: Callable[[list[int]], Any]) -> list[int] | str:
    """The layers of ``text`` (the text model's configuration as a dict, ``count_key`` its depth key) a miniature
    keeps, in order: the shortest prefix of each block of the stack (:func:`blocks`) holding every kind of layer of
    that block. ``at_layers(kept)`` builds the miniature configuration of the ``kept`` layers. A reason when a kind
    first appears past :data:`HARD_CAP` layers."""
    depth = text[count_key]
    kinds = config_kinds(text, depth)
    segments = [segment for _, segment in blocks(text, depth)]
    needs = [_prefix([kinds[i] for i in segment]) for segment in segments]
    if sum(needs) > HARD_CAP:
        return f"a kind of layer first appears at layer {max(needs)} of {depth}: past the miniature's {HARD_CAP} layers"
    scans = [list(segment[: max(CAP, need)]) for segment, need in zip(segments, needs)]
    scanned = [i for scan in scans for i in scan]
    built = dict(zip(scanned, module_signatures(at_layers(scanned), len(scanned))))
    sizes = [max(need, _prefix([(kinds[i], built[i]) for i in scan])) for scan, need in zip(scans, needs)]
    for extra in range(_EXTRA_TRIES):  # a class may constrain block sizes (Dory stores layers as pairs): one more
        kept = [i for scan, n in zip(scans, sizes) for i in scan[: n + extra]]
        try:
            at_layers(kept)
            return kept
        except Exception:  # the class's validation: try one more layer per block, then give its reason
            if extra == _EXTRA_TRIES - 1:
                raise
    return kept


_EXTRA_TRIES = 2


def blocks(level: dict[str, Any], depth: int) -> list[tuple[str | None, range]]:
    """The layer stack's blocks, each with the key that holds its size: consecutive blocks whose sizes sum to the
    depth (``n_input_layers``, ``n_recurrent_layers``, ``n_output_layers``), a trailing block
    (``num_kv_shared_layers``), or the whole stack as one block."""
    for names in keys.BLOCK_KEYS:
        sizes = [n for k in names if positive_int(n := level.get(k))]
        if len(sizes) == len(names) and sum(sizes) == depth:
            starts = [sum(sizes[:j]) for j in range(len(sizes))]
            return [(k, range(a, a + n)) for k, a, n in zip(names, starts, sizes)]
    for key in keys.TAIL_COUNT_KEYS:
        if positive_int(tail := level.get(key)) and tail < depth:
            return [(None, range(0, depth - tail)), (key, range(depth - tail, depth))]
    return [(None, range(depth))]


def _prefix(kinds: list[Any]) -> int:
    first: dict[Any, int] = {}
    for i, kind in enumerate(kinds):
        first.setdefault(kind, i)
    return max(first.values()) + 1


def _per_layer(key: str, value: Any, depth: int) -> bool:
    if key in keys.NOT_PER_LAYER or key in keys.LAYER_INDEX_KEYS or key.endswith(keys.SPECIAL_ID_SUFFIXES) or depth < 2:
        return False
    if isinstance(value, str):
        return len(value) == depth and ("pattern" in key or "block_type" in key)
    return isinstance(value, list) and len(value) == depth


def config_kinds(text: dict[str, Any], depth: int) -> list[str]:
    """Each layer's kind as the configuration states it (per-layer lists, index lists, integer patterns)."""
    lists = [k for k, v in text.items() if _per_layer(k, v, depth)]
    indices = [k for k in keys.LAYER_INDEX_KEYS if isinstance(text.get(k), list)]
    patterns = [(k, rule, text[k]) for k, rule in keys.PATTERN_KEYS.items() if positive_int(text.get(k))]
    if isinstance(text.get("attention_types"), list):
        lists.append("attention_types")
        text = {**text, "attention_types": _expand_attention_types(text["attention_types"])}
    return [
        json.dumps(
            [
                [text[k][i] == i if k in keys.SOURCE_LAYER_KEYS else text[k][i] for k in lists],
                [i in text[k] for k in indices],
                [rule(i, v) for _, rule, v in patterns],
            ],
            default=str,
        )
        for i in range(depth)
    ]


def positive_int(value: Any) -> TypeGuard[int]:
    """Whether ``value`` is an integer (not a boolean) above 0: a size or count a configuration sets."""
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _expand_attention_types(value: list[Any]) -> list[Any]:
    """GPT-Neo's ``[[["global", "local"], 12]]`` as one entry per layer."""
    return [kind for kinds, repeat in value for _ in range(repeat) for kind in kinds]


def module_signatures(config: Any, depth: int) -> list[str]:
    """What each of the first ``depth`` layers of the model ``config`` describes builds, as a comparable string."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    with torch.device("meta"), no_init_weights():
        model = AutoModelForCausalLM.from_config(config)
    stacks = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) == depth]
    return [repr([_signature(stack[i]) for stack in stacks]) for i in range(depth)]


def _signature(layer: Any) -> list[Any]:
    parts: list[Any] = []
    for name, module in layer.named_modules():
        attrs = sorted(
            (k, v)
            for k, v in vars(module).items()
            if not k.startswith("_")
            and isinstance(v, (bool, int, str, type(None)))
            and k not in _DERIVED
            and not any(w in k.lower() for w in _INDEX_WORDS)
        )
        shapes = [
            (n, tuple(t.shape))
            for n, t in (*module.named_parameters(recurse=False), *module.named_buffers(recurse=False))
        ]
        parts.append((name, type(module).__name__, attrs, shapes))
    return parts


def keep_layers(level: dict[str, Any], count_key: str, depth: int, kept: list[int]) -> None:
    """Cuts ``level`` (a configuration dict of ``depth`` layers) down to the layers ``kept``, in place: the depth
    keys, per-layer lists, index lists (renumbered), GPT-Neo's ``attention_types``, per-layer dicts keyed by layer
    number and the sizes of blocks (:func:`blocks`)."""
    where = {old: new for new, old in enumerate(kept)}
    sizes = {key: sum(i in block for i in kept) for key, block in blocks(level, depth) if key}
    for key, value in list(level.items()):
        if key == count_key or (key in keys.LAYER_COUNT_KEYS and value == depth):
            level[key] = len(kept)
        elif key in sizes:
            level[key] = sizes[key]
        elif key == "attention_types" and isinstance(value, list):
            level[key] = [[[_expand_attention_types(value)[i] for i in kept], 1]]
        elif _per_layer(key, value, depth):
            level[key] = (
                type(value)([value[i] for i in kept]) if isinstance(value, list) else "".join(value[i] for i in kept)
            )
        elif key in keys.LAYER_INDEX_KEYS and isinstance(value, list):
            level[key] = [where[i] for i in value if i in where]
        elif isinstance(value, dict) and value and all(isinstance(k, str) and k.isdigit() for k in value):
            width = len(next(iter(value)))
            level[key] = {str(where[int(k)]).zfill(width): v for k, v in value.items() if int(k) in where}
