"""Every bad input answered with one clear message (and a non-zero exit from the CLI), in seconds.

Rows of the bad-input table (docs/faults.md); the model-side rows are exercised through the same constructor the
lm-eval CLI calls (``create_from_arg_string``), and the command line's one-line form through the real CLI.
"""

import functools
import sys
import textwrap

import pytest
import torch
from helpers import accelerate_launch_prefix, make_lm, run_command, score_rolling, side_by_side

from distperp_harness.errors import TASKS_HINT, InputError


@pytest.mark.parametrize(
    "args, fragment",
    [
        (",bogus=1", "Unknown --model_args key(s) for --model distperp: 'bogus'"),
        (",dtype=float64", "dtype='float64' is not valid"),
        (",quantize=int3", "one of none, int4, int8, 8da4w"),
        (",group_size=100", "one of 32, 64, 128, 256"),
        (",stride=0", "0 < stride <= max_length"),
        (",max_length=64,stride=65", "stride <= max_length (64)"),
        (",stride=200", "stride=200 is not valid: need 0 < stride <= max_length (128)"),
        (",max_length=1", "max_length=1 is not valid"),
        (",batch_size=-2", "batch_size=-2"),
        (",reference=base", "reference=base compares against the unquantized checkpoint"),
    ],
)
def test_bad_model_args(tiny_model_dir, args, fragment):
    with pytest.raises(InputError) as info:  # library callers get the exception (a ValueError)
        make_lm(tiny_model_dir, args)
    assert fragment in str(info.value)


def test_missing_model_path(tiny_model_dir, tmp_path):
    with pytest.raises(ValueError, match="pretrained='.*/nope': no such model folder"):
        make_lm(tmp_path / "nope")
    with pytest.raises(ValueError, match="could not load"):
        make_lm(tmp_path)  # exists, but holds no model
    # A reference is named by its own key, not as pretrained=.
    with pytest.raises(ValueError, match="reference='/missing/path': no such model folder"):
        make_lm(tiny_model_dir, ",reference=/missing/path")
    with pytest.raises(ValueError, match=f"could not load a causal LM from reference='{tmp_path}'"):
        make_lm(tiny_model_dir, f",reference={tmp_path}")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_explicit_cuda_without_cuda_is_an_error_but_the_cli_default_falls_back(tiny_model_dir):
    with pytest.raises(ValueError, match="this machine has no CUDA device"):
        make_lm(tiny_model_dir, ",device=cuda")
    lm = make_lm(tiny_model_dir, "", {"device": "cuda:0"})  # lm-eval's CLI default
    assert lm.device.type == "cpu"


def test_empty_whitespace_and_long_documents(tiny_model_dir):
    lm = make_lm(tiny_model_dir, ",max_length=16")
    empty, spaces, long = score_rolling(lm, ["", "   \n ", "word " * 200])
    assert float(empty) == 0.0 and empty.n_tokens == 0  # documented: nothing to score
    assert spaces.n_tokens == len(lm.tok_encode("   \n "))
    assert long.n_tokens == len(lm.tok_encode("word " * 200)) > 16  # windows, not truncation


