"""The run's record in the results JSON reads as what the run used."""

import json

import torch
from helpers import make_lm


def test_options_say_the_device_and_compile_mode_the_run_used(tiny_model_dir):
    from distperp_harness.lm import DistPerpLM

    lm = DistPerpLM.create_from_arg_string(f"pretrained={tiny_model_dir},max_length=128", {"device": "cuda:0"})
    info = json.loads(json.dumps(lm.get_model_info(), default=str))["distperp"]
    if not torch.cuda.is_available():  # lm-eval's default device fell back to the CPU: the record says so
        assert info["options"]["device"] == info["device"] == "cpu"
    assert info["options"]["compile"] is False
    assert info["sharing"]["requests"] == "loglikelihood"
    assert info["sharing"]["mode"] is None  # no loglikelihood call ran: no sharing mode was used


def test_a_rolling_only_run_records_no_sharing_mode(tiny_model_dir):
    from helpers import score_rolling

    lm = make_lm(tiny_model_dir, ",max_length=64")
    score_rolling(lm, ["a few words of text to score"])
    info = lm.get_model_info()["distperp"]
    assert [c["kind"] for c in info["calls"]] == ["loglikelihood_rolling"] and info["sharing"]["mode"] is None


def test_a_device_the_user_gave_is_recorded_as_given(tiny_model_dir):
    info = make_lm(tiny_model_dir, ",device=cpu").get_model_info()["distperp"]
    assert info["options"]["device"] == "cpu" and info["options"]["compile"] is False


def test_batch_size_auto_records_the_rows_its_batches_held(tiny_model_dir):
    from helpers import score_rolling

    lm = make_lm(tiny_model_dir, ",max_length=64", {"batch_size": "auto"})
    assert lm.batch_sizes == {}  # nothing planned yet
    score_rolling(lm, ["a few words of text to score", "and some more words here", "a third one"])
    rows = lm.get_model_info()["distperp"]["calls"][0]["max_batch_rows"]
    assert rows >= 1 and lm.batch_sizes == {0: rows}
