"""Memory facts of a device and a model: total, free and peak bytes, activation and KV-cache bytes per token.

Pure reads (no allocation); :mod:`distperp_harness.run.budget` turns them into batching rules.
"""

from __future__ import annotations

import resource
import sys
from typing import Any, overload

import torch

from distperp_harness.model.attention import AttentionLayout, declared_layout


def activation_bytes_per_token(model: torch.nn.Module, max_length: int) -> int:
    """Bytes of live activations per input token during one forward pass and scoring (no KV cache), in the
    model's compute dtype (``w`` bytes) and for its attention implementation.

    One decoder layer's transients at a time, the larger of its two halves: attention (residual and normed input, q/k/v,
    the rotary embedding's copies of q and k, attention output and projection) and MLP (residual and normed input, gate
    activation, up projection, their product, the down projection); eager attention adds its scores over ``max_length``
    keys (in ``w``, a float32 softmax and the cast back), which sdpa/flash kernels do not hold. Plus scoring's per
    position: the last hidden state and the gathered features (``w`` each), the indices, target and float64 results (64
    bytes). Not counted: logits chunks (:func:`~distperp_harness.run.scoring.engine.forward.chunk_bytes`).
    """
    config: Any = getattr(model, "config", None)
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden = _largest_size(config, "hidden_size") or 1024
    inter = _largest_size(config, "intermediate_size") or 4 * hidden
    heads = _largest_size(config, "num_attention_heads") or 16
    kv_heads = _largest_size(config, "num_key_value_heads") or heads
    head_dim = _largest_size(config, "head_dim") or hidden // heads
    width = compute_dtype_bytes(model)
    attention = 2 * hidden + (heads + 2 * kv_heads) * head_dim + (heads + kv_heads) * head_dim + 2 * hidden
    mlp = 2 * hidden + 3 * inter + hidden
    per_layer = width * max(attention, mlp)
    if getattr(config, "_attn_implementation", None) == "eager":
        per_layer += heads * max_length * (2 * width + 4)
    scoring = 2 * width * hidden + 64
    return int(per_layer + scoring + tree_mask_bytes_per_token(max_length) * mask_count(model))


def _largest_size(config: Any, key: str) -> int | None:
    """``config.key`` as an integer: its largest layer's where it varies by layer (a list, or a configuration whose
    per-layer attributes refuse a global read, as Gemma 4's), None where it is absent."""
    try:
        value = getattr(config, key, None)
    except Exception:  # transformers' per-layer configurations raise their own error class here
        value = [getattr(layer, key, None) for layer in getattr(config, "per_layer_config", None) or ()]
    if isinstance(value, (list, tuple)):
        value = max((v for v in value if isinstance(v, int)), default=None)
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and value else None


