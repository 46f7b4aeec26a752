"""How a miniature's configuration shrinks: widths, head counts, per-head sizes, experts, vocabularies and special
ids, level by level (the text model, its parts, other towers), by the rules ``miniature.py`` states and the key
lists of ``miniature_keys.py``. Every key outside those lists is copied unchanged."""

from __future__ import annotations

import math
from typing import Any

from distperp_harness.model import miniature_keys as keys
from distperp_harness.model.miniature_layers import keep_layers, positive_int

TARGET_HEAD_DIM = 16
"""Per-head sizes are divided down to about this."""
_TOWER_DEPTH = 1


def _is_level(d: dict[str, Any]) -> bool:
    """A (sub-)configuration with widths of its own: it gets its own factors (a tower), others share their
    parent's (MPT's ``attn_config``, DBRX's ``ffn_config``)."""
    return any(isinstance(d.get(k), int) for k in (*_HIDDEN_KEYS, *keys.HEAD_COUNT_ORDER))


def _is_tower(d: dict[str, Any]) -> bool:
    """A sub-configuration of a model of its own (text, vision, audio): not a part of its parent (MPT's
    ``attn_config``) nor one layer's settings."""
    return "model_type" in d and _is_level(d)


_HIDDEN_KEYS = ("hidden_size", "n_embd", "d_model", "dim", "emb_dim", "embedding_dim")


def shrink_tree(whole: dict[str, Any], text_key: str | None) -> dict[str, Any]:
    """Every level of the configuration tree shrunk; towers other than the text model get one layer."""
    top = _Factors.of(whole)
    out = top.apply(whole)
    for key, value in whole.items():
        if isinstance(value, dict) and key != text_key and _is_tower(value):
            tower = _Factors.of(value).apply(value)
            width = next((k for k in _HIDDEN_KEYS if positive_int(value.get(k))), None)
            if width:
                _follow_width(tower, None, value[width], tower[width])
            count = next((k for k in keys.LAYER_COUNT_KEYS if isinstance(value.get(k), int)), None)
            if count is not None:
                keep_layers(tower, count, value[count], list(range(min(value[count], _TOWER_DEPTH))))
            out[key] = tower
    if text_key:
        out[text_key] = _Factors.of(whole[text_key]).apply(whole[text_key])
        text = (whole[text_key], out[text_key])
        width = next((k for k in _HIDDEN_KEYS if positive_int(text[0].get(k))), None)
        if width:
            _follow_width(out, text_key, text[0][width], text[1][width])
    return out


def _follow_width(tree: dict[str, Any], text_key: str | None, old: int, new: int) -> None:
    """Sizes outside the text model equal to a width (a tower's own, or the text model's: an adapter's input or
    output) follow it, in place."""
    for key, value in tree.items():
        if key == text_key or key in ("id2label", "label2id"):
            continue
        if isinstance(value, dict):
            _follow_width(value, text_key, old, new)
        elif value == old and positive_int(value) and any(w in key for w in ("dim", "size", "hidden")):
            tree[key] = new


