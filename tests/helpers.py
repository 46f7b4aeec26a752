"""Reusable test helpers (import as ``from helpers import ...``; ``tests/`` is put on ``sys.path`` by conftest).

Subprocess helpers run offline: :func:`offline_env` sets ``HF_HUB_OFFLINE``, ``HF_DATASETS_OFFLINE``,
``TORCHAO_FORCE_SKIP_LOADING_SO_FILES`` and ``TOKENIZERS_PARALLELISM``. On failure they fail the test with the
command, the exit code and the tail of stderr and stdout.
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import io
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import pytest

from distperp_harness.commands.families import PUBLISHED, attention_of, published_config  # noqa: F401 - re-exported
from distperp_harness.commands.launching import (  # noqa: F401 - re-exported for the tests
    OFFLINE_ENV,
    accelerate_launch_prefix,
    free_port,
    offline_env,
)

if TYPE_CHECKING:
    import torch

TESTS_DIR = Path(__file__).resolve().parent
REPO_ROOT = TESTS_DIR.parent
TASKS_DIR = TESTS_DIR / "tasks"
"""Local lm-eval tasks ``dptest_mc``, ``dptest_mmlu``, ``dptest_fewshot``, ``dptest_random``, ``dptest_rolling``,
``dptest_gen``, ``dptest_chain``, ``dptest_sample`` (pass as ``--include_path``)."""


def _tail(text: str | bytes | None, lines: int) -> str:
    if text is None:
        return ""
    if isinstance(text, bytes):
        text = text.decode("utf-8", errors="replace")
    return "\n".join(text.rstrip().splitlines()[-lines:])


def _outputs(stderr: str | bytes | None, stdout: str | bytes | None, lines: int) -> str:
    return f"--- stderr (tail) ---\n{_tail(stderr, lines)}\n--- stdout (tail) ---\n{_tail(stdout, lines)}"


def run_command(
    cmd: Sequence[str],
    *,
    cwd: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    timeout: float = 600,
    check: bool = True,
    tail_lines: int = 40,
) -> subprocess.CompletedProcess[str]:
    """Run ``cmd`` with :func:`offline_env` (plus ``env``) and captured text output.

    Returns the ``CompletedProcess``. With ``check=True`` a non-zero exit fails the test; a timeout always does.
    The failure message holds the command, cwd, exit code, and the last ``tail_lines`` lines of stderr and stdout.
    """
    cmd = [str(c) for c in cmd]
    try:
        proc = subprocess.run(
            cmd, cwd=cwd, env=offline_env(env), capture_output=True, text=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(
            f"timed out after {timeout:g} s: {' '.join(cmd)}\n(cwd={cwd})\n"
            + _outputs(exc.stderr, exc.stdout, tail_lines),
            pytrace=False,
        )
    if check and proc.returncode != 0:
        pytest.fail(
            f"exit code {proc.returncode}: {' '.join(cmd)}\n(cwd={cwd})\n"
            + _outputs(proc.stderr, proc.stdout, tail_lines),
            pytrace=False,
        )
    return proc


def start_two_nodes(
    args: Sequence[str],
    *,
    cwd: str | os.PathLike[str],
    per_node: int = 1,
    envs: Sequence[Mapping[str, str]] = ({}, {}),
    outputs: Sequence[Any] | None = None,
) -> list[subprocess.Popen]:
    """Start ``python -m accelerate.commands.launch ... <args>`` as two "nodes" on loopback (two launchers,
    ``--machine_rank 0`` and ``1``, ``per_node`` processes each, each in its own session so that a test can kill a
    whole "node" with ``os.killpg``). ``envs[m]``: extra environment of node ``m``; ``outputs[m]``: an open file for
    its combined output (default: a text pipe)."""
    port = free_port()
    return [
        subprocess.Popen(
            [
                *accelerate_launch_prefix(2 * per_node, port, num_machines=2, machine_rank=rank),
                *map(str, args),
            ],
            cwd=cwd,
            env=offline_env(envs[rank]),
            stdout=outputs[rank] if outputs else subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        for rank in (0, 1)
    ]


def run_two_nodes(args: Sequence[str], *, cwd: str | os.PathLike[str], per_node: int = 1, timeout: float = 600) -> None:
    """Run :func:`start_two_nodes`; fail the test if either node exits non-zero."""
    for p in start_two_nodes(args, cwd=cwd, per_node=per_node):
        output, _ = p.communicate(timeout=timeout)
        assert p.returncode == 0, output[-3000:]


def side_by_side(*calls: Callable[[], Any]) -> list[Any]:
    """Run each zero-argument call in a thread of its own and return their results in order (the first failure
    fails the test). For one-process runs: their time goes mostly to start-up on one core, so two or three side by
    side take about the time of one on this 2-core machine (multi-process launches gain nothing: keep those in
    turn)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(calls)) as pool:
        futures = [pool.submit(call) for call in calls]
        return [f.result() for f in futures]


