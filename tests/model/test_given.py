"""An in-memory model passed to ``simple_evaluate(model="distperp", model_args={"pretrained": model, ...})``: the same
per-sample results as its folder; what would change the caller's model is refused with the fix."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def objects(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir), AutoTokenizer.from_pretrained(tiny_model_dir)


def _evaluate(model_args, tasks_dir):
    import lm_eval
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(
        model="distperp",
        model_args=model_args,
        tasks=["dptest_rolling", "dptest_mc"],
        task_manager=TaskManager(include_path=str(tasks_dir)),
        batch_size=4,
        device="cpu",
        log_samples=True,
        limit=6,
    )


def test_in_memory_model_scores_as_its_folder(tiny_model_dir, tasks_dir, objects):
    model, tokenizer = objects
    given = _evaluate({"pretrained": model, "tokenizer": tokenizer, "max_length": 128}, tasks_dir)
    folder = _evaluate(f"pretrained={tiny_model_dir},max_length=128", tasks_dir)
    for task in ("dptest_rolling", "dptest_mc"):
        a = [
            (s["doc_id"], [float(r[0][0]) if isinstance(r[0], (list, tuple)) else float(r[0]) for r in s["resps"]])
            for s in given["samples"][task]
        ]
        b = [
            (s["doc_id"], [float(r[0][0]) if isinstance(r[0], (list, tuple)) else float(r[0]) for r in s["resps"]])
            for s in folder["samples"][task]
        ]
        assert a == b and len(a) == 6
    assert given["config"]["model_sha"] == ""
    assert given["config"]["distperp"]["options"]["pretrained_in_memory"] is True
    assert folder["config"]["model_sha"].startswith("sha256:")


def test_in_memory_model_refuses_what_would_change_it(objects):
    from lm_eval.api.registry import get_model

    model, tokenizer = objects
    with pytest.raises(ValueError, match=r"quantize=int4 with an in-memory model .*Fix: model.save_pretrained"):
        get_model("distperp").create_from_arg_obj({"pretrained": model, "tokenizer": tokenizer, "quantize": "int4"})
    with pytest.raises(ValueError, match=r"tokenizer=.* object was given with pretrained='x'"):
        get_model("distperp").create_from_arg_obj({"pretrained": "x", "tokenizer": tokenizer})
