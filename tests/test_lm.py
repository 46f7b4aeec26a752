"""DistPerpLM against lm-eval's own ``hf`` model on the same tiny checkpoint: the three request types.

Runs both through ``lm_eval.simple_evaluate`` in-process on the local ``dptest_*`` tasks and compares logged
samples: rolling log-likelihoods within 1e-6 relative, loglikelihood within 1e-5 absolute with equal greedy
flags and acc/acc_norm (both multiple-choice shapes, through distperp's shared rows and its unshared path), greedy
generations identical.
"""

import math

import pytest

TASKS = ["dptest_mc", "dptest_mmlu", "dptest_fewshot", "dptest_rolling", "dptest_gen"]
MC_TASKS = ["dptest_mc", "dptest_mmlu", "dptest_fewshot"]


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tasks_dir):
    import lm_eval
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=str(tasks_dir))
    out = {}
    for name, model, extra, tasks in [
        ("hf", "hf", "", TASKS),
        ("distperp", "distperp", "", TASKS),
        ("unshared", "distperp", ",share_prefix=false", MC_TASKS),
    ]:
        out[name] = lm_eval.simple_evaluate(
            model=model,
            model_args=f"pretrained={tiny_model_dir},max_length=128{extra}",
            tasks=tasks,
            task_manager=manager,
            batch_size=4,
            device="cpu",
            log_samples=True,
        )
    return out


def _samples(run, task):
    return {s["doc_id"]: s for s in run["samples"][task]}


def test_rolling_parity(runs):
    hf, dp = _samples(runs["hf"], "dptest_rolling"), _samples(runs["distperp"], "dptest_rolling")
    assert hf.keys() == dp.keys() and len(hf) >= 5
    for doc_id in hf:
        a, b = hf[doc_id]["resps"][0][0], dp[doc_id]["resps"][0][0]
        assert float(b) == pytest.approx(float(a), rel=1e-6)
        assert b.n_tokens > 0
    for metric in ("word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"):
        assert runs["distperp"]["results"]["dptest_rolling"][metric] == pytest.approx(
            runs["hf"]["results"]["dptest_rolling"][metric], rel=1e-6
        )


@pytest.mark.parametrize("task", MC_TASKS)
@pytest.mark.parametrize("ours", ["distperp", "unshared"])
def test_loglikelihood_parity(runs, task, ours):
    hf, dp = _samples(runs["hf"], task), _samples(runs[ours], task)
    for doc_id in hf:
        for (a_ll, a_greedy), (b_ll, b_greedy) in zip(
            (r[0] for r in hf[doc_id]["resps"]), (r[0] for r in dp[doc_id]["resps"])
        ):
            # hf sums log-probs in float32: n additions of magnitude |ll| can be off by ~n * eps32 * |ll|,
            # which exceeds 1e-5 for long continuations of a random model; ours are float64 sums.
            hf_rounding = b_ll.n_tokens * 2.0**-23 * abs(float(a_ll))
            assert abs(float(a_ll) - float(b_ll)) <= max(1e-5, hf_rounding)
            assert a_greedy == b_greedy
        assert hf[doc_id]["acc"] == dp[doc_id]["acc"]
        assert hf[doc_id].get("acc_norm") == dp[doc_id].get("acc_norm")
    for metric in ("acc,none", "acc_norm,none"):
        assert runs[ours]["results"][task].get(metric) == runs["hf"]["results"][task].get(metric)


def test_shared_rows_are_recorded(runs):
    shared = runs["distperp"]["config"]["distperp"]
    unshared = runs["unshared"]["config"]["distperp"]
    assert shared["sharing"] == {
        "mode": "prefix",
        "requests": "loglikelihood",
        "max_row_length": 128,
        "cached_prefix": "group",  # the default, batch_invariant=auto (on, on this CPU): a row group's prefix
        "fallback_reason": None,
        "row_budget": "batch-invariant: rows of at most 128 tokens (max_length=128) whatever the batching",
    }
    assert unshared["sharing"]["mode"] == "off"
    call = next(c for c in shared["calls"] if c["kind"] == "loglikelihood")
    alone = next(c for c in unshared["calls"] if c["kind"] == "loglikelihood")
    assert call["units"] == alone["units"] == alone["rows"] and alone["tokens_saved"] == 0
    assert call["rows"] < call["units"] / 3 and call["tokens_saved"] > call["computed_tokens"]
    assert call["computed_tokens"] + call["tokens_saved"] == alone["computed_tokens"]
    assert sum(call["padded_tokens_per_rank"]) < sum(alone["padded_tokens_per_rank"]) / 2
    rolling = next(c for c in shared["calls"] if c["kind"] == "loglikelihood_rolling")
    assert rolling["share_mode"] == "off" and rolling["rows"] == rolling["units"]
    # dptest_fewshot's two-shot block is computed once per batch; each question costs about its own tokens
    assert call["batches_sharing_a_prefix"] > 0 and call["row_groups"] >= 2
    assert call["computed_tokens_per_context"] < alone["computed_tokens_per_context"] / 2