class _Factors:
    """How one level's sizes shrink: per-head sizes by ``fd``, head counts by ``fc``, widths by ``f``."""

    def __init__(self, heads: tuple[int, int] | None, fd: int, fc: float, f: float, kv: dict[str, int]) -> None:
        self.heads, self.fd, self.fc, self.f, self.kv = heads, fd, fc, f, kv
        self.cap = 1 << 30

    def capped(self, width: int | None) -> _Factors:
        """These factors with widths at most :data:`keys.MAX_WIDTH_RATIO` times the new model ``width``."""
        if width:
            self.cap = keys.MAX_WIDTH_RATIO * width
        return self

    @classmethod
    def of(cls, d: dict[str, Any]) -> _Factors:
        head_key = next((k for k in keys.HEAD_COUNT_ORDER if positive_int(d.get(k))), None)
        hidden_key = next((k for k in _HIDDEN_KEYS if positive_int(d.get(k))), None)
        hidden = d[hidden_key] if hidden_key else None
        dims = {k: d[k] for k in keys.HEAD_DIM_KEYS if positive_int(d.get(k))}
        derived = head_key is not None and hidden is not None and not dims
        if head_key is not None and hidden is not None and derived:
            dims["head_dim"] = hidden // d[head_key]
        fd = _head_dim_factor(d, dims)
        if head_key is None:
            new_hidden = min(hidden, 64) if hidden else None
            return cls(None, fd, 1.0, hidden / new_hidden if hidden and new_hidden else 1.0, {}).capped(new_hidden)
        h_old = d[head_key]
        h_new = min(h_old, keys.MAX_HEADS)
        tied = [d[k] for k, size in keys.TIED_HEAD_KEYS.items() if positive_int(d.get(k)) and positive_int(d.get(size))]
        if tied and h_old > h_new * min(tied) and h_old % min(tied) == 0:
            h_new = h_old // min(tied)  # state-space heads divide by the same factor, to one at least
        h_new, kv = _heads(d, head_key, h_old, h_new)
        fc = h_old / h_new
        if hidden is None:
            return cls((h_old, h_new), fd, fc, fc * fd, kv)
        new_hidden = h_new * dims["head_dim"] // fd if derived else max(16, _even(hidden / (fc * fd)))
        return cls((h_old, h_new), fd, fc, hidden / new_hidden, kv).capped(new_hidden)

    def apply(self, d: dict[str, Any]) -> dict[str, Any]:
        """``d`` with this level's keys shrunk; nested dicts without widths of their own (not rope settings, not
        towers) shrink by the same factors."""
        out = dict(d)
        local = self.kv
        head_key = next((k for k in keys.HEAD_COUNT_ORDER if positive_int(d.get(k))), None)
        if self.heads and head_key:  # a part of the level with heads of its own (one layer's settings)
            local = {**self.kv, **_heads(d, head_key, d[head_key], self._one_count(d[head_key]))[1]}
        for key, value in d.items():
            if isinstance(value, dict):
                if "rope" not in str(key) and key not in ("id2label", "label2id") and not _is_tower(value):
                    out[key] = self.apply(value)
                continue
            new = local[key] if key in local and positive_int(value) else self._one(key, value)
            if new is not _KEEP:
                out[key] = new
        return out

    def _one_count(self, value: int) -> int:
        if self.heads is None:
            return value
        return self.heads[1] if value == self.heads[0] else max(1, round(value / self.fc))

    def _one(self, key: str, value: Any) -> Any:
        if isinstance(value, list) and key in keys.WIDTH_KEYS and all(positive_int(v) for v in value):
            return [min(self.cap, max(2, _even(v / self.f))) for v in value]
        if not positive_int(value):
            return _KEEP
        if key in keys.HEAD_COUNT_KEYS and self.heads:
            return self._one_count(value)
        if key in keys.KV_HEAD_KEYS or key in keys.OTHER_COUNT_KEYS:
            return max(1, math.ceil(value / self.fc))
        if key in keys.HEAD_DIM_KEYS:
            return value // self.fd
        if key in keys.WIDTH_KEYS:
            return min(self.cap, max(4, _even(value / self.f)))
        if key in keys.STATE_KEYS:
            return min(value, 16)
        if key in keys.EXPERT_KEYS:
            return min(value, 4)
        if key in keys.TOP_K_KEYS:
            return min(value, 2)
        if key in keys.SHARED_EXPERT_KEYS:
            return min(value, 1)
        if key in keys.EXPERT_GROUP_KEYS:
            return min(value, 2)
        if key in keys.EXPERT_GROUP_KEYS.values():
            return 1
        if key in keys.VOCAB_KEYS:
            return min(value, keys.VOCAB)
        return _KEEP


_KEEP = object()


def _even(x: float) -> int:
    return max(2, 2 * round(x / 2))


def _rope_lists(d: dict[str, Any]) -> bool:
    """Whether a rope setting holds an array or a section list, whose length follows the head size."""
    return any(
        (isinstance(v, dict) and "rope" in str(k) and _holds_list(v)) or (k in _SECTION_KEYS and isinstance(v, list))
        for k, v in d.items()
    )


