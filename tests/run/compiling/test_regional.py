"""``compile=``: options, accuracy of the compiled layers against float64 eager, no recompilation, the eager fallback
and the resume key. One compile of the tiny model (a module fixture) serves every test."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import make_lm, score_rolling
from lm_eval.api.instance import Instance

from distperp_harness.options import COMPILE_MODES, Options
from distperp_harness.planning.requests import Unit, window_units
from distperp_harness.run.compiling import regional as compiling
from distperp_harness.run.generation.engine.step import CompiledStep
from distperp_harness.run.scoring.engine.forward import LL, score_batch

ARGS = ",device=cpu,dtype=float32,max_length=64,batch_size=4,share_prefix=false"
TEXTS = [
    "The tower is 324 metres tall, about the same height as an 81-storey building.",
    "It was the first structure to reach a height of 300 metres. " * 4,
    "Short.",
]


@pytest.mark.parametrize(
    "given, expected",
    [
        (True, "default"),
        ("true", "default"),
        (False, "false"),
        ("false", "false"),
        ("max-autotune", "max-autotune"),
        ("Reduce-Overhead", "reduce-overhead"),
    ],
)
def test_options_accept_true_false_and_modes(given, expected):
    opts = Options.from_kwargs(pretrained="m", compile=given)
    assert opts.compile == expected
    assert opts.compile_mode == (None if expected == "false" else expected)
    assert opts.to_dict()["compile"] == expected


def test_options_reject_unknown_mode():
    with pytest.raises(ValueError, match=r"compile='fast'.*" + ".*".join(COMPILE_MODES)):
        Options.from_kwargs(pretrained="m", compile="fast")


@pytest.fixture(scope="module")
def compiled_lm(tiny_model_dir):
    return make_lm(tiny_model_dir, ARGS + ",compile=true")


@pytest.fixture(scope="module")
def eager_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def _float64_ll(model, tokens: list[int], n_score: int) -> float:
    """Float64 log-softmax of the eager model's logits of the unpadded sequence, summed with fsum."""
    with torch.no_grad():
        logits = model(torch.tensor([tokens[:-1]])).logits[0].double()
    logp = torch.log_softmax(logits, dim=-1)
    first = len(tokens) - 1 - n_score
    return math.fsum(float(logp[p, tokens[p + 1]]) for p in range(first, len(tokens) - 1))


def test_compiled_and_warmed_up_at_load(compiled_lm):
    state = compiled_lm.compiled
    assert state.active and state.reason is None and state.mode == "default"
    assert state.layers == 2 and state.graphs >= 1 and state.seconds > 0
    info = compiled_lm.get_model_info()["distperp"]["compile"]
    assert info["active"] and info["recompilations"] == 0 and info["warmup"]


def test_cpu_linears_compute_from_packed_weights(compiled_lm):
    linears = [
        m
        for layer in compiling.decoder_layers(compiled_lm.model)
        for m in layer.modules()
        if isinstance(m, torch.nn.Linear)
    ]
    packed = compiled_lm.get_model_info()["distperp"]["compile"]["prepacked"]
    assert packed["linears"] == len(linears) > 0 and all("forward" in m.__dict__ for m in linears)
    assert packed["bytes"] == sum(m.weight.numel() * 4 for m in linears)
    rows, length = (int(v) for v in compiled_lm.compiled.warmup[0].split("x"))
    assert packed["rows_hint"] == rows * length  # from the warm-up shape: the same on every process


def test_compiled_rolling_matches_float64_eager(compiled_lm, eager_model):
    before = compiled_lm.compiled.compiled_calls
    scores = score_rolling(compiled_lm, TEXTS)
    assert compiled_lm.compiled.compiled_calls > before  # the compiled layers computed them
    for text, score in zip(TEXTS, scores):
        units = window_units(compiled_lm.tok_encode(text), compiled_lm.prefix_token_id, compiled_lm.max_length)
        expected = math.fsum(_float64_ll(eager_model, list(u.tokens), u.n_score) for u in units)
        assert abs(float(score) - expected) <= max(1e-5, 5e-6 * abs(expected)), (text, float(score), expected)


def test_no_recompilation_across_batches_of_other_shapes(compiled_lm, eager_model):
    state = compiled_lm.compiled
    graphs, eager_before, compiled_before = state.recompilations(), dict(state.eager_calls), state.compiled_calls
    batches = [
        [Unit(tuple(range(5, 5 + n)), n - 1) for n in (33, 20, 9)],  # 3 rows x 32
        [Unit(tuple(range(7, 7 + n)), n - 1) for n in (50, 12)],
    ]  # 2 rows x 49
    for units in batches:
        out = score_batch(compiled_lm.model, units, device=torch.device("cpu"), pad_token_id=0)
        for unit, row in zip(units, out.stats):
            expected = _float64_ll(eager_model, list(unit.tokens), unit.n_score)
            assert abs(row[LL] - expected) <= max(1e-5, 5e-6 * abs(expected))
    assert state.recompilations() == graphs == 0
    assert state.eager_calls == eager_before  # every layer call ran compiled
    assert state.compiled_calls == compiled_before + 2 * len(batches)


