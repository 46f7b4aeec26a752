"""Quantize while loading: the same quantized bits and layer choice as quantizing after loading, and a load path
that never holds more than one layer's unquantized weights at once (counted tensor by tensor)."""

from __future__ import annotations

import dataclasses
import os
import weakref
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from distperp_harness.commands.tiny import TEST_SPEC, build_tiny_model
from distperp_harness.model.loading import load_all, load_model, load_quantized
from distperp_harness.model.quantize import quantize_model, weight_bytes
from distperp_harness.options import Options
from tests.helpers import assert_same_weights as _assert_same_weights

SHARED_MODEL = Path(__file__).resolve().parents[3] / "shared" / "models" / "wt2-llama-5m"
CPU = torch.device("cpu")


@pytest.fixture(scope="module", autouse=True)
def accelerate_state():
    from accelerate import PartialState

    PartialState(cpu=True)  # the loaders log through accelerate's logger


@pytest.fixture(scope="module")
def deep_model_dir(tmp_path_factory):
    """The test model with 4 decoder layers (float32 checkpoint), so that "one layer" and "the whole model" differ
    by 4x."""
    return build_tiny_model(
        dataclasses.replace(TEST_SPEC, num_layers=4, name="test-llama-4l"), tmp_path_factory.mktemp("deep")
    )


@pytest.fixture(scope="module")
def tied_model_dir(tmp_path_factory):
    return build_tiny_model(
        dataclasses.replace(TEST_SPEC, tie_word_embeddings=True, name="test-llama-tied"),
        tmp_path_factory.mktemp("tied"),
    )


def _after_loading(options: Options, dtype: torch.dtype):
    model = load_model(options, CPU, dtype)
    return model, quantize_model(
        model, options.quantize, group_size=options.group_size, include_lm_head=options.quantize_lm_head
    )