class DictStore:
    """The rendezvous store's ``set``/``get``/``check``/``add``/``compare_set`` over a dict; ``calls`` counts them."""

    def __init__(self):
        self.data, self.calls = {}, 0

    def set(self, key, value):
        self.calls += 1
        self.data[key] = value if isinstance(value, bytes) else str(value).encode()

    def get(self, key):
        self.calls += 1
        return self.data[key]

    def check(self, keys):
        self.calls += 1
        return all(k in self.data for k in keys)

    def add(self, key, n):
        self.calls += 1
        self.data[key] = str(int(self.data.get(key, b"0")) + n).encode()
        return int(self.data[key])

    def compare_set(self, key, expected, desired):
        self.calls += 1
        if key not in self.data and not expected:
            self.data[key] = desired
        return self.data.get(key, b"")


def distperp_args(
    model_dir: Any,
    tasks_dir: Any,
    out: Any,
    model_args: str = "",
    tasks: str = "dptest_rolling,dptest_mc",
    batch_size: int = 3,
) -> list[str]:
    """``-m lm_eval ...`` arguments of a distperp run on the test model (``model_args``: more keys, each with its
    leading comma)."""
    return [
        "-m",
        "lm_eval",
        "--model",
        "distperp",
        "--model_args",
        f"pretrained={model_dir},max_length=128{model_args}",
        "--tasks",
        tasks,
        "--include_path",
        str(tasks_dir),
        "--batch_size",
        str(batch_size),
        "--output_path",
        str(out),
    ]


