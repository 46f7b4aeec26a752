"""Options: every --model_args key parsed, cast and validated in one place, with errors that name the fix."""

import dataclasses

import pytest

from distperp_harness.options import BatchInvariant, Options


def test_defaults_and_casts_from_cli_strings():
    opts = Options.from_kwargs(
        pretrained="m",
        batch_size="8",
        max_length="512",
        trust_remote_code="true",
        timeout="60",
        dtype="bf16",
        group_size="64",
        quantize="INT4",
    )
    assert opts.batch_size == 8 and opts.max_length == 512 and opts.trust_remote_code is True
    assert opts.timeout == 60.0 and opts.dtype == "bfloat16" and opts.group_size == 64 and opts.quantize == "int4"
    assert Options.from_kwargs(pretrained="m").batch_size == 1
    assert Options.from_kwargs(pretrained="m").share_prefix is True
    assert Options.from_kwargs(pretrained="m", share_prefix="false").share_prefix is False


@pytest.mark.parametrize("value, expected", [("auto", "auto"), ("auto:4", "auto:4"), (3, 3), ("16", 16)])
def test_batch_size_forms(value, expected):
    assert Options.from_kwargs(pretrained="m", batch_size=value).batch_size == expected


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"pretrained": "m", "batch_sise": 4}, "did you mean 'batch_size'"),
        ({"pretrained": "m", "dtype": "float8"}, "allowed: one of auto, float32, bfloat16, float16"),
        ({"pretrained": "m", "batch_size": "auto:x"}, "'auto' or 'auto:N'"),
        ({"pretrained": "m", "batch_size": 0}, "batch_size=0"),
        ({"pretrained": "m", "quantize": "int3"}, "one of none, int4, int8, 8da4w"),
        ({"pretrained": "m", "group_size": 100}, "one of 32, 64, 128, 256"),
        ({"pretrained": "m", "stride": 0}, "0 < stride <= max_length"),
        ({"pretrained": "m", "stride": 300, "max_length": 256}, "stride <= max_length (256)"),
        ({"pretrained": "m", "max_length": 1}, "max_length=1"),
        ({"pretrained": "m", "timeout": -1}, "timeout=-1"),
        ({"pretrained": "m", "trust_remote_code": "maybe"}, "trust_remote_code=true or trust_remote_code=false"),
        ({"pretrained": "m", "share_prefix": "sometimes"}, "share_prefix=true or share_prefix=false"),
        ({}, "needs pretrained="),
        ({"pretrained": "m", "shard_size": 0}, "shard_size=0 is not valid"),
        ({"pretrained": "m", "shard_size": "nodes"}, "or 'node'"),
        ({"pretrained": "m", "shard_size": "2.5"}, "shard_size='2.5'"),
    ],
)
def test_bad_values_are_named(kwargs, fragment):
    with pytest.raises(ValueError, match=None) as info:
        Options.from_kwargs(**kwargs)
    assert fragment in str(info.value)


@pytest.mark.parametrize("value, expected", [("node", "node"), ("NODE", "node"), ("2", 2), (8, 8), (None, 1)])
def test_shard_size_forms(value, expected):
    kwargs = {} if value is None else {"shard_size": value}
    assert Options.from_kwargs(pretrained="m", **kwargs).shard_size == expected


@pytest.mark.parametrize("kwargs, expected", [
    ({}, 1), ({"tp_size": "2"}, 2), ({"tp_size": "NODE"}, "node"), ({"tp_plan": "auto"}, "node"),
    ({"tp_plan": "auto", "tp_size": 4}, 4), ({"tp_plan": "None"}, 1),
])  # fmt: skip
def test_tensor_parallel_forms_including_lm_eval_hf_spelling(kwargs, expected):
    assert Options.from_kwargs(pretrained="m", **kwargs).tensor_parallel == expected


