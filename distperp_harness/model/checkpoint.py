"""Facts about the checkpoint ``pretrained`` names, read before its weights: where it lives (``subfolder``,
``gguf_file``), whether it was saved already quantized (a ``quantization_config`` in its ``config.json``) and how
many bytes its stored weights take.

Contracts:
* :func:`source_kwargs` gives the ``from_pretrained`` keywords of the ``pretrained`` checkpoint only: a
  ``reference=<path>`` or ``delta=`` model is a checkpoint of its own, without ``subfolder``/``gguf_file``.
* :func:`check_gguf` fails before anything is loaded when ``gguf_file`` is given but the ``gguf`` package is
  missing or the file is not in a local ``pretrained`` folder (one ``ValueError`` naming the install or the file).
* :func:`stored_quantization` is the stored config as a dict (``quant_method`` and the rest), or None.
* :func:`refuse_on_stored` rejects ``quantize=`` on top of a pre-quantized checkpoint (its weights are no longer
  full precision); ``reference=base`` without ``quantize=`` never reaches it (:class:`Options` refuses it).
* :func:`stored_weight_bytes` sums the sizes of a local checkpoint's weight files (``*.safetensors``, ``*.bin``,
  ``*.pt``; a GGUF checkpoint is dequantized while loading, so it is sized from its config, not its file).
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

from distperp_harness.errors import InputError
from distperp_harness.options import Options

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def source_kwargs(options: Options, key: str = "pretrained") -> dict[str, str]:
    """``subfolder`` / ``gguf_file`` keywords for ``from_pretrained`` of the ``pretrained`` checkpoint."""
    if key != "pretrained":
        return {}
    out = {}
    if options.subfolder:
        out["subfolder"] = options.subfolder
    if options.gguf_file:
        out["gguf_file"] = options.gguf_file
    return out


def check_gguf(options: Options) -> None:
    """``gguf_file`` needs the ``gguf`` package and (in a local folder) the file; ValueError otherwise."""
    if not options.gguf_file:
        return
    if importlib.util.find_spec("gguf") is None:
        raise InputError(
            f"gguf_file={options.gguf_file!r} needs the 'gguf' package (transformers reads GGUF "
            "files with it), which is not installed. Fix: pip install 'gguf>=0.10' "
            "(or pip install 'distperp-harness[checkpoints]')."
        )
    folder = os.path.expanduser(options.pretrained)
    if os.path.isdir(folder):
        path = os.path.join(folder, options.subfolder or "", options.gguf_file)
        if not os.path.isfile(path):
            found = (
                sorted(f for f in os.listdir(os.path.dirname(path) or ".") if f.endswith(".gguf"))
                if os.path.isdir(os.path.dirname(path))
                else []
            )
            raise InputError(
                f"gguf_file={options.gguf_file!r}: no such file in {os.path.dirname(path)!r}; "
                f"GGUF files there: {', '.join(found) or 'none'}. Fix: give gguf_file=<one of them> "
                "(a file name inside pretrained=)."
            )


def stored_quantization(config: Any) -> dict | None:
    """The ``quantization_config`` a checkpoint's config stores, as a dict; None when it stores none."""
    stored = getattr(config, "quantization_config", None)
    if stored is None:
        return None
    if not isinstance(stored, dict):
        stored = stored.to_dict() if hasattr(stored, "to_dict") else dict(vars(stored))
    return dict(stored)


def quant_method(stored: dict) -> str:
    method = stored.get("quant_method", "unknown")
    return str(getattr(method, "value", method))


def refuse_on_stored(options: Options, stored: dict | None) -> None:
    """ValueError for ``quantize=`` on top of a pre-quantized checkpoint (``reference=base`` without ``quantize=``
    is refused earlier, by :class:`~distperp_harness.options.Options`)."""
    if stored is None:
        return
    method = quant_method(stored)
    if options.quantize != "none":
        raise InputError(
            f"quantize={options.quantize} was asked for, but pretrained={options.pretrained!r} is already "
            f"quantized (its config.json stores a quantization_config, quant_method={method!r}): quantizing "
            "quantized weights again would measure neither scheme. Fix: drop quantize= to evaluate the checkpoint "
            "as saved, or give pretrained=<its full-precision source> with quantize=."
        )


def stored_weight_bytes(options: Options) -> int | None:
    """Bytes of the ``pretrained`` checkpoint's weight files on this machine (module doc), or None when it is not
    a local folder (or holds none)."""
    folder = os.path.expanduser(options.pretrained)
    if not os.path.isdir(folder):
        return _hub_weight_bytes(options)
    folder = os.path.join(folder, options.subfolder or "")
    sizes = [
        os.path.getsize(os.path.join(folder, f))
        for f in os.listdir(folder)
        if f.endswith(WEIGHT_SUFFIXES)
        and os.path.isfile(os.path.join(folder, f))
        and not f.startswith(("training_args", "optimizer", "scheduler", "rng_state"))
    ]
    return sum(sizes) or None


def _hub_weight_bytes(options: Options) -> int | None:
    """The weight files' sizes of a hub snapshot in the local cache (offline runs), else None."""
    try:
        from huggingface_hub import try_to_load_from_cache

        config = try_to_load_from_cache(  # type: ignore[call-arg]  # subfolder= is accepted; the stubs lag
            options.pretrained, "config.json", revision=options.revision, subfolder=options.subfolder or None
        )
    except Exception:
        return None
    if not isinstance(config, str):
        return None
    folder = os.path.dirname(config)
    sizes = [os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder) if f.endswith(WEIGHT_SUFFIXES)]
    return sum(sizes) or None