def launch_one_node(args: Sequence[str], cwd: Any, env: Mapping[str, str]) -> "LaunchOutputs":
    """``args`` under a two-process ``accelerate launch``, its output read as it comes."""
    return LaunchOutputs(
        [
            subprocess.Popen(
                [*accelerate_launch_prefix(2), *args],
                cwd=cwd,
                env=offline_env(env),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        ]
    )


class LaunchOutputs:
    """Every launcher's combined output, read as it comes (progress bars end lines with \\r, not \\n), and the
    moment a text first appeared in it."""

    def __init__(self, procs):
        self.procs, self.texts, self.first_seen = procs, ["" for _ in procs], {}
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._pump, args=(i,), daemon=True) for i in range(len(procs))]
        for t in self._threads:
            t.start()

    def _pump(self, i):
        fd = self.procs[i].stdout.fileno()
        while chunk := os.read(fd, 65536):
            with self._lock:
                self.texts[i] += chunk.decode("utf-8", errors="replace")

    def wait_for(self, text, timeout):
        """The moment ``text`` appeared in some output (fails the test after ``timeout`` seconds)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if any(text in t for t in self.texts):
                    return self.first_seen.setdefault(text, time.monotonic())
            time.sleep(0.05)
        self.kill()
        pytest.fail(f"{text!r} never appeared:\n" + "\n".join(t[-3000:] for t in self.texts))

    def wait_all(self, timeout):
        """Wait until every launcher exited; return the moment the last one did."""
        deadline = time.monotonic() + timeout
        for p in self.procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.kill()
                pytest.fail("a launcher did not exit in time:\n" + "\n".join(t[-3000:] for t in self.texts))
        end = time.monotonic()
        for t in self._threads:
            t.join(10)
        return end

    def kill(self):
        for i, p in enumerate(self.procs):
            if p.poll() is None:
                self.kill_node(i)

    def kill_node(self, i: int, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to launcher ``i`` and every process under it at once, as a lost machine would end them
        (torch's launcher starts each worker in a session of its own: a process-group kill misses them)."""
        import psutil

        try:
            under = [p.pid for p in psutil.Process(self.procs[i].pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            under = []
        for pid in [*under, self.procs[i].pid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    def workers(self, i: int) -> dict[int, int]:
        """``{global rank: pid}`` of the workers launcher ``i`` started (its direct children: torch's elastic agent
        runs inside the launcher; a worker's own children, compile workers say, are not ranks)."""
        import psutil

        found = {}
        for child in psutil.Process(self.procs[i].pid).children(recursive=False):
            try:
                rank = child.environ().get("RANK")
            except psutil.Error:
                continue
            if rank is not None:
                found[int(rank)] = child.pid
        return found


def lm_eval_command(args: Sequence[str], *, num_processes: int | None = None) -> list[str]:
    """The command line for lm-eval's CLI with ``args``.

    ``num_processes=None``: plain ``python -m lm_eval``; an int: under :func:`accelerate_launch_prefix`.
    """
    if num_processes is None:
        return [sys.executable, "-m", "lm_eval", *map(str, args)]
    return [*accelerate_launch_prefix(num_processes), "-m", "lm_eval", *map(str, args)]


def run_lm_eval(
    args: Sequence[str],
    *,
    cwd: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    num_processes: int | None = None,
    timeout: float = 600,
    check: bool = True,
) -> subprocess.CompletedProcess[str]:
    """Run lm-eval's CLI offline (see :func:`lm_eval_command` and :func:`run_command`)."""
    cmd = lm_eval_command(args, num_processes=num_processes)
    return run_command(cmd, cwd=cwd, env=env, timeout=timeout, check=check)


def make_lm(model_dir: str | os.PathLike[str], args: str = "", extra: Mapping[str, Any] | None = None):
    """``--model distperp`` in-process, built as lm-eval's CLI builds it: ``pretrained=<model_dir><args>``."""
    from lm_eval.api.registry import get_model

    return get_model("distperp").create_from_arg_string(f"pretrained={model_dir}{args}", dict(extra or {}))


def score_rolling(lm: Any, texts: Sequence[str]) -> list[Any]:
    """``lm.loglikelihood_rolling`` of each text (one ``Instance`` per text), without a progress bar."""
    from lm_eval.api.instance import Instance

    return lm.loglikelihood_rolling(
        [Instance("loglikelihood_rolling", {}, (t,), i) for i, t in enumerate(texts)], disable_tqdm=True
    )


def _newest(paths: list[Path], what: str, root: Path) -> Path:
    if not paths:
        raise FileNotFoundError(f"no {what} under {root}")
    return max(paths, key=lambda p: (p.stat().st_mtime_ns, p.name))


def load_results(output_path: str | os.PathLike[str]) -> dict[str, Any]:
    """The newest ``results_*.json`` that lm-eval wrote anywhere under ``output_path`` (``--output_path``)."""
    root = Path(output_path)
    return json.loads(_newest(list(root.rglob("results_*.json")), "results_*.json", root).read_text())


def load_samples(output_path: str | os.PathLike[str], task: str) -> list[dict[str, Any]]:
    """Rows of the newest ``samples_<task>_*.jsonl`` under ``output_path`` (``--log_samples``), by ``doc_id``."""
    root = Path(output_path)
    name = re.compile(rf"samples_{re.escape(task)}_\d{{4}}-.*\.jsonl")
    found = [p for p in root.rglob("samples_*.jsonl") if name.fullmatch(p.name)]
    path = _newest(found, f"samples_{task}_*.jsonl", root)
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return sorted(rows, key=lambda r: r["doc_id"])


def sharpened_model(source: str | os.PathLike[str], out: str | os.PathLike[str], scale: float = 8.0) -> Path:
    """A copy of the model at ``source`` with every weight matrix multiplied by ``scale``, saved to ``out``.

    A random tiny model predicts nearly uniform distributions, so quantizing it changes no multiple-choice answer;
    scaled weights make the distributions peaked and int4's rounding visible (answers flip).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(source)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() == 2:
                parameter.mul_(scale)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(source).save_pretrained(out)
    return Path(out)


# --- fixed results JSONs for the figure tests (no model: the numbers are given) ---------------------------------


def rolling_entry(kl: float, n_tokens: int = 1000, ln_ppl_ratio: float = 0.01) -> dict[str, Any]:
    """A ``config.distperp.reference.tasks`` entry of a perplexity task (stderrs: 10 % / 30 % of the value)."""
    return {
        "n_docs": 10,
        "n_tokens": n_tokens,
        "kl_divergence": kl,
        "kl_divergence_stderr": kl / 10,
        "top1_agreement": 1 - 3 * kl,
        "top1_agreement_stderr": 0.002,
        "ln_ppl_ratio": ln_ppl_ratio,
        "ln_ppl_ratio_stderr": abs(ln_ppl_ratio) * 0.3 + 1e-4,
    }


def mc_entry(kl: float, flips: float, delta_acc: float | None = None, n_tokens: int = 200) -> dict[str, Any]:
    """An entry of a multiple-choice task; ``delta_acc=None``: the task has no gold (no accuracy keys)."""
    entry = {
        **rolling_entry(kl, n_tokens),
        "n_docs": 20,
        "flips": flips,
        "flips_stderr": 0.05,
        "n_flips": round(20 * flips),
        "flips_norm": flips,
        "flips_norm_stderr": 0.05,
    }
    if delta_acc is not None:
        entry.update(
            {"delta_acc": delta_acc, "delta_acc_stderr": 0.05, "n_correct_to_wrong": 1, "n_wrong_to_correct": 0}
        )
    return entry


def write_results_json(
    folder: str | os.PathLike[str],
    *,
    quantize: str | None = None,
    group_size: int | None = None,
    weight_bytes: int | None = 4_000_000,
    reference: Mapping[str, Any] | None = None,
    results: Mapping[str, Any] | None = None,
    reference_bytes: int = 4_000_000,
) -> Path:
    """Write a ``results_*.json`` as lm-eval + distperp would (only the keys ``compare.load_run`` reads)."""
    options: dict[str, Any] = {"pretrained": "/models/tiny"}
    if quantize:
        options.update({"quantize": quantize, **({"group_size": group_size} if group_size else {})})
    info = {
        "options": options,
        "world_size": 1,
        "fingerprint": "0123456789abcdef",
        "weight_bytes": weight_bytes,
        "calls": [{"total_seconds": 1.0, "scored_tokens": 1000}],
        "quantization": {"weight_bytes_after": weight_bytes} if quantize else None,
        "reference": None
        if reference is None
        else {"source": "base", "dtype": "torch.float32", "tasks": dict(reference), "weight_bytes": reference_bytes},
    }
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "results_2026-01-01T00-00-00.000000.json"
    path.write_text(json.dumps({"results": dict(results or {}), "config": {"model": "distperp", "distperp": info}}))
    return path


# --- checkpoints as users have them -------------------------------------------------------------------


def lora_adapter(
    model_dir: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    seed: int = 0,
    r: int = 4,
    scale: float = 0.5,
    target_modules: Sequence[str] = ("q_proj", "v_proj", "down_proj"),
) -> Path:
    """A PEFT LoRA adapter for the model at ``model_dir`` with random, non-zero ``A`` and ``B`` (so that it changes
    the model: PEFT's default initialisation zeroes ``B``), saved to ``out`` (``adapter_config.json`` +
    ``adapter_model.safetensors``)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(
        r=r, lora_alpha=2 * r, target_modules=list(target_modules), lora_dropout=0.0, init_lora_weights=False
    )
    peft_model = get_peft_model(model, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in peft_model.named_parameters():
            if "lora_" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * scale)
    peft_model.save_pretrained(out)
    return Path(out)


def write_gguf(model_dir: str | os.PathLike[str], path: str | os.PathLike[str]) -> Path:
    """The Llama model at ``model_dir`` (float32 safetensors, byte-level BPE tokenizer) as a GGUF file at ``path``,
    written with the ``gguf`` package's writer as llama.cpp's converter lays it out: F32 tensors under GGUF names,
    ``attn_q``/``attn_k`` rows permuted to GGML's rotary layout (transformers permutes them back when loading), the
    tokenizer as ``gpt2`` tokens, types and merges. Weights round-trip exactly."""
    import gguf
    import numpy as np
    from safetensors.numpy import load_file
    from transformers import AutoConfig

    model_dir = Path(model_dir)
    config = AutoConfig.from_pretrained(model_dir)
    tokenizer = json.loads((model_dir / "tokenizer.json").read_text())
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("distperp-test-llama")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_rope_dimension_count(config.hidden_size // heads)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(float(getattr(config, "rope_theta", None) or config.rope_parameters["rope_theta"]))
    writer.add_vocab_size(config.vocab_size)
    vocab = sorted(tokenizer["model"]["vocab"].items(), key=lambda kv: kv[1])
    special = {t["id"] for t in tokenizer["added_tokens"] if t["special"]}
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([token for token, _ in vocab])
    writer.add_token_types([gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL for _, i in vocab])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tokenizer["model"]["merges"]])
    for name in ("bos", "eos", "unk", "pad"):
        token_id = getattr(config, f"{name}_token_id", None)
        if token_id is None and name in ("unk", "pad"):
            token_id = {"unk": 2, "pad": 3}[name]
        if token_id is not None:
            getattr(writer, f"add_{name}_token_id")(int(token_id))

    def permute(w: np.ndarray, n_head: int) -> np.ndarray:
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    names = {
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
    }
    for key, value in load_file(str(model_dir / "model.safetensors")).items():
        value = value.astype(np.float32)
        if key == "model.embed_tokens.weight":
            out = "token_embd.weight"
        elif key == "model.norm.weight":
            out = "output_norm.weight"
        elif key == "lm_head.weight":
            out = "output.weight"
        else:
            _, _, layer, *rest = key.split(".")
            module = ".".join(rest[:-1])
            out = f"blk.{layer}.{names[module]}.weight"
            if module == "self_attn.q_proj":
                value = permute(value, heads)
            elif module == "self_attn.k_proj":
                value = permute(value, kv_heads)
        writer.add_tensor(out, np.ascontiguousarray(value))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)


def peaked_model(source: str | os.PathLike[str], out: str | os.PathLike[str]) -> tuple[Any, Any]:
    """The model at ``source`` with peaked distributions (:func:`sharpened_model`, scale 4: greedy choices far from
    ties), loaded in float32, and its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = sharpened_model(source, out, scale=4.0)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(path)


def block_prompts(tokenizer: Any, text_path: Path, count: int = 9, block: bool = True) -> list[list[int]]:
    """``count`` generation prompts of 4 to 50 tokens cut from ``text_path``, after a shared ~25-token block of
    examples unless ``block`` is false."""
    words = text_path.read_text(encoding="utf-8").split()
    head = ("Examples:\n" + " ".join(words[:16]) + "\nA:") if block else ""
    return [
        tokenizer.encode(head + " " + " ".join(words[100 + 13 * i : 100 + 13 * i + 2 + 3 * i])) for i in range(count)
    ]


# ----------------------------------------------------------------------------------- shared by several test modules
class ThreadStore:
    """The store's add, set and (blocking) get, for threads."""

    def __init__(self):
        self.values, self.lock = {}, threading.Condition()

    def add(self, key, amount):
        with self.lock:
            self.values[key] = int(self.values.get(key, 0)) + amount
            return self.values[key]

    def set(self, key, value):
        with self.lock:
            self.values[key] = value
            self.lock.notify_all()

    def get(self, key):
        with self.lock:
            assert self.lock.wait_for(lambda: key in self.values, timeout=20), key
            return str(self.values[key]).encode()


def fewshot_units(questions=30, shots=70, seed=0, max_length=256):
    """Continuation units of ``questions`` random few-shot questions sharing one block of ``shots`` tokens."""
    from distperp_harness.planning.requests import continuation_unit

    rng = np.random.default_rng(seed)
    block = [int(t) for t in rng.integers(5, 900, shots)]
    out = []
    for _q in range(questions):
        question = [int(t) for t in rng.integers(5, 900, int(rng.integers(3, 25)))]
        answers = [[1000 + a] * int(rng.integers(1, 4)) for a in range(4)] + [[1000]]
        out += [continuation_unit(block + question, ans, max_length) for ans in answers]
    return list(dict.fromkeys(out))


class ThreadRanks:
    """``world`` ranks as threads: ``exchange`` is a real all-to-all between them (a barrier on each side)."""

    def __init__(self, world):
        self.world, self.box, self.barrier = world, {}, threading.Barrier(world)

    def rank(self, r):
        outer = self

        class _Rank:
            rank, world_size = r, outer.world
            received = 0
            sequence = 0

            def all_gather_tensor(self, tensor, name=""):
                """Every rank's ``tensor`` in rank order (shapes may differ in the first dimension only; bfloat16
                travels as int16)."""
                import torch

                wire = tensor.view(torch.int16) if tensor.dtype == torch.bfloat16 else tensor
                parts = self.exchange([wire.reshape(-1).numpy()] * outer.world, None, name)
                back = [torch.from_numpy(p.copy()).reshape(-1, *tensor.shape[1:]) for p in parts]
                return [b.view(torch.bfloat16) for b in back] if tensor.dtype == torch.bfloat16 else back

            def all_gather_object(self, obj, name=""):
                outer.box[("obj", r)] = obj
                outer.barrier.wait()
                out = [outer.box[("obj", s)] for s in range(outer.world)]
                outer.barrier.wait()
                return out

            def exchange(self, parts, counts, name=""):
                self.sequence += 1
                for d, part in enumerate(parts):
                    outer.box[(r, d)] = np.asarray(part)
                outer.barrier.wait()
                out = [outer.box[(s, r)] for s in range(outer.world)]
                assert counts is None or [len(o) for o in out] == list(counts), name  # sizes derived by the receiver
                self.received += sum(o.nbytes for s, o in enumerate(out) if s != r)
                outer.barrier.wait()
                return out

        return _Rank()


def run_ranks(world, fn):
    """``fn(rank)`` on ``world`` :class:`ThreadRanks` threads; their results, or the first exception."""
    group, results, errors = ThreadRanks(world), [None] * world, []

    def body(r):
        try:
            results[r] = fn(group.rank(r))
        except Exception as exc:
            errors.append(exc)
            group.barrier.abort()

    threads = [threading.Thread(target=body, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    if errors:
        raise errors[0]
    return results


def visible_columns(row, column):
    """Columns a query at ``column`` attends to under the tree mask: earlier columns of its run and its ancestors."""
    runs, anc = row.run_ids(), row.ancestors()
    return [c for c in range(column + 1) if anc[runs[column], runs[c]]]


def check_row_reads(rows, units, max_row_length=None, max_length=None):
    """Each unit is in one row, and the row gives back its input tokens at its positions and ids."""
    seen = sorted(i for r in rows for i in r.unit_ids)
    assert seen == list(range(len(units)))
    for row in rows:
        tokens, positions = row.tokens(), row.position_ids()
        assert len(tokens) == len(positions) == len(row.run_ids()) == row.length
        assert all(p < r for r, p in enumerate(row.parents[1:], 1)) and row.parents[0] == -1
        if max_row_length is not None and row.packed:
            assert row.length <= max_row_length
        if max_length is not None:
            assert max(positions) < max_length  # every path within max_length, however long the row
        for k, (uid, unit) in enumerate(zip(row.unit_ids, row.units)):
            assert units[uid] is unit
            cols = list(row.columns(k))
            assert len(cols) == unit.n_score
            first = unit.input_length - unit.n_score
            assert [tokens[c] for c in cols] == list(unit.tokens[first:-1])
            assert [positions[c] for c in cols] == list(range(first, unit.input_length))
            # the unit's whole input, and nothing else, is visible to its last scored column
            assert [tokens[c] for c in visible_columns(row, cols[-1])] == list(unit.tokens[:-1])


def tensor_leaves(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors inside ``t`` (a torchao or other wrapper subclass: its inner tensors, recursively)."""
    import torch

    if hasattr(type(t), "__tensor_flatten__") and type(t) not in (torch.Tensor, torch.nn.Parameter):
        names, _ = t.__tensor_flatten__()
        return [x for n in names for x in tensor_leaves(getattr(t, n))]
    return [t]


def assert_same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    """The two models' state dicts hold the same keys, tensor types, dtypes and bits."""
    import torch

    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        assert type(sa[key]) is type(sb[key]), key
        la, lb = tensor_leaves(sa[key]), tensor_leaves(sb[key])
        assert len(la) == len(lb) and all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(la, lb)), key


FAMILY_VOCAB = 1024
"""The families' vocabulary (Gemma 3 keeps its real 262,144): above :func:`fewshot_units`' token ids."""
_WINDOW = 16
"""Window and chunk of the windowed families: shorter than the few-shot rows, so it hides keys."""
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("llama", "sdpa", {}),
    "mistral-window": ("mistral", "sdpa", {"sliding_window": _WINDOW}),
    "qwen3-mixed-window": (
        "qwen3",
        "sdpa",
        {"use_sliding_window": True, "sliding_window": _WINDOW, "max_window_layers": 1, "num_hidden_layers": 3},
    ),
    "gemma2-softcaps": (
        "gemma2",
        "eager",
        {
            "sliding_window": _WINDOW,
            "attn_logit_softcapping": 5.0,
            "final_logit_softcapping": 2.0,
            "query_pre_attn_scalar": 16,
        },
    ),  # fmt: skip
    "gemma3-262k": (
        "gemma3_text",
        "sdpa",
        {
            "vocab_size": 262144,
            "sliding_window": _WINDOW,
            "query_pre_attn_scalar": 16,
            "num_hidden_layers": 3,
            "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
        },
    ),  # fmt: skip
    "gpt-oss-sinks-moe": (
        "gpt_oss",
        "eager",
        {
            "sliding_window": _WINDOW,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "layer_types": ["sliding_attention", "full_attention"],
        },
    ),  # fmt: skip
    "granite-scaled": (
        "granite",
        "sdpa",
        {"logits_scaling": 4.0, "embedding_multiplier": 2.0, "residual_multiplier": 0.5, "attention_multiplier": 0.2},
    ),
    "cohere2-window": (
        "cohere2",
        "sdpa",
        {"sliding_window": _WINDOW, "logit_scale": 0.5, "layer_types": ["sliding_attention", "full_attention"]},
    ),
    "glm4": ("glm4", "sdpa", {}),
    "deepseek-v3-mla-moe": (
        "deepseek_v3",
        "sdpa",
        {
            "head_dim": 8,
            "num_key_value_heads": 4,
            "kv_lora_rank": 16,
            "q_lora_rank": 32,
            "qk_rope_head_dim": 8,
            "qk_nope_head_dim": 8,
            "v_head_dim": 16,
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "n_group": 1,
            "topk_group": 1,
            "first_k_dense_replace": 1,
            "moe_intermediate_size": 32,
        },
    ),  # fmt: skip
    "llama4-chunked-moe": (
        "llama4_text",
        "sdpa",
        {
            "attention_chunk_size": _WINDOW,
            "num_local_experts": 4,
            "num_experts_per_tok": 1,
            "interleave_moe_layer_step": 1,
            "intermediate_size_mlp": 128,
            "no_rope_layers": [1, 0],
        },
    ),  # fmt: skip
    "qwen3-next-linear": (
        "qwen3_next",
        "sdpa",
        {
            "layer_types": ["linear_attention", "full_attention"],
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "linear_num_value_heads": 4,
            "linear_num_key_heads": 2,
            "linear_key_head_dim": 16,
            "linear_value_head_dim": 16,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 32,
        },
    ),  # fmt: skip
    "falcon-h1-ssm": (
        "falcon_h1",
        "sdpa",
        {"mamba_d_ssm": 64, "mamba_n_heads": 4, "mamba_d_head": 16, "mamba_n_groups": 1, "mamba_d_state": 16},
    ),
    "gpt2-learned": ("gpt2", "sdpa", {"max_position_embeddings": 128}),
    "phi3-longrope": (
        "phi3",
        "sdpa",
        {
            "original_max_position_embeddings": 48,
            "rope_parameters": {
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "long_factor": [1.0 + k for k in range(8)],
                "short_factor": [1.0] * 8,
            },
        },
    ),  # fmt: skip
}
"""Tiny random models of the families people evaluate, built from transformers' own config classes with their
features kept at small sizes: windows shorter than the rows (Mistral, Qwen 3 with mixed layers, Gemma 2/3, gpt-oss,
Cohere 2), soft-caps (Gemma 2), attention sinks and experts (gpt-oss), logit scales (Granite, Cohere 2), MLA
(DeepSeek-V3), chunked attention (Llama 4), linear attention and state spaces (Qwen3-Next, Falcon-H1), a learned
position table as long as ``max_length`` (GPT-2), a longrope factor chosen by the forward's longest path (Phi-3);
name -> (model_type, attention implementation, config keywords)."""
UNMASKED_FAMILIES = ("qwen3-next-linear", "falcon-h1-ssm")
"""The families whose layers attend by more than a mask: no packed rows, head only where scored."""


def family_model(name: str, dtype: Any = None, seed: int = 0, scale: float = 1.0) -> Any:
    """:data:`FAMILIES`' ``name`` as a random model in eval mode (float32 unless ``dtype``); ``scale`` multiplies
    every weight matrix (and expert stack), as :func:`sharpened_model` does: peaked distributions, greedy choices far
    from ties."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, impl, extra = FAMILIES[name]
    base = {
        "vocab_size": FAMILY_VOCAB, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 512,
        "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
    }  # fmt: skip
    config = AutoConfig.for_model(model_type, **{**base, **extra})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=impl)
    return _scaled(model, scale).to(dtype or torch.float32).eval()


def _scaled(model: Any, scale: float) -> Any:
    """``model`` with every weight matrix (and expert stack) multiplied by ``scale``, in place."""
    import torch

    if scale != 1.0:
        with torch.no_grad():
            for parameter in model.parameters():
                if parameter.dim() >= 2:
                    parameter.mul_(scale)
    return model


def published_model(name: str, scale: float = 1.0, dtype: Any = None, seed: int = 0) -> Any:
    """:data:`PUBLISHED`'s ``name`` (:func:`published_config`) as a random model in eval mode (float32 unless
    ``dtype``) with :func:`attention_of` its config; ``scale`` multiplies every weight matrix (and expert stack), as
    :func:`family_model` does."""
    import torch
    from transformers import AutoModelForCausalLM

    config = published_config(name)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attention_of(config))
    return _scaled(model, scale).to(dtype or torch.float32).eval()


class _FullDiskHandle:
    def __init__(self, disk: FullDisk, handle: Any) -> None:
        self._disk, self._handle = disk, handle

    def write(self, data: Any) -> int:
        size = len(data.encode("utf-8") if isinstance(data, str) else data)
        if size > self._disk.free:
            self._handle.write(data[: self._disk.free])
            self._disk.free = 0
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self._disk.free -= size
        return self._handle.write(data)

    def __enter__(self) -> _FullDiskHandle:
        return self

    def __exit__(self, *exc: Any) -> None:
        self._handle.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._handle, name)


class FullDisk:
    """A filesystem with little room left, in-process, where a real small tmpfs cannot be mounted: files opened for
    writing under ``folder`` share ``free`` bytes; the write that passes them writes what fits and raises
    ``OSError(ENOSPC)``, as a full disk does (the cut-short file stays unless its writer removes it). Install with
    ``FullDisk(folder, free).install(monkeypatch)`` (patches ``io.open`` and ``builtins.open``)."""

    def __init__(self, folder: Path, free: int) -> None:
        self.folder, self.free = folder.resolve(), free
        self._open = io.open

    def _target(self, file: Any) -> Path:
        if isinstance(file, int):
            return Path(os.readlink(f"/proc/self/fd/{file}"))
        return Path(file).resolve()

    def open(self, file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        handle = self._open(file, mode, *args, **kwargs)
        if any(m in mode for m in "wax+") and self._target(file).is_relative_to(self.folder):
            return _FullDiskHandle(self, handle)
        return handle

    def install(self, monkeypatch: Any) -> FullDisk:
        monkeypatch.setattr(io, "open", self.open)
        monkeypatch.setattr(builtins, "open", self.open)
        return self


LOAD_CHECKS = {
    "probe": ("", "PROBE", "probing what the model's forwards allow"),
    "invariance-check": (
        ",batch_invariant=true",
        "INVARIANCE",
        "checking that rows attend alone (batch_invariant)",
    ),
}
"""The checks at load that run forwards and a gather, for the fault tests: ``id -> (model_args to add, the suffix of
their DISTPERP_TEST_FAIL_*/DISTPERP_TEST_HOLD_* variables, the stage a failure there is named by)``."""
