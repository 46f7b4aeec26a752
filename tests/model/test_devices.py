"""Device choice, device identity and the start-up agreement checks, with fakes for CUDA (no GPU here)."""

import textwrap
from types import SimpleNamespace

import pytest
import torch
from helpers import accelerate_launch_prefix, run_command

from distperp_harness.model.devices import (
    device_identity,
    find_disagreement,
    find_shared_gpus,
    numerics_flags,
    physical_device,
    resolve_device,
)
from distperp_harness.options import Options

H100 = SimpleNamespace(
    name="NVIDIA H100 80GB HBM3", major=9, minor=0, multi_processor_count=132, total_memory=80 << 30, uuid="GPU-1111"
)
A100 = SimpleNamespace(
    name="NVIDIA A100-SXM4-80GB", major=8, minor=0, multi_processor_count=108, total_memory=80 << 30, uuid="GPU-2222"
)


@pytest.fixture
def fake_cuda(monkeypatch):
    """A machine with ``state['count']`` visible H100s; records ``torch.cuda.set_device`` calls."""
    state = {"count": 8, "current": []}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: state["count"])
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: state["current"].append(str(d)))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d=None: H100)
    return state


def _options(device=None, from_cli=False):
    return Options.from_kwargs(pretrained="m", device=device, device_from_cli=from_cli)


@pytest.mark.parametrize("device", [None, "auto", "cuda", "cuda:0"])
def test_one_gpu_per_process_takes_local_rank_modulo_the_visible_gpus(fake_cuda, device):
    # SLURM's per-task GPUs, or the Python API: every process sees one GPU, whatever its local rank
    fake_cuda["count"] = 1
    assert resolve_device(_options(device), local_rank=5, world_size=8) == torch.device("cuda:0")
    assert fake_cuda["current"] == ["cuda:0"]


def test_all_gpus_visible_gives_each_local_rank_its_own(fake_cuda):
    assert [str(resolve_device(_options(), r, 8)) for r in range(8)] == [f"cuda:{r}" for r in range(8)]
    assert fake_cuda["current"] == [f"cuda:{r}" for r in range(8)]


def test_a_single_process_on_cuda_n_makes_it_current(fake_cuda):
    assert resolve_device(_options("cuda:3"), 0, 1) == torch.device("cuda:3")
    assert fake_cuda["current"] == ["cuda:3"]
    with pytest.raises(ValueError, match=r"device='cuda:9': this process sees 8 CUDA device\(s\)"):
        resolve_device(_options("cuda:9"), 0, 1)


def test_no_cuda_falls_back_only_for_the_cli_default(monkeypatch):
    from accelerate import PartialState

    PartialState(cpu=True)  # the fallback is logged on the main process
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device(_options("cuda:0", from_cli=True), 0, 1) == torch.device("cpu")
    assert resolve_device(_options(None), 3, 4) == torch.device("cpu")
    with pytest.raises(ValueError, match="no CUDA device"):
        resolve_device(_options("cuda:1"), 0, 1)


def test_identity_of_a_gpu_names_what_chooses_its_kernels(fake_cuda):
    ident = device_identity(torch.device("cuda:0"))
    assert ident["name"] == "NVIDIA H100 80GB HBM3" and ident["capability"] == "9.0" and ident["sm_count"] == 132
    assert "total_memory" not in ident  # an A100-40GB and an A100-80GB run the same kernels
    assert set(ident["numerics"]) >= {
        "float32_matmul_precision",
        "cuda_matmul_allow_tf32",
        "cuda_bf16_reduced_precision_reduction",
        "cudnn_allow_tf32",
    }


def test_identity_carries_the_precision_flags():
    before = device_identity(torch.device("cpu"))
    previous = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("medium" if previous != "medium" else "high")
        after = device_identity(torch.device("cpu"))
    finally:
        torch.set_float32_matmul_precision(previous)
    assert before != after and before["numerics"] == numerics_flags()
    assert "float32_matmul_precision" in find_disagreement([before, after])


def test_a_different_gpu_on_rank_1_is_refused_naming_rank_and_field(fake_cuda, monkeypatch):
    mine = {"options": {"dtype": "bfloat16"}, "device": device_identity(torch.device("cuda:0"))}
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d=None: A100)
    theirs = {"options": {"dtype": "bfloat16"}, "device": device_identity(torch.device("cuda:0"))}
    assert find_disagreement([mine, mine]) is None
    message = find_disagreement([mine, mine, theirs])
    assert message.startswith("rank 2 does not run what rank 0 runs: device.capability: '9.0' on rank 0 vs '8.0'")
    assert "device.name: 'NVIDIA H100 80GB HBM3' on rank 0 vs 'NVIDIA A100-SXM4-80GB'" in message
    assert "device.sm_count" in message and "Fix:" in message


def test_two_ranks_on_one_gpu_are_refused(fake_cuda):
    where = physical_device(torch.device("cuda:0"))
    assert where["gpu"] == "GPU-1111"
    other_host = {**where, "host": "node-b"}
    assert find_shared_gpus([where, other_host]) is None
    message = find_shared_gpus([where, {**where, "gpu": "GPU-9999"}, where])
    assert "ranks [0, 2]" in message and "same GPU" in message and "one process per GPU" in message
    cpu = physical_device(torch.device("cpu"))
    assert find_shared_gpus([cpu, cpu]) is None  # CPU processes share the machine by design


@pytest.mark.distributed
def test_a_mismatched_rank_stops_a_real_launch_before_loading(tiny_model_dir, tmp_path):
    script = tmp_path / "mismatch.py"
    script.write_text(
        textwrap.dedent(f"""
        import os
        from distperp_harness import lm, stages
        if os.environ["RANK"] == "1":  # rank 1 pretends to be another GPU model
            real = stages.device_identity
            stages.device_identity = lambda device: {{**real(device), "name": "NVIDIA H100 80GB HBM3"}}
        stages.load_all = lambda *a, **k: os._exit(42)  # loading must not even start
        lm.DistPerpLM(pretrained={str(tiny_model_dir)!r}, device="cpu", timeout=30)
    """)
    )
    proc = run_command([*accelerate_launch_prefix(2), str(script)], cwd=tmp_path, check=False, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0  # and not from load_all: the message below comes first
    assert "rank 1 does not run what rank 0 runs: device.name: '<missing>' on rank 0 vs 'NVIDIA H100" in out, out[
        -3000:
    ]