GEN = [
    ("Q: What is two plus two?\nA:", {"until": ["\n"], "max_gen_toks": 12, "do_sample": False}),
    ("Complete the list: Monday, Tuesday,", {"until": ["."], "max_gen_toks": 12, "do_sample": False}),
    ("The tower is 324 metres tall", {"until": ["\n"], "max_gen_toks": 12, "do_sample": False}),
    ("Q: What colour is the sky on a clear day?\nA:", {"until": ["\n"], "max_gen_toks": 12, "do_sample": False}),
    ("Short.", {"max_gen_toks": 12, "do_sample": True, "temperature": 1.0}),
]


def test_generation_decodes_with_the_compiled_static_step(compiled_lm, tiny_model_dir):
    """compile=true: the lanes' decode steps run as the compiled static step (one graph per bucket, compiled when
    the plan needs it), with the eager engine's texts (greedy and seeded)."""
    requests = [Instance("generate_until", {}, args, i) for i, args in enumerate(GEN)]
    texts = compiled_lm.generate_until(requests, disable_tqdm=True)
    decode = compiled_lm.get_model_info()["distperp"]["compile"]["decode"]
    assert decode["state"] == "compiled" and decode["graphs"] and decode["compiled_calls"] > 0
    assert decode["eager_calls"]["not_covered"] == 0 and compiled_lm.compiled.recompilations() == 0
    eager = make_lm(tiny_model_dir, ARGS)
    assert not isinstance(eager.static_decoding, CompiledStep)  # the eager fixed-shape step
    assert texts == eager.generate_until(requests, disable_tqdm=True)


def test_compile_is_in_the_run_identity_and_resume_key(compiled_lm):
    from distperp_harness.stages import run_identity

    assert run_identity(compiled_lm.options, compiled_lm.device_identity)["options"]["compile"] == "default"
    assert compiled_lm._scoring_config()["compiled"] == "default"
    assert compiled_lm._scoring_config()["options"]["compile"] == "default"


QUESTIONS = [
    (
        "The tower is 324 metres tall, about the same height as",
        [" an 81-storey building.", " a tree.", " nothing at all, really", " the moon"],
    ),
    ("It was the first structure to reach", [" a height of 300 metres.", " Paris"]),
]


def _mc_requests():
    pairs = [(c, x) for c, answers in QUESTIONS for x in answers]
    return pairs, [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]


def _check_mc(lm, eager_model, pairs, results):
    for pair, (ll, _) in zip(pairs, results):
        context, continuation = lm._encode_pair(*pair)
        expected = _float64_ll(eager_model, context + continuation, len(continuation))
        assert abs(ll - expected) <= max(1e-5, 5e-6 * abs(expected)), (pair, ll, expected)


@pytest.fixture(scope="module")
def compiled_tree_lm(tiny_model_dir):
    return make_lm(tiny_model_dir, ARGS.replace(",share_prefix=false", "") + ",compile=true")


def test_tree_mask_graph_waits_for_a_plan_with_tree_rows(compiled_tree_lm):
    """Rolling windows (one unit per row) never need the tree-mask graph: it is not compiled for them."""
    lm = compiled_tree_lm
    assert lm.sharing.mode == "prefix" and lm.compiled.active, lm.compiled.reason
    graphs = lm.compiled.graphs
    if lm.compiled.tree_mask == "not needed yet":  # this module's tests may run in any order
        score_rolling(lm, TEXTS)
        assert lm.compiled.tree_mask == "not needed yet" and lm.compiled.graphs == graphs
        assert not any(w.endswith("tree mask") for w in lm.compiled.warmup)


def test_tree_rows_compile_and_match_float64_eager(compiled_tree_lm, eager_model):
    """With prefix sharing (the default) the first plan with tree rows compiles the tree-mask graph (at its fixed
    warm-up shape), and multiple-choice answers scored in tree rows match a float64 log-softmax of the eager
    model on each answer alone."""
    lm = compiled_tree_lm
    state = lm.compiled
    pairs, requests = _mc_requests()
    before = state.compiled_calls
    results = lm.loglikelihood(requests, disable_tqdm=True)
    assert state.tree_mask == "compiled" and any(w.endswith("tree mask") for w in state.warmup)
    assert state.compiled_calls > before and state.recompilations() == 0
    assert lm.get_model_info()["distperp"]["compile"]["tree_mask"] == "compiled"
    _check_mc(lm, eager_model, pairs, results)


def test_tree_mask_failure_runs_tree_rows_eager(tiny_model_dir, eager_model, monkeypatch):
    monkeypatch.setenv("DISTPERP_TEST_TREE_MASK_FAILURE", "no tree today")
    lm = make_lm(tiny_model_dir, ARGS.replace(",share_prefix=false", "") + ",compile=true")
    pairs, requests = _mc_requests()
    results = lm.loglikelihood(requests, disable_tqdm=True)
    state = lm.compiled
    assert state.active and state.tree_mask.startswith("eager") and "no tree today" in state.tree_mask
    assert state.eager_calls["not_covered"] > 0
    _check_mc(lm, eager_model, pairs, results)
    compiled_before = state.compiled_calls
    score_rolling(lm, TEXTS)  # plain rows still run compiled
    assert state.compiled_calls > compiled_before