@pytest.mark.parametrize("kwargs, fragment", [
    ({"tp_size": 0}, "tp_size=0 is not valid"),
    ({"tp_size": "all"}, "or 'node' (all processes of a node compute each forward together)"),
    ({"tp_plan": "colwise"}, "tp_plan='colwise' is not valid"),
    ({"tp_size": 2, "shard_size": 2}, "either sharded by FSDP2 or split by its tensor-parallel plan, not both"),
    ({"tp_plan": "auto", "peft": "a"}, "peft= only with tp_size=1"),
    ({"tp_size": 2, "gguf_file": "m.gguf"}, "gguf_file= only with tp_size=1"),
])  # fmt: skip
def test_tensor_parallel_conflicts_are_named_with_the_fix(kwargs, fragment):
    with pytest.raises(ValueError) as info:
        Options.from_kwargs(pretrained="m", **kwargs)
    assert fragment in str(info.value) and "Fix:" in str(info.value)


def test_frozen_and_recorded():
    opts = Options.from_kwargs(pretrained="m", device="cuda:0", device_from_cli=True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.dtype = "float16"  # type: ignore[misc]
    with pytest.raises(ValueError, match="share_prefix='no'"):
        Options(pretrained="m", share_prefix="no")  # type: ignore[arg-type]
    record = opts.to_dict()
    assert record["pretrained"] == "m" and "device_from_cli" not in record


@pytest.mark.parametrize("key", ["mesh_of_one", "reference_model"])
def test_in_process_keywords_are_not_model_args(key):
    """DistPerpLM's in-process keywords (for the checks and sweep) cannot be typed in --model_args."""
    from distperp_harness.lm import DistPerpLM

    with pytest.raises(ValueError, match=f"Unknown --model_args key.*'{key}'"):
        DistPerpLM.create_from_arg_string(f"pretrained=some/model,{key}=True")


def test_checkpoint_keys_cast_from_cli_strings():
    opts = Options.from_kwargs(
        pretrained="m",
        peft="adapters/a",
        merge_adapter="false",
        think_end_token="151668",
        enable_thinking="true",
        chat_template_args='{"x": 1}',
        gguf_file="m.gguf",
        subfolder="ckpt",
    )
    assert opts.merge_adapter is False and opts.think_end_token == 151668 and opts.enable_thinking is True
    assert opts.chat_kwargs == {"x": 1, "enable_thinking": True}
    assert Options.from_kwargs(pretrained="m", think_end_token="</think>").think_end_token == "</think>"
    assert Options.from_kwargs(pretrained="m", peft="a", reference="pretrained").reference == "pretrained"
    assert Options.from_kwargs(pretrained="m", delta="d", reference="pretrained").delta == "d"


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"peft": "a", "delta": "d"}, "delta= or peft=, not both"),
        ({"reference": "pretrained"}, "reference=pretrained only with peft= or delta="),
        ({"merge_adapter": False}, "merge_adapter=false only with peft="),
        ({"peft": "a", "merge_adapter": False, "quantize": "int4"}, "the adapter is merged before quantize=int4"),
        ({"peft": "a", "merge_adapter": False, "shard_size": 2}, "merge_adapter=false only with shard_size=1"),
        ({"enable_thinking": True}, "enable_thinking=true together with think_end_token"),
        ({"think_end_token": ""}, "a string (e.g. '</think>') or a token id"),
        ({"chat_template_args": "[1, 2]"}, "is not a JSON object"),
        ({"gguf_file": " "}, "gguf_file=' ' is not valid"),
        ({"merge_adapter": "sometimes"}, "merge_adapter=true or merge_adapter=false"),
    ],
)
def test_bad_checkpoint_keys_are_named(kwargs, fragment):
    with pytest.raises(ValueError) as info:
        Options.from_kwargs(pretrained="m", **kwargs)
    assert fragment in str(info.value)


def test_in_memory_is_not_a_model_arg():
    with pytest.raises(ValueError, match="Unknown --model_args key.*'in_memory'"):
        from distperp_harness.lm import DistPerpLM

        DistPerpLM.create_from_arg_string("pretrained=some/model,in_memory=True")


def test_batch_invariant_is_auto_true_or_false_and_true_runs_eager():
    assert Options(pretrained="m").batch_invariant is BatchInvariant.AUTO
    for given, word in (("true", BatchInvariant.ON), (True, BatchInvariant.ON), ("0", BatchInvariant.OFF)):
        assert Options.from_kwargs(pretrained="m", batch_invariant=given).batch_invariant is word
        assert Options(pretrained="m", batch_invariant=given).batch_invariant is word
    with pytest.raises(ValueError, match="compile='default' is not valid.*batch_invariant=true") as info:
        Options.from_kwargs(pretrained="m", batch_invariant="true", compile="true")
    assert "Fix:" in str(info.value) or "drop compile=" in str(info.value)
    with pytest.raises(ValueError, match="batch_invariant='sometimes' is not valid.*auto, true or false"):
        Options.from_kwargs(pretrained="m", batch_invariant="sometimes")
    # auto goes with what true refuses: it is off there, said at start (run.runtime.invariance_blocked)
    assert Options.from_kwargs(pretrained="m", batch_invariant="auto", compile="true").compile == "default"
    assert Options.from_kwargs(pretrained="m", batch_invariant="auto", cp_size=2).cp_size == 2