@pytest.mark.parametrize(
    "scheme, group_size, dtype, lm_head",
    [
        ("int4", 32, torch.bfloat16, False),
        ("int4", 64, torch.float32, False),
        ("int8", 128, torch.bfloat16, False),
        ("8da4w", 32, torch.float32, False),
        ("int4", 32, torch.bfloat16, True),
    ],
)
def test_quantized_while_loading_equals_quantized_after_loading(tiny_model_dir, scheme, group_size, dtype, lm_head):
    options = Options.from_kwargs(
        pretrained=str(tiny_model_dir), quantize=scheme, group_size=group_size, quantize_lm_head=lm_head
    )
    early, report = load_quantized(options, CPU, dtype)
    late, expected = _after_loading(options, dtype)
    _assert_same_weights(early, late)
    assert report.quantized == expected.quantized and report.skipped == expected.skipped
    assert ("lm_head" in report.quantized) == lm_head
    assert report.weight_bytes_before == expected.weight_bytes_before
    assert report.weight_bytes_after == expected.weight_bytes_after == weight_bytes(early)
    assert report.config == expected.config and report.weight_format == expected.weight_format
    ids = torch.randint(0, TEST_SPEC.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(early(ids).logits, late(ids).logits)


def test_tied_output_embedding_is_quantized_after_loading_and_says_so(tied_model_dir):
    options = Options.from_kwargs(pretrained=str(tied_model_dir), quantize="int4", group_size=32, quantize_lm_head=True)
    model, report = load_quantized(options, CPU, torch.bfloat16)
    late, expected = _after_loading(options, torch.bfloat16)
    _assert_same_weights(model, late)
    assert "lm_head" in report.quantized and any("untied" in n for n in report.notes)
    assert any("Quantized after loading" in n for n in report.notes)


@pytest.mark.skipif(not SHARED_MODEL.is_dir(), reason="the shared wt2-llama-5m model is not on this machine")
def test_shared_model_quantized_while_loading_equals_after_loading():
    options = Options.from_kwargs(pretrained=str(SHARED_MODEL), quantize="int4", group_size=128)
    early, report = load_quantized(options, CPU, torch.bfloat16)
    late, expected = _after_loading(options, torch.bfloat16)
    _assert_same_weights(early, late)
    assert report.quantized == expected.quantized and report.skipped == expected.skipped


class UnquantizedBytes(TorchDispatchMode):
    """Peak bytes of live plain 2-D ``dtype`` tensors on the CPU other than ``exclude`` shapes (the embeddings,
    which stay unquantized): every tensor an aten op creates is counted by its storage until the storage dies."""

    def __init__(self, dtype: torch.dtype, exclude: set[tuple[int, ...]]) -> None:
        super().__init__()
        self.dtype, self.exclude = dtype, exclude
        self.live: dict[int, int] = {}
        self.now = self.peak = 0

    def _drop(self, key: int) -> None:
        self.now -= self.live.pop(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if (
                type(t) in (torch.Tensor, torch.nn.Parameter)
                and t.dtype == self.dtype
                and t.dim() == 2
                and tuple(t.shape) not in self.exclude
                and t.device.type == "cpu"
            ):
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if key and key not in self.live:
                    self.live[key] = storage.nbytes()
                    self.now += storage.nbytes()
                    self.peak = max(self.peak, self.now)
                    weakref.finalize(storage, self._drop, key)  # storages keep their Python object alive
        return out


def test_load_path_holds_at_most_one_layer_of_unquantized_weights(deep_model_dir, monkeypatch):
    """A float32 checkpoint loaded as bfloat16 with quantize=int4 (and the float32 reference): the bfloat16 copies
    of Linear weights alive at once never exceed one decoder layer's. Quantizing after loading holds all layers."""
    monkeypatch.setenv("HF_DEACTIVATE_ASYNC_LOAD", "1")  # load on this thread, where the dispatch mode sees it
    spec = dataclasses.replace(TEST_SPEC, num_layers=4)
    kv = spec.hidden_size // spec.num_heads * spec.num_kv_heads
    layer = 2 * (2 * spec.hidden_size**2 + 2 * spec.hidden_size * kv + 3 * spec.hidden_size * spec.intermediate_size)
    options = Options.from_kwargs(pretrained=str(deep_model_dir), quantize="int4", group_size=32, reference="base")
    with UnquantizedBytes(torch.bfloat16, {(spec.vocab_size, spec.hidden_size)}) as meter:
        loaded = load_all(options, CPU)
    assert len(loaded.quant_report.quantized) == 7 * spec.num_layers
    assert 0 < meter.peak <= layer, f"{meter.peak} bytes of unquantized weights at once; one layer is {layer}"
    assert loaded.reference_weight_bytes == weight_bytes(loaded.reference) > 0
    memory = loaded.load_memory
    assert memory["device"] == "cpu" and memory["device_peak_bytes"] is None
    if os.path.exists("/proc/self/status"):
        assert memory["host_anon_after_bytes"] > 0


def test_models_load_without_hub_kernels(tiny_model_dir, monkeypatch):
    """transformers swaps layers for Hub kernels when the ``kernels`` package is installed and a model loads onto a
    GPU (fetched from the Hub: offline the load fails; online the numerics change); distperp never asks for them."""
    import transformers

    seen = {}
    real = transformers.AutoModelForCausalLM.from_pretrained

    def spy(*args, **kwargs):
        seen.update(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", spy)
    model = load_model(Options(pretrained=str(tiny_model_dir)), CPU, torch.float32)
    assert seen["use_kernels"] is False and not getattr(model, "use_kernels", False)


def test_a_run_reads_its_tokenizer_once(tiny_model_dir, tmp_path, monkeypatch):
    """The fit check and the load stage share one tokenizer (the 33 MB tokenizer of a 262k vocabulary was read twice);
    a folder whose tokenizer files change is read again."""
    import shutil

    import transformers

    from tests.helpers import make_lm

    folder = Path(shutil.copytree(tiny_model_dir, tmp_path / "model"))
    calls = []
    real = transformers.AutoTokenizer.from_pretrained
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: calls.append(a) or real(*a, **k))
    lm = make_lm(folder, extra={"batch_size": 1, "device": "cpu"})
    assert len(calls) == 1 and lm.estimate is not None  # the fit check ran, on the same tokenizer
    config = (folder / "tokenizer_config.json").read_text(encoding="utf-8")
    (folder / "tokenizer_config.json").write_text(config + "\n", encoding="utf-8")
    make_lm(folder, extra={"batch_size": 1, "device": "cpu"})
    assert len(calls) == 2