def test_failure_runs_eager_and_says_why(tiny_model_dir, compiled_lm, monkeypatch, caplog):
    monkeypatch.setenv("DISTPERP_TEST_COMPILE_FAILURE", "inductor says no")
    lm = make_lm(tiny_model_dir, ARGS + ",compile=true")
    state = lm.compiled
    assert not state.active and "inductor says no" in state.reason
    assert all(
        "forward" not in m.__dict__ for layer in compiling.decoder_layers(lm.model) for m in layer.modules()
    )  # eager again: layers and their linears (no packed weights)
    assert lm.get_model_info()["distperp"]["compile"]["prepacked"]["linears"] == 0
    assert (
        not isinstance(lm.static_decoding, CompiledStep)
        and lm.get_model_info()["distperp"]["compile"]["decode"] is None
    )
    assert lm._scoring_config()["compiled"] is None  # eager bits: not the compiled run's resume key
    assert lm.get_model_info()["distperp"]["compile"]["reason"] == state.reason
    # batch_invariant=auto is off with compile= (decided before compiling), so the eager bits are false's
    eager = make_lm(tiny_model_dir, ARGS + ",batch_invariant=false")
    assert [float(s) for s in score_rolling(lm, TEXTS)] == [float(s) for s in score_rolling(eager, TEXTS)]


def test_compiling_is_not_offered_on_cuda(eager_model):
    """compile= on CUDA runs eager with the reason (measured slower than eager there); on CPU it is tried."""
    assert compiling.unsupported([eager_model], 1, torch.device("cpu")) is None
    why = compiling.unsupported([eager_model], 1, torch.device("cuda", 0))
    assert why == compiling.CUDA_REFUSAL and "not offered on CUDA" in why and "cuda_graphs" in why


def test_warmup_shapes_come_from_max_length_and_batching():
    assert compiling.warmup_shapes(lambda length: 4096 // length, 1024) == [(4, 1024)]
    assert compiling.warmup_shapes(lambda length: max(1, 4096 // length), 8192) == [(1, 8192), (2, 4096)]


@pytest.mark.distributed
def test_two_processes_give_the_bits_of_one(compiled_tree_lm, tiny_model_dir, tasks_dir, tmp_path):
    """``accelerate launch`` with 2 processes and compile=true (prefix sharing on) on a tiny rolling task, a
    multiple-choice task and a generation task: every log-likelihood and every text equals the in-process (1
    process) compiled run's, bit for bit (rank 1 waits for rank 0's compiles, the tree-mask graph's and the decode
    step's included, and loads its kernels from the cache)."""
    from helpers import accelerate_launch_prefix, load_results, load_samples, run_command

    args = ARGS.replace(",batch_size=4", "").replace(",share_prefix=false", "")
    out = tmp_path / "2p"
    run_command(
        [
            *accelerate_launch_prefix(2),
            "-m",
            "lm_eval",
            "--model",
            "distperp",
            "--model_args",
            f"pretrained={tiny_model_dir}{args},compile=true",
            "--tasks",
            "dptest_rolling,dptest_mc,dptest_gen",
            "--include_path",
            str(tasks_dir),
            "--batch_size",
            "4",
            "--log_samples",
            "--output_path",
            str(out),
        ],
        cwd=tmp_path,
    )
    info = load_results(out)["config"]["distperp"]
    assert info["world_size"] == 2 and info["compile"]["active"] and info["compile"]["recompilations"] == 0
    assert info["compile"]["compiled_calls"] > 0 and info["compile"]["tree_mask"] == "compiled"
    samples = load_samples(out, "dptest_rolling")
    one = score_rolling(compiled_tree_lm, [s["doc"]["text"] for s in samples])
    assert [float(s["resps"][0][0]) for s in samples] == [float(x) for x in one]
    mc = load_samples(out, "dptest_mc")
    pairs = [(a["arg_0"], a["arg_1"]) for s in mc for a in s["arguments"].values()]  # lm-eval's sample layout
    requests = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]
    one_mc = compiled_tree_lm.loglikelihood(requests, disable_tqdm=True)
    assert [float(r[0][0]) for s in mc for r in s["resps"]] == [float(ll) for ll, _ in one_mc]
    gen = load_samples(out, "dptest_gen")
    requests = [
        Instance(
            "generate_until", {}, (s["arguments"]["gen_args_0"]["arg_0"], s["arguments"]["gen_args_0"]["arg_1"]), i
        )
        for i, s in enumerate(gen)
    ]
    assert [s["resps"][0][0] for s in gen] == compiled_tree_lm.generate_until(requests, disable_tqdm=True)
    assert info["compile"]["decode"]["state"] == "compiled" and info["compile"]["decode"]["graphs"]  # rank 0's
