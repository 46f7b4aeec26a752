"""Every family of :data:`helpers.FAMILIES` through ``--model distperp`` as lm-eval builds it, on 1 and on 2 processes
(one launch for all families): the probe's decision recorded and equal on every rank, the same bits on 1 and 2
processes for few-shot questions, rolling windows and greedy generation (continuous batching for every family whose
layers attend by a mask, windows included), greedy texts equal to lm-eval ``hf``'s, and the default
``batch_invariant=auto`` either on with the bits of batch size 1 at batch size 4 or off with its reason.
"""

import json
import textwrap

import pytest
from helpers import FAMILIES, UNMASKED_FAMILIES, accelerate_launch_prefix, family_model, run_command

pytestmark = pytest.mark.distributed

WORKER = textwrap.dedent(
    """
    import json, sys
    from lm_eval.api.instance import Instance
    from lm_eval.api.registry import get_model

    dirs, spec, out, sizes = json.loads(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3], sys.argv[4].split(",")
    for size, name, path in ((s, n, p) for s in sizes for n, p in dirs.items()):
        lm = get_model("distperp").create_from_arg_string(
            f"pretrained={path},max_length=128", {"batch_size": int(size), "device": "cpu"}
        )
        mine = list(range(lm.rank, len(spec["ll"]), lm.world_size))  # lm-eval's split of the documents
        ll = lm.loglikelihood([Instance("loglikelihood", {}, tuple(spec["ll"][i]), i) for i in mine], True)
        texts = list(range(lm.rank, len(spec["rolling"]), lm.world_size))
        rolling = lm.loglikelihood_rolling(
            [Instance("loglikelihood_rolling", {}, (spec["rolling"][i],), i) for i in texts], True
        )
        prompts = list(range(lm.rank, len(spec["gen"]), lm.world_size))
        gen = lm.generate_until(
            [Instance("generate_until", {}, (spec["gen"][i], {"until": ["\\n\\n"], "max_gen_toks": 12}), i)
             for i in prompts], True
        )
        record = {
            "ll": {i: [float(s).hex(), bool(g)] for i, (s, g) in zip(mine, ll)},
            "rolling": {i: float(s).hex() for i, s in zip(texts, rolling)},
            "gen": dict(zip(prompts, gen)),
            "paths": lm.prepared.paths,
            "sharing": str(lm.sharing.mode),
            "engines": [e for c in lm.stats.to_dicts() if c["kind"] == "generate_until" for e in c["engines"]],
            "invariance": [lm.prepared.invariance.name, lm.prepared.invariance_why],
        }
        with open(f"{out}/{name}-{lm.rank}" + ("" if size == sizes[0] else f"-bs{size}") + ".json", "w") as f:
            json.dump(record, f)
    """
)


def _requests(text: str) -> dict:
    """Few-shot questions after one block (four answers each), documents for rolling windows, generation prompts
    after a shared block: every path longer than the families' 16-token windows."""
    words = text.split()
    block = "Examples: " + " ".join(words[:40]) + "\n\n"
    ll = []
    for q in range(3):
        question = block + "Q: " + " ".join(words[60 + 9 * q : 66 + 9 * q]) + "\nA:"
        ll += [[question, " " + " ".join(words[200 + 3 * a : 201 + 3 * a + q])] for a in range(4)]
    rolling = [" ".join(words[300 + 80 * i : 300 + 80 * i + 40 + 20 * i]) for i in range(3)]
    gen = [block + " ".join(words[500 + 7 * i : 503 + 7 * i + i]) for i in range(3)]
    return {"ll": ll, "rolling": rolling, "gen": gen}