def compute_dtype_bytes(model: torch.nn.Module) -> int:
    """Element size of the dtype activations are computed in: the input embeddings' (torchao keeps them, and
    quantized linears compute in that dtype), else the first floating-point parameter's."""
    embeddings = getattr(model, "get_input_embeddings", lambda: None)()
    weight = getattr(embeddings, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.is_floating_point():
        return weight.element_size()
    for p in model.parameters():
        if p.is_floating_point():
            return p.element_size()
    return 4


MAX_ROW_FACTOR = 4
"""Tree rows hold at most this many times ``max_length`` tokens (:func:`distperp_harness.run.runtime.row_budget`)."""


def mask_count(model: torch.nn.Module) -> int:
    """How many tree masks a forward holds: one per distinct attention rule of the model's layer types (a full and
    a sliding-window layer type need two, :mod:`distperp_harness.model.attention`)."""
    config = getattr(model, "config", None)
    layout = declared_layout(config) if config is not None else None
    return len(layout.rules) if isinstance(layout, AttentionLayout) else 1


def tree_mask_bytes_per_token(max_length: int) -> int:
    """The tree attention mask's bytes per query token in a row of ``max_length`` tokens: one float per key (sdpa on
    CPU and eager attention take the boolean mask as additive floats). Rows ``m`` times longer (``batch_size=auto``,
    :func:`distperp_harness.run.runtime.row_budget`) hold ``m`` times fewer rows per batch and ``m`` times this."""
    return 4 * max_length


def _cgroup_memory() -> tuple[int, int] | None:
    """``(limit, usage)`` of this process's cgroup (v2 ``memory.max``/``memory.current``, or v1), None when
    unlimited or unknown."""
    candidates = [
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
    ]
    for limit_path, usage_path in candidates:
        try:
            with open(limit_path, encoding="ascii") as f:
                limit = f.read().strip()
            with open(usage_path, encoding="ascii") as f:
                usage = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if limit == "max" or not limit.isdigit() or int(limit) >= 1 << 60:
            return None
        return int(limit), usage
    return None


def free_memory_bytes(device: torch.device) -> int:
    """Memory this process could still allocate on ``device``: CUDA's free memory, or on CPU the smaller of the
    system's available memory and what the cgroup limit leaves."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        import psutil

        available = int(psutil.virtual_memory().available)
    except ImportError:  # pragma: no cover - psutil ships with accelerate
        available = 8 << 30
    cgroup = _cgroup_memory()
    return available if cgroup is None else min(available, max(0, cgroup[0] - cgroup[1]))


def total_memory_bytes(device: torch.device) -> int:
    """The device's memory size: a GPU's total memory, or on CPU the smaller of physical memory and the cgroup
    limit. Unlike free memory it does not move with what other processes or the caching allocator hold."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    try:
        import psutil

        total = int(psutil.virtual_memory().total)
    except ImportError:  # pragma: no cover - psutil ships with accelerate
        total = 16 << 30
    cgroup = _cgroup_memory()
    return total if cgroup is None else min(total, cgroup[0])


def is_out_of_memory(exc: BaseException) -> bool:
    """True for the ways an allocation failure reaches Python: ``torch.OutOfMemoryError``, and ``RuntimeError``s
    from cuBLAS/cuDNN/CUDA (``CUBLAS_STATUS_ALLOC_FAILED``, ``CUDNN_STATUS_ALLOC_FAILED``, ``out of memory``)."""
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(
        marker in text
        for marker in ("ALLOC_FAILED", "out of memory", "CUDA_ERROR_OUT_OF_MEMORY", "cudaErrorMemoryAllocation")
    )


def room_bytes(device: torch.device) -> int:
    """Memory a batch could use now: free device memory plus what the CUDA caching allocator holds unused."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return free_memory_bytes(device) + int(cached)
    return free_memory_bytes(device)


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this process: CUDA allocator peak on GPU, max resident set size on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


def kv_cache_bytes_per_token(model: torch.nn.Module) -> int:
    """Bytes one token adds to a generation's KV cache: ``2 (K and V) * layers * KV heads * head dim * element
    size`` in the model's compute dtype (e.g. 512 KiB for Llama-2-7B in bfloat16)."""
    config: Any = getattr(model, "config", None)
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    layers = int(getattr(config, "num_hidden_layers", 1) or 1)
    heads = int(getattr(config, "num_attention_heads", 1) or 1)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or int(getattr(config, "hidden_size", heads)) // heads)
    dtype = getattr(model, "dtype", torch.float32)
    element = torch.empty(0, dtype=dtype).element_size() if isinstance(dtype, torch.dtype) else 4
    return 2 * layers * kv_heads * head_dim * element


def _proc_status(field: str) -> int | None:
    """A ``kB`` field of ``/proc/self/status`` (``VmRSS``, ``VmHWM``, ``RssAnon``) in bytes; None off Linux."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _reset_host_peak() -> bool:
    """Reset this process's peak resident set (``VmHWM``) to its current size; False where Linux refuses."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
        return True
    except OSError:
        return False


class LoadMeter:
    """Peak memory of one stage (the load stage) of this process, from construction to :meth:`stop`.

    CUDA: the caching allocator's peak (``max_memory_allocated``, reset at start), so every byte any tensor of
    the stage held on the GPU counts. Host: the peak resident set ``VmHWM`` after resetting it (``clear_refs``);
    it counts anonymous memory *and* touched pages of memory-mapped checkpoint files, so it is an upper bound
    on what the loader itself allocated; ``host_anon_after_bytes`` (``RssAnon``) is the anonymous part at the end.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            self.device_before = int(torch.cuda.memory_allocated(device))
        self.host_reset = _reset_host_peak()
        self.host_before = _proc_status("VmRSS")
        self.anon_before = _proc_status("RssAnon")

    def stop(self) -> dict:
        """``{device_peak_bytes, device_before_bytes, device_after_bytes}`` on CUDA (else None) and
        ``{host_peak_rss_bytes (None when the peak could not be reset), host_rss_before_bytes,
        host_anon_before_bytes, host_anon_after_bytes}``."""
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.device)
        return {
            "device": str(self.device),
            "device_peak_bytes": int(torch.cuda.max_memory_allocated(self.device)) if cuda else None,
            "device_before_bytes": self.device_before if cuda else None,
            "device_after_bytes": int(torch.cuda.memory_allocated(self.device)) if cuda else None,
            "host_peak_rss_bytes": _proc_status("VmHWM") if self.host_reset else None,
            "host_rss_before_bytes": self.host_before,
            "host_anon_before_bytes": self.anon_before,
            "host_anon_after_bytes": _proc_status("RssAnon"),
        }


@overload
def first_float_dtype(model: torch.nn.Module) -> torch.dtype: ...
@overload
def first_float_dtype(model: None) -> None: ...
def first_float_dtype(model: torch.nn.Module | None) -> torch.dtype | None:
    """The dtype of the model's first floating-point parameter (float32 when it has none; ``None`` for no model):
    what the logits chunk budgets assume (:func:`compute_dtype_bytes` reads the input embeddings first instead)."""
    if model is None:
        return None
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
