"""Know before loading: the per-rank estimate against loaded models' real bytes, and the start-up error that names
the numbers and the options that would fit."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from distperp_harness.model.loading import load_model, load_quantized, skeleton
from distperp_harness.model.quantize import weight_bytes
from distperp_harness.options import Options
from distperp_harness.run import fit
from distperp_harness.run.fit import GiB, Need, check_fits, estimate, weights_per_rank

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def collective():
    from distperp_harness.distributed.collective import AccelerateCollective

    return AccelerateCollective(60, cpu=True)


@pytest.mark.parametrize(
    "scheme, dtype",
    [
        ("none", torch.float32),
        ("int4", torch.bfloat16),
        ("int4", torch.float32),
        ("int8", torch.bfloat16),
        ("8da4w", torch.float32),
    ],
)
def test_whole_copy_estimate_equals_the_loaded_bytes(tiny_model_dir, collective, scheme, dtype):
    options = Options.from_kwargs(pretrained=str(tiny_model_dir), quantize=scheme, group_size=32)
    meta = skeleton(options, dtype)
    model = load_model(options, CPU, dtype) if scheme == "none" else load_quantized(options, CPU, dtype)[0]
    kept, gathered = weights_per_rank(meta, 1, scheme=scheme, group_size=32)
    assert kept == weight_bytes(model) and gathered == 0


def test_sharded_estimate_halves_what_fsdp_shards(tiny_model_dir, collective):
    options = Options.from_kwargs(pretrained=str(tiny_model_dir))
    meta = skeleton(options, "auto")  # the checkpoint's float32
    spec = meta.config
    whole = sum(p.numel() * 4 for p in meta.parameters())
    kept, gathered = weights_per_rank(meta, 2)
    assert kept == whole // 2
    layer = sum(p.numel() * 4 for p in meta.model.layers[0].parameters())
    root = 2 * spec.vocab_size * spec.hidden_size * 4 + spec.hidden_size * 4  # embeddings, head, final norm
    assert gathered == root + 2 * layer  # a layer counts twice while gathered: FSDP2's flat buffer, then copies
    # quantized: the torchao weights stay whole on every rank, the rest is halved
    q_kept, _ = weights_per_rank(skeleton(options, torch.bfloat16), 2, scheme="int4", group_size=32)
    q_whole, _ = weights_per_rank(skeleton(options, torch.bfloat16), 1, scheme="int4", group_size=32)
    embeddings = 2 * spec.vocab_size * spec.hidden_size * 2
    norms = spec.hidden_size * 2 * (2 * spec.num_hidden_layers + 1)
    assert q_whole - q_kept == pytest.approx(embeddings / 2 + norms / 2)


def test_estimate_counts_batch_rows_and_the_reference(tiny_model_dir):
    options = Options.from_kwargs(
        pretrained=str(tiny_model_dir), quantize="int4", group_size=32, reference="base", batch_size=4
    )
    model, reference = skeleton(options, torch.bfloat16), skeleton(options, "auto")
    need = estimate(options, model, reference, 1, 128, CPU)
    one_row = estimate(options, model, reference, 1, 128, CPU, batch_rows=1)
    assert need.reference == sum(p.numel() * 4 for p in reference.parameters())
    per_token = max(fit.activation_bytes_per_token(m, 128) for m in (model, reference))  # float32 reference: its
    assert need.activations - one_row.activations == 3 * 128 * per_token


def test_a_run_that_cannot_fit_fails_before_loading_with_numbers_and_fixes(tiny_model_dir, collective, monkeypatch):
    options = Options.from_kwargs(pretrained=str(tiny_model_dir), batch_size=8, max_length=128)
    need = check_fits(collective, options, CPU, 1, 1)  # plenty of memory: fits, and says how much it needs
    assert need.total > 0
    one_row = dataclasses.replace(options, batch_size=1)
    room = check_fits(collective, one_row, CPU, 1, 1).total + 1000  # one row fits, eight do not
    monkeypatch.setattr(fit, "free_memory_bytes", lambda device: room)
    with pytest.raises(ValueError) as info:
        check_fits(collective, options, CPU, 1, 1)
    text = str(info.value)
    assert "the run does not fit" in text and "rank 0 has" in text and "GiB" in text
    assert "model weights" in text and "activations of one batch" in text
    assert "Fix: batch_size=1 (" in text  # the largest batch that fits
    int4 = dataclasses.replace(one_row, quantize="int4")
    monkeypatch.setattr(fit, "free_memory_bytes", lambda device: 10**12)
    room = check_fits(collective, int4, CPU, 1, 1).total + 10  # int4 weights fit, float32 ones do not
    monkeypatch.setattr(fit, "free_memory_bytes", lambda device: room)
    with pytest.raises(ValueError, match=r"Fix: quantize=int4 \(0\.\d\d GiB\)\."):
        check_fits(collective, one_row, CPU, 1, 1)
    monkeypatch.setattr(fit, "free_memory_bytes", lambda device: room // 2)  # a node of 2 processes shares it
    with pytest.raises(ValueError, match="shared by 2 processes"):
        check_fits(collective, int4, CPU, 1, 2)


def test_need_describes_its_parts():
    need = Need(model=GiB, reference=2 * GiB, gathered=0, activations=GiB // 2)
    assert need.total == 3.5 * GiB
    assert need.describe().endswith("= 3.50 GiB")


def test_a_model_without_a_meta_skeleton_loads_without_a_verdict(tiny_model_dir, collective, monkeypatch):
    with pytest.raises(ValueError, match="no such model folder"):  # a bad path is an error at start, on every rank
        check_fits(collective, Options.from_kwargs(pretrained="/no/such/model"), CPU, 1, 1)

    def fail(options, device):
        raise RuntimeError("remote code that needs real weights")

    monkeypatch.setattr(fit, "_skeletons", fail)
    assert check_fits(collective, Options.from_kwargs(pretrained=str(tiny_model_dir)), CPU, 1, 1) is None


def test_tinygemm_padding_is_counted_on_cuda():
    weight = torch.empty((100, 1500), dtype=torch.bfloat16, device="meta")
    padded_n, padded_k = 104, 2048  # N to a multiple of 8, K to a multiple of 1024
    expected = padded_n * padded_k * 0.5 + padded_n * padded_k / 128 * 2 * 2  # int4 + bf16 scale and zero per group
    assert fit._quantized_bytes("int4-packed", weight, 128, torch.device("cuda")) == expected
    assert fit._quantized_bytes("int4-packed", weight, 128, CPU) == 100 * 1500 * 0.5 + 100 * 1500 / 128 * 2 * 2