def test_greedy_generation_parity(runs):
    hf, dp = _samples(runs["hf"], "dptest_gen"), _samples(runs["distperp"], "dptest_gen")
    assert [hf[i]["resps"] for i in sorted(hf)] == [dp[i]["resps"] for i in sorted(dp)]
    assert any(r[0][0] for r in (hf[i]["resps"] for i in hf))  # something was generated


def test_model_info_records_the_run(runs):
    info = runs["distperp"]["config"]["distperp"]
    assert info["world_size"] == 1 and info["num_nodes"] == 1
    assert len(info["fingerprint"]) == 16
    kinds = {c["kind"] for c in info["calls"]}
    assert {"loglikelihood", "loglikelihood_rolling"} <= kinds
    assert all(c["peak_memory_bytes_per_rank"][0] > 0 for c in info["calls"])
    assert runs["distperp"]["config"]["batch_sizes"] == [4]


def test_rolling_sums_are_float64(runs):
    dp = _samples(runs["distperp"], "dptest_rolling")
    for s in dp.values():
        value = s["resps"][0][0]
        assert isinstance(value, float) and math.isfinite(value)


@pytest.fixture(scope="module")
def chat_model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model with a simple chat template on its tokenizer."""
    import shutil

    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("chat_model")
    for f in tiny_model_dir.iterdir():
        shutil.copy(f, out / f.name)
    tok = AutoTokenizer.from_pretrained(out)
    tok.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<assistant> {% endif %}"
    )
    tok.save_pretrained(out)
    return out


def _evaluate(model, model_dir, tasks_dir, **kwargs):
    import lm_eval
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(
        model=model,
        model_args=f"pretrained={model_dir},max_length=128",
        tasks=["dptest_gen"],
        task_manager=TaskManager(include_path=str(tasks_dir)),
        batch_size=4,
        device="cpu",
        log_samples=True,
        limit=4,
        **kwargs,
    )


def test_chat_template_generation_parity(chat_model_dir, tasks_dir):
    hf = _evaluate("hf", chat_model_dir, tasks_dir, apply_chat_template=True)
    dp = _evaluate("distperp", chat_model_dir, tasks_dir, apply_chat_template=True)
    prompts = [s["arguments"][0][0] for s in dp["samples"]["dptest_gen"]]
    assert all("<assistant> " in p for p in prompts)
    assert [s["resps"] for s in hf["samples"]["dptest_gen"]] == [s["resps"] for s in dp["samples"]["dptest_gen"]]


def test_sampled_generation_is_seeded_by_content(tiny_model_dir, tasks_dir):
    kwargs = {"gen_kwargs": "do_sample=True,temperature=1.0,top_k=50"}
    a = _evaluate("distperp", tiny_model_dir, tasks_dir, **kwargs)
    b = _evaluate("distperp", tiny_model_dir, tasks_dir, **kwargs)
    greedy = _evaluate("distperp", tiny_model_dir, tasks_dir)
    resps = [s["resps"] for s in a["samples"]["dptest_gen"]]
    assert resps == [s["resps"] for s in b["samples"]["dptest_gen"]]
    assert resps != [s["resps"] for s in greedy["samples"]["dptest_gen"]]


def test_models_without_the_mask_fall_back_and_say_so(tiny_model_dir, tasks_dir, monkeypatch, caplog):
    import logging

    import lm_eval
    from lm_eval.tasks import TaskManager

    from distperp_harness.run.scoring.engine import masks

    def ignored(self, model, layout=None):  # as for a model that builds its own causal mask whatever it is given
        return {"attention_mask": None, "position_ids": self.position_ids}

    monkeypatch.setattr(masks.Packing, "kwargs", ignored)
    with caplog.at_level(logging.INFO, logger="distperp_harness"):
        logging.getLogger("distperp_harness").addHandler(caplog.handler)
        run = lm_eval.simple_evaluate(
            model="distperp",
            model_args=f"pretrained={tiny_model_dir},max_length=128",
            tasks=["dptest_mc"],
            task_manager=TaskManager(include_path=str(tasks_dir)),
            batch_size=4,
            device="cpu",
            log_samples=True,
        )
        logging.getLogger("distperp_harness").removeHandler(caplog.handler)
    sharing = run["config"]["distperp"]["sharing"]
    why = "nats from the unshared rows"
    assert sharing["mode"] == "inputs" and why in sharing["fallback_reason"]
    paths = run["config"]["distperp"]["paths"]["model"]
    assert paths["probed"] and not paths["packed_rows"] and paths["evidence"]["largest_difference"]["tree"] > 1e-3
    said = [r for r in caplog.records if "shared-prefix rows are off" in r.getMessage()]
    assert len({id(r) for r in said}) == 1 and why in said[0].getMessage()  # once
    call = next(c for c in run["config"]["distperp"]["calls"] if c["kind"] == "loglikelihood")
    assert call["share_mode"] == "inputs" and call["rows"] < call["units"]