def test_nan_logits_name_the_window(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        model.lm_head.weight[:, :] = float("nan")
    model.save_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(tmp_path)
    lm = make_lm(tmp_path)
    with pytest.raises(ValueError, match=r"NaN/inf logits while scoring the window 'The lighthouse"):
        score_rolling(lm, ["The lighthouse keeper wrote every night."])


def test_tokenizer_without_bos_eos_needs_prefix_token_id(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.bos_token = None
    tok.eos_token = None
    tok.save_pretrained(tmp_path)
    AutoModelForCausalLM.from_pretrained(tiny_model_dir).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="prefix_token_id=<id>"):
        make_lm(tmp_path)
    lm = make_lm(tmp_path, ",prefix_token_id=0")
    assert score_rolling(lm, ["hello there"])[0].n_tokens > 0


def test_the_cli_says_a_bad_input_in_one_line_and_exits_1(tiny_model_dir, tasks_dir, tmp_path):
    """From the command line (run side by side, mostly start-up): a bad option is one line on stderr and exit 1,
    on one process and once for a 2-process launch (rank 0 says it for both), before lm-eval indexes its tasks or
    makes the model (neither its "Selected Tasks" nor its "Initializing" line comes); so are a group size the launch
    cannot split (``cp_size=3`` on 2 processes), ``--use_cache`` on 2 processes and a misspelled ``--metadata`` key
    of a distperp task; ``DISTPERP_TRACEBACK=1`` brings the traceback back; a task lm-eval does not know keeps
    lm-eval's error and gains the fix."""
    bad = [
        "--model",
        "distperp",
        "--model_args",
        f"pretrained={tiny_model_dir},quantize=int5",
        "--tasks",
        "dptest_rolling",
        "--include_path",
        str(tasks_dir),
    ]
    lm_eval = [sys.executable, "-m", "lm_eval"]
    runs = {
        "one": (lm_eval + bad, {}),
        "traceback": (lm_eval + bad, {"DISTPERP_TRACEBACK": "1"}),
        "task": (lm_eval + [*bad[:3], f"pretrained={tiny_model_dir}", "--tasks", "no_such_task"], {}),
        "launch": ([*accelerate_launch_prefix(2), "-m", "lm_eval", *bad], {}),
        "cp3": (
            [
                *accelerate_launch_prefix(2),
                "-m",
                "lm_eval",
                *bad[:3],
                f"pretrained={tiny_model_dir},cp_size=3",
                *bad[4:],
            ],
            {},
        ),
        "cache": (
            [
                *accelerate_launch_prefix(2),
                "-m",
                "lm_eval",
                *bad[:3],
                f"pretrained={tiny_model_dir}",
                *bad[4:],
                "--use_cache",
                str(tmp_path / "c"),
            ],
            {},
        ),
        "metadata": (
            lm_eval
            + [
                *bad[:3],
                f"pretrained={tiny_model_dir}",
                "--tasks",
                "distperp_wikitext2",
                "--metadata",
                '{"wikitext_pth": "x"}',
            ],
            {},
        ),
    }
    done = side_by_side(
        *(
            functools.partial(run_command, cmd, cwd=tmp_path, env=env, check=False, timeout=180)
            for cmd, env in runs.values()
        )
    )
    out = dict(zip(runs, done))
    line = (
        "distperp: error: quantize='int5' is not valid for --model distperp; allowed: one of none, int4, int8, "
        "8da4w. Fix: e.g. quantize=int4,group_size=128."
    )
    one = out["one"]
    assert one.returncode == 1 and line in one.stderr.splitlines() and "Traceback" not in one.stderr, one.stderr
    assert [t for t in one.stderr.splitlines() if t.startswith("distperp: error")] == [line]
    assert out["traceback"].returncode == 1 and "Traceback (most recent call last)" in out["traceback"].stderr
    assert "OptionError: quantize='int5' is not valid" in out["traceback"].stderr
    task = out["task"]
    assert task.returncode == 1 and "Tasks not found: no_such_task" in task.stderr
    assert task.stderr.rstrip().splitlines()[-1] == TASKS_HINT
    launch = out["launch"]
    said = launch.stdout + launch.stderr
    assert launch.returncode != 0 and said.count("distperp: error") == 1 and line in said, said[-3000:]
    assert "OptionError" not in said  # the launcher's own summary follows, but no worker's traceback
    for name, fragment in (
        ("cp3", "distperp: error: cp_size=3 is not valid with 2 process(es), 2 per node"),
        ("cache", "distperp: error: --use_cache with 2 processes is not supported by --model distperp"),
        ("metadata", "distperp: error: --metadata key 'wikitext_pth' is not one this task reads"),
    ):
        said = out[name].stdout + out[name].stderr
        errors = [t for t in said.splitlines() if t.startswith("distperp: ")]
        assert out[name].returncode != 0 and len(errors) == 1 and errors[0].startswith(fragment), said[-3000:]
    for name in ("one", "cp3", "cache", "metadata"):
        said = out[name].stdout + out[name].stderr
        assert "Selected Tasks" not in said and "Initializing distperp model" not in said, (name, said[-3000:])


def test_ranks_with_different_configurations_are_refused(tiny_model_dir, tmp_path):
    script = tmp_path / "mismatch.py"
    script.write_text(
        textwrap.dedent(f"""
        import os
        from lm_eval.api.registry import get_model
        rank = int(os.environ["RANK"])
        get_model("distperp").create_from_arg_string(
            "pretrained={tiny_model_dir},max_length=" + str(32 + rank), {{}})
    """)
    )
    proc = run_command([*accelerate_launch_prefix(2), str(script)], cwd=tmp_path, check=False, timeout=180)
    assert proc.returncode != 0
    assert "rank 1 does not run what rank 0 runs: options.max_length: 32 on rank 0 vs 33" in proc.stdout + proc.stderr


def test_a_prefix_token_outside_the_vocabulary_fails_at_start(tiny_model_dir):
    with pytest.raises(
        ValueError,
        match=r"prefix_token_id=99999 is not a token of this model: its embeddings hold "
        r"ids 0\.\.\d+\. Fix: pass prefix_token_id=<an id below \d+>",
    ):
        make_lm(tiny_model_dir, ",device=cpu,prefix_token_id=99999")


def test_a_quantize_setting_that_quantizes_no_layer_is_a_recorded_warning(tiny_model_dir):
    lm = make_lm(tiny_model_dir, ",device=cpu,quantize=int4,group_size=256,reference=base")
    info = lm.get_model_info()["distperp"]
    assert info["quantization"]["quantized"] == []
    assert any("quantized no layer" in w for w in info["quantization"]["warnings"])
    assert [w for w in info["warnings"] if "quantized no layer" in w]
    assert [w for w in info["warnings"] if "the comparison measures only the cast" in w]
    fine = make_lm(tiny_model_dir, ",device=cpu,quantize=int4,group_size=32").get_model_info()["distperp"]
    assert fine["warnings"] == [] and fine["quantization"]["warnings"] == []