def _holds_list(d: dict[str, Any]) -> bool:
    return any(isinstance(v, list) or (isinstance(v, dict) and _holds_list(v)) for v in d.values())


_SECTION_KEYS = ("mrope_section", "rope_section", "long_factor", "short_factor")


def _rotary_factors(d: Any) -> list[float]:
    found: list[float] = []
    if isinstance(d, dict):
        for k, v in d.items():
            if k in ("partial_rotary_factor", "rotary_pct") and isinstance(v, (int, float)) and v not in (0, 1):
                found.append(float(v))
            elif isinstance(v, dict) and ("rope" in k or k in _ROPE_LEVELS):
                found.extend(_rotary_factors(v))
    return found


_ROPE_LEVELS = ("full_attention", "sliding_attention")


def _head_dim_factor(d: dict[str, Any], dims: dict[str, int]) -> int:
    """The power of two every per-head size divides by: 1 where rope arrays follow the head size; never leaving an
    absolute ``rotary_dim`` more than the head, a per-head size under 4, or an odd partial rotary size."""
    if not dims or _rope_lists(d):
        return 1
    largest, smallest = max(dims.values()), min(dims.values())
    fd = 1
    while largest // (fd * 2) >= TARGET_HEAD_DIM and smallest % (fd * 4) == 0 and smallest // (fd * 2) >= 4:
        fd *= 2
    rotary = rotary_dim if positive_int(rotary_dim := d.get("rotary_dim")) else 0
    factors = _rotary_factors(d)
    head = dims.get("head_dim", largest)
    while fd > 1 and (
        head // fd < rotary
        or any(not _even_integer(head // fd * p) for p in factors)
        or any(v % (2 * fd) for v in dims.values())
    ):
        fd //= 2
    return fd


def _even_integer(x: float) -> bool:
    """Whether ``int(x)`` (how rope code sizes a partial rotary part) is a positive even size."""
    return int(x) > 0 and int(x) % 2 == 0


def _heads(d: dict[str, Any], head_key: str, h_old: int, h_new: int) -> tuple[int, dict[str, int]]:
    """The new query head count (``h_new``, raised to 4 for grouped heads) and the new value of each key-value head
    key grouping ``head_key`` in ``d``: multi-head stays multi-head, multi-query stays multi-query, grouped stays
    grouped (4 queries over 2)."""
    kv: dict[str, int] = {}
    for key, partners in keys.KV_HEAD_KEYS.items():
        if not positive_int(value := d.get(key)) or head_key not in partners:
            continue
        if value >= h_old:
            kv[key] = h_new
        elif value == 1:
            kv[key] = 1
        else:
            h_new = max(h_new, min(h_old, 4))
            kv[key] = 2 if h_new % 2 == 0 and h_new > 2 else 1
    return h_new, kv


def remap_special_ids(tree: dict[str, Any], vocab: int) -> None:
    """Moves every special token id at or past ``vocab`` into the last :data:`keys.SPECIAL_BLOCK` ids, distinct ids
    to distinct ids where the block allows (in place, over the whole tree)."""
    found: set[int] = set()
    _special_ids(tree, found.update)
    large = sorted(i for i in found if i >= vocab)
    block = min(keys.SPECIAL_BLOCK, vocab)
    mapping = {old: vocab - 1 - (rank % block) for rank, old in enumerate(large)}
    _special_ids(tree, lambda ids: None, mapping)


def _special_ids(tree: dict[str, Any], sink: Any, mapping: dict[int, int] | None = None) -> None:
    for key, value in tree.items():
        if isinstance(value, dict) and key not in ("id2label", "label2id"):
            _special_ids(value, sink, mapping)
        elif key.endswith(keys.SPECIAL_ID_SUFFIXES) or key in keys.SPECIAL_ID_KEYS:
            ids = (
                [value]
                if positive_int(value)
                else [v for v in value if positive_int(v)]
                if isinstance(value, list)
                else []
            )
            sink(ids)
            if mapping is not None and ids:
                tree[key] = (
                    mapping.get(value, value)
                    if not isinstance(value, list)
                    else [mapping.get(v, v) if positive_int(v) else v for v in value]
                )