@pytest.fixture(scope="module")
def family_runs(tiny_tokenizer, sample_text_path, tmp_path_factory):
    """Each family saved with the test tokenizer (weights scaled: greedy choices far from ties), then one worker
    process and one 2-process launch over all of them: ``(requests, dirs, {world: {family: merged record}})``."""
    root = tmp_path_factory.mktemp("families")
    dirs = {}
    for name in FAMILIES:
        dirs[name] = root / name
        family_model(name, scale=4.0).save_pretrained(dirs[name])
        tiny_tokenizer.save_pretrained(dirs[name])
    spec = _requests(sample_text_path.read_text(encoding="utf-8"))
    args = [json.dumps({k: str(v) for k, v in dirs.items()}), json.dumps(spec)]
    (root / "worker.py").write_text(WORKER, encoding="utf-8")
    runs = {}
    for world, sizes in ((1, "4,1"), (2, "4")):  # one process also at batch size 1 (batch_invariant=auto's bits)
        out = root / f"out{world}"
        out.mkdir()
        command = [*accelerate_launch_prefix(world), str(root / "worker.py"), *args, str(out), sizes]
        run_command(command, cwd=root, timeout=1200)
        runs[world] = {name: _merged(out, name, world) for name in FAMILIES}
    runs["bs1"] = {name: _merged(out.parent / "out1", name, 1, "-bs1") for name in FAMILIES}
    return spec, dirs, runs


def _merged(out, name, world, tail=""):
    records = [json.loads((out / f"{name}-{rank}{tail}.json").read_text(encoding="utf-8")) for rank in range(world)]
    merged = {key: {} for key in ("ll", "rolling", "gen")}
    for record in records:
        for key in merged:
            merged[key].update({int(i): v for i, v in record[key].items()})
    assert all(r["paths"] == records[0]["paths"] for r in records)  # the same decision on every rank
    engines = sorted({e for r in records for e in r["engines"]})
    assert all(r["invariance"] == records[0]["invariance"] for r in records)  # one mode on every rank
    return {
        **merged,
        "paths": records[0]["paths"],
        "sharing": records[0]["sharing"],
        "engines": engines,
        "invariance": records[0]["invariance"],
    }


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_each_family_gives_the_same_bits_on_one_and_two_processes(family_runs, name):
    spec, _, runs = family_runs
    one, two = runs[1][name], runs[2][name]
    for key in ("ll", "rolling", "gen"):
        assert one[key] == two[key], (name, key)
        assert sorted(one[key]) == list(range(len(spec[key])))
    assert one["paths"] == two["paths"]
    probed = one["paths"]["model"]
    assert probed["probed"] and probed["head_only_where_scored"]
    assert probed["packed_rows"] == (name not in UNMASKED_FAMILIES)
    assert one["sharing"] == ("inputs" if name in UNMASKED_FAMILIES else "prefix")
    assert one["engines"] == two["engines"] == (["generate"] if name in UNMASKED_FAMILIES else ["slots"])


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_each_family_generates_hf_greedy_texts(family_runs, name):
    """lm-eval ``hf`` on the same checkpoint, greedy: the same texts as distperp's."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    spec, dirs, runs = family_runs
    hf = HFLM(pretrained=str(dirs[name]), batch_size=4, device="cpu", max_length=128, dtype="float32")
    requests = [
        Instance("generate_until", {}, (prompt, {"until": ["\n\n"], "max_gen_toks": 12}), i)
        for i, prompt in enumerate(spec["gen"])
    ]
    assert hf.generate_until(requests, disable_tqdm=True) == [runs[1][name]["gen"][i] for i in range(len(requests))]


AUTO_OFF = {  # families batch_invariant=auto leaves to the kernels' batches, and what it says
    "gpt-oss-sinks-moe": "routed experts",
    "deepseek-v3-mla-moe": "routed experts",
    "llama4-chunked-moe": "routed experts",
    "qwen3-next-linear": "routed experts",
    "gemma2-softcaps": "attention implementation is 'eager'",
    "falcon-h1-ssm": "scores move with its batch-mates",  # its recurrent layers: the check at start sees it
    "phi3-longrope": "scores move with its batch-mates",  # the RoPE factor follows the batch's longest row
}


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_the_default_auto_gives_each_family_the_bits_of_batch_size_1_or_says_why_not(family_runs, name):
    _, _, runs = family_runs
    four, one = runs[1][name], runs["bs1"][name]
    mode, why = four["invariance"]
    assert one["invariance"] == four["invariance"]
    if name in AUTO_OFF:
        assert mode == "OFF" and AUTO_OFF[name] in why, (name, why)
        return
    assert mode == "BATCHED" and why is None, (name, why)
    for key in ("ll", "rolling", "gen"):
        assert one[key] == four[key], (name, key)