# --- the command line, checked before lm-eval indexes its tasks (options.check_command_line) -----------------------


@pytest.mark.parametrize(
    "model_args, kwargs, environ, fragment",
    [
        ({"batch_sise": 2}, {}, {}, "did you mean 'batch_size'"),
        ({"quantize": "int5"}, {}, {}, "quantize='int5' is not valid"),
        ({"cp_size": 3}, {}, {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}, "cp_size=3 is not valid with 2 process"),
        ({"tp_size": 4}, {}, {"WORLD_SIZE": "2"}, "tp_size=4 is not valid with 2 process"),
        ({}, {"use_cache": "cache/x"}, {"WORLD_SIZE": "2"}, "--use_cache with 2 processes is not supported"),
        ({}, {"limit": 0}, {}, "--limit 0 selects no document"),
        ({"peft": "./no/such/adapter"}, {}, {}, "peft='./no/such/adapter': no such model folder"),
        (
            {},
            {"tasks": ["distperp_wikitext2"], "metadata": {"wikitext_pth": "x", "pretrained": "m"}},
            {},
            "--metadata key 'wikitext_pth' is not one this task reads; allowed: 'wikitext_path'",
        ),
        (
            {},
            {"tasks": "hellaswag,distperp_ppl", "metadata": {"wikitext_pat": "x"}},
            {},
            "Did you mean 'wikitext_path'",
        ),
        ({}, {"tasks": ["distperp_local_docs"], "metadata": {"doc_path": "x"}}, {}, "Did you mean 'docs_path'"),
    ],
)
def test_a_command_line_that_cannot_run_is_one_option_error(model_args, kwargs, environ, fragment, tmp_path):
    """Every key and value of --model_args, the group sizes against the launch's processes, --use_cache on several
    processes, --limit, a local path that is not there and the distperp tasks' --metadata keys: one error that every
    rank meets alike (rank 0 prints it), from the command line alone."""
    from distperp_harness.errors import OptionError
    from distperp_harness.options import check_command_line

    with pytest.raises(OptionError, match=fragment) as info:
        check_command_line({"pretrained": str(tmp_path), **model_args}, {}, environ=environ, **kwargs)
    assert info.value.same_on_every_rank and "\n" not in str(info.value)


def test_a_command_line_that_can_run_gives_its_options(tmp_path):
    from distperp_harness.options import check_command_line

    options = check_command_line(
        {"pretrained": str(tmp_path), "cp_size": 2},
        {"batch_size": "auto", "device": "cuda:0", "max_batch_size": None},
        tasks=["distperp_wikitext2", "hellaswag"],
        metadata={"wikitext_path": "sample", "docs_path": "d", "max_seq_lengths": [4096]},  # other tasks' keys
        environ={"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"},
    )
    assert options.batch_size == "auto" and options.device_from_cli and options.cp_size == 2
    assert check_command_line({"pretrained": str(tmp_path)}, {}, use_cache="cache/x", environ={})  # one process
    assert check_command_line({"pretrained": "org/name"}, {}, environ={}).pretrained == "org/name"  # a hub id


def test_every_shipped_task_and_tag_has_its_metadata_keys():
    """TASK_METADATA_KEYS names every task YAML and tag distperp ships, with the keys its loader reads."""
    import re

    from distperp_harness.commands.taskdir import tasks_path
    from distperp_harness.options import TASK_METADATA_KEYS

    folder = tasks_path() / "distperp"
    names = {p.stem for p in folder.glob("*.yaml")}
    tags = {m for p in folder.glob("*.yaml") for m in re.findall(r"^tag: (\S+)$", p.read_text(), re.M)}
    assert set(TASK_METADATA_KEYS) == names | tags
