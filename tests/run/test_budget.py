"""batch_size=auto: token budgets from the model and total memory, checked on every rank; generation rows."""

import logging

import pytest
import torch
from transformers import AutoModelForCausalLM

from distperp_harness.model import memory
from distperp_harness.model.memory import activation_bytes_per_token, is_out_of_memory, kv_cache_bytes_per_token
from distperp_harness.options import Options
from distperp_harness.planning.plan import make_batches
from distperp_harness.run import budget as auto_batching
from distperp_harness.run.budget import (
    batching_for,
    check_budget,
    clamp_budget,
    memory_budget,
    scoring_probe,
)
from distperp_harness.run.scoring.engine.forward import chunk_elements

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
GIB = 1 << 30


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def _options(**kwargs):
    return Options.from_kwargs(pretrained="m", **kwargs)


def test_fixed_batch_size_is_rows(model):
    batching = batching_for(_options(batch_size=8), model, CPU, 128)
    assert (batching.batch_size, batching.token_budget) == (8, None)


@pytest.mark.parametrize(
    "tokens, expected", [(1, 128), (128, 128), (129, 128), (255, 128), (256, 256), (5000, 4096), (10**9, 8192)]
)
def test_clamp_rounds_down_to_a_power_of_two_within_bounds(tokens, expected):
    assert clamp_budget(tokens, max_length=128, max_batch_size=64) == expected


def test_clamp_with_a_max_batch_size_that_is_not_a_power_of_two():
    # 48 rows x 100 = 4800 tokens allowed: the largest power of two below it, never above the limit
    assert clamp_budget(10**9, max_length=100, max_batch_size=48) == 4096
    # ... and never below one full row, even when that row is not a power of two
    assert clamp_budget(1, max_length=100, max_batch_size=48) == 100


def _total(nbytes):
    return lambda device: nbytes


def test_memory_budget_math(model):
    per_token = activation_bytes_per_token(model, 128)
    total, weights = 64 * GIB, 3 * GIB
    usable = int(0.5 * (total - weights)) - 8 * chunk_elements("cuda")
    expected = clamp_budget(usable // per_token, 128, 10**6)
    assert memory_budget(model, 128, 10**6, total, device_type="cuda", resident_bytes=weights) == expected
    assert expected & (expected - 1) == 0 and expected <= usable // per_token < 2 * expected


def test_auto_on_cpu_uses_a_quarter_of_total_memory_up_to_the_cpu_cap(model):
    per_token = activation_bytes_per_token(model, 128)
    total = GIB // 4
    batching = batching_for(
        _options(batch_size="auto", max_batch_size=10**6), model, CPU, 128, total_memory=_total(total)
    )
    assert batching.batch_size is None
    budget = batching.token_budget
    assert budget * per_token <= 0.25 * total  # fits the memory budget
    assert 2 * budget * per_token > 0.25 * total - 8 * chunk_elements("cpu")  # the largest that does
    roomy = batching_for(
        _options(batch_size="auto", max_batch_size=10**6), model, CPU, 128, total_memory=_total(1 << 50)
    )
    assert roomy.token_budget == auto_batching._CPU_MAX_TOKENS  # a bigger batch would not be faster on CPU


def test_auto_respects_max_batch_size(model):
    batching = batching_for(
        _options(batch_size="auto", max_batch_size=16), model, CUDA, 128, total_memory=_total(1 << 50)
    )
    assert batching.token_budget == 16 * 128 and batching.max_batch_size == 16
    rows = [
        b.rows
        for b in make_batches(
            [128] * 40 + [8] * 100, token_budget=batching.token_budget, max_batch_size=batching.max_batch_size
        )
    ]
    assert max(rows) == 16


def test_auto_never_below_max_length(model):
    batching = batching_for(_options(batch_size="auto"), model, CPU, 128, total_memory=_total(0))
    assert batching.token_budget == 128  # one full-length row always


@pytest.mark.parametrize("device", [CPU, CUDA])
def test_budget_depends_on_total_memory_never_on_free_memory(model, device, monkeypatch):
    """The flaw of a free-memory rule: what other processes, NCCL buffers or the caching allocator hold at the
    moment changed the power of two, hence the batches and the bits. Free memory must not enter the choice."""
    chosen = []
    for free in (GIB, 40 * GIB):
        monkeypatch.setattr(auto_batching, "free_memory_bytes", lambda d, free=free: free, raising=False)
        monkeypatch.setattr(memory, "free_memory_bytes", lambda d, free=free: free)
        chosen.append(
            batching_for(
                _options(batch_size="auto"), model, device, 128, total_memory=_total(80 * GIB), resident_bytes=GIB
            )
        )
    assert chosen[0] == chosen[1]
    a = batching_for(_options(batch_size="auto"), model, device, 128, total_memory=_total(3 * GIB))
    b = batching_for(_options(batch_size="auto"), model, device, 128, total_memory=_total(3 * GIB + 12345))
    assert a == b  # power-of-two rounding absorbs small differences between machines of one kind


def test_weights_and_reference_leave_less_room(model):
    plain = memory_budget(model, 128, 10**6, 8 * GIB, device_type="cuda")
    heavy = memory_budget(model, 128, 10**6, 8 * GIB, device_type="cuda", resident_bytes=6 * GIB)
    assert heavy < plain


def test_auto_n_is_accepted_and_logged_as_auto(model, caplog):
    with caplog.at_level(logging.INFO, logger="distperp_harness.run.budget"):
        n = batching_for(_options(batch_size="auto:4"), model, CPU, 128, total_memory=_total(GIB))
    assert n == batching_for(_options(batch_size="auto"), model, CPU, 128, total_memory=_total(GIB))
    assert "auto:4" in caplog.text and "treated as batch_size=auto" in caplog.text


def _probe(peak=0, error=None):
    def probe(budget):
        if error is not None:
            raise error
        return peak

    return probe


@pytest.mark.parametrize(
    "error",
    [
        torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
        RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate"),
        RuntimeError("cuDNN error: CUDNN_STATUS_ALLOC_FAILED"),
    ],
)
def test_check_budget_names_every_kind_of_out_of_memory(error, monkeypatch):
    monkeypatch.setattr(auto_batching, "_release_cuda_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
    why = check_budget(4096, 128, CUDA, free_bytes=GIB, probe=_probe(error=error))
    assert why is not None and "ran out of memory" in why and is_out_of_memory(error)


def test_check_budget_passes_other_errors_through_and_compares_the_peak(monkeypatch):
    monkeypatch.setattr(auto_batching, "_release_cuda_cache", lambda: None)
    resets = []
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: resets.append(device))
    with pytest.raises(RuntimeError, match="shape mismatch"):
        check_budget(4096, 128, CUDA, free_bytes=GIB, probe=_probe(error=RuntimeError("shape mismatch")))
    assert check_budget(4096, 128, CUDA, free_bytes=GIB, probe=_probe(peak=GIB // 2)) is None
    assert "peaked at 2.00 GiB, 1.00 GiB is free" in check_budget(
        4096, 128, CUDA, free_bytes=GIB, probe=_probe(peak=2 * GIB)
    )
    assert len(resets) == 3  # the run's reported peak never includes the probe
    assert check_budget(4096, 128, CPU, free_bytes=GIB, bytes_per_token=1000) is None
    assert "needs about" in check_budget(4096, 128, CPU, free_bytes=GIB, bytes_per_token=10**6)


class _Ranks:
    """A collective of ``len(replies)`` ranks seen from rank 0: other ranks answer from ``replies[r][name]``."""

    def __init__(self, *others):
        self.rank, self.world_size, self.others = 0, 1 + len(others), others

    def all_gather_object(self, obj, name):
        return [obj] + [reply.get(name, obj) for reply in self.others]


def test_a_rank_that_cannot_hold_rank_0s_budget_stops_the_run_naming_itself(model, monkeypatch):
    monkeypatch.setattr(auto_batching, "total_memory_bytes", lambda device: 8 * GIB)
    monkeypatch.setattr(auto_batching, "room_bytes", lambda device: 8 * GIB)
    ranks = _Ranks({}, {"check the batch budget": ("a batch needs about 1.00 GiB, 0.10 GiB is available", "cpu")})
    with pytest.raises(
        ValueError,
        match=r"rank 2 \(cpu\): a batch needs about 1.00 GiB.*Fix: free it, or pass "
        r"batch_size=N",
    ):
        auto_batching.agree_on_batching(ranks, _options(batch_size="auto"), model, CPU, 128)
    fine = auto_batching.agree_on_batching(_Ranks({}), _options(batch_size="auto"), model, CPU, 128)
    assert fine.token_budget is not None


def test_every_rank_uses_rank_0s_choice(model, monkeypatch):
    from distperp_harness.run.rules import Batching

    monkeypatch.setattr(auto_batching, "room_bytes", lambda device: 1 << 50)
    theirs = Batching(batch_size=None, token_budget=256, max_batch_size=64)
    ranks = _Ranks()
    ranks.rank = 1  # this process is rank 1; rank 0 chose a smaller budget, and could hold it
    ranks.all_gather_object = lambda obj, name: [theirs, obj] if name == "agree on batching" else [(None, "cpu"), obj]
    assert auto_batching.agree_on_batching(ranks, _options(batch_size="auto"), model, CPU, 128) == theirs


def test_kv_cache_bytes_per_token_of_llama_2_7b():
    from types import SimpleNamespace

    from transformers import LlamaConfig

    llama2 = SimpleNamespace(
        config=LlamaConfig(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32),
        dtype=torch.bfloat16,
    )
    assert kv_cache_bytes_per_token(llama2) == 512 * 1024
    gqa = SimpleNamespace(
        config=LlamaConfig(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8),
        dtype=torch.bfloat16,
    )
    assert kv_cache_bytes_per_token(gqa) == 128 * 1024


def test_generation_rows_leave_room_for_the_kv_cache():
    from distperp_harness.run.rules import Batching

    auto = Batching(batch_size=None, token_budget=65536, max_batch_size=64)
    act, kv = 1_500_000, 512 * 1024
    rows = auto_batching.generation_rows(auto, 1024 + 256, activation_bytes=act, kv_bytes=kv)
    assert rows < auto.rows_for(1024 + 256)  # the scoring budget alone would overfill memory with cache
    assert rows * 1280 * (act + kv) <= 65536 * act < (rows + 1) * 1280 * (act + kv)
    assert auto_batching.generation_rows(auto, 60000, activation_bytes=act, kv_bytes=kv) == 1  # one row always
    fixed = Batching(batch_size=8)
    assert auto_batching.generation_rows(fixed, 1280, activation_bytes=act, kv_bytes=kv) == 8  # N rows, as asked


def test_scoring_probe_runs_a_real_batch_on_cpu(model):
    probe = scoring_probe(model, CPU, 32, pad_token_id=3)
    assert probe(64) == 0  # two rows of 32 scored; no allocator statistics on CPU
