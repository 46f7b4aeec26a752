"""Context parallelism (``cp_size``): the zigzag split, a group's forward simulated in one process (members as
threads, the gathers through a barrier) against one forward of the whole batch, the refusals, and real ``accelerate
launch`` runs (gloo on CPU): ``cp_size=2`` on 2 processes, 4 processes (2 groups) and 2 nodes x 2 give one process's
bits, and a failing member stops every rank naming it."""

import subprocess

import numpy as np
import pytest
import torch
from helpers import (
    LaunchOutputs,
    accelerate_launch_prefix,
    distperp_args,
    family_model,
    load_results,
    load_samples,
    offline_env,
    run_command,
    run_ranks,
    run_two_nodes,
)

from distperp_harness.errors import InputError
from distperp_harness.model import cp_attention
from distperp_harness.model.cp_attention import Group, natural_order, padded_length, zigzag
from distperp_harness.options import Options
from distperp_harness.planning.requests import continuation_unit
from distperp_harness.planning.rows import ShareMode, build_rows
from distperp_harness.run.scoring.engine.cp_forward import score_batch_cp
from distperp_harness.run.scoring.engine.forward import score_batch
from distperp_harness.run.scoring.engine.probe import probe
from distperp_harness.run.scoring.engine.support import record_paths

CPU = torch.device("cpu")
TASKS = "dptest_rolling,dptest_mc,dptest_fewshot,dptest_gen"


def test_zigzag_gives_each_member_chunks_i_and_2n_minus_1_minus_i():
    assert zigzag(8, 2, 0).tolist() == [0, 1, 6, 7] and zigzag(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert sorted(torch.cat([zigzag(16, 4, m) for m in range(4)]).tolist()) == list(range(16))
    gathered = torch.cat([zigzag(12, 3, m) for m in range(3)])
    assert gathered[natural_order(12, 3)].tolist() == list(range(12))
    assert padded_length(13, 2) == 16 and padded_length(16, 2) == 16
    with pytest.raises(ValueError, match="not cut in 4 chunks"):
        zigzag(10, 2, 0)


def _simulated(model, batch, cp: int, reference=None) -> list:
    """``score_batch_cp`` of every member of a group of ``cp``, the members as threads (:func:`helpers.run_ranks`)
    meeting at each gather and sum (in member order, as an all-gather and an all-reduce give them)."""

    def member(rank):
        def total(tensor):
            parts = rank.all_gather_tensor(tensor)
            out = parts[0].clone()
            for part in parts[1:]:
                out += part
            return out

        group = Group(cp, rank.rank)
        gather = rank.all_gather_tensor
        return score_batch_cp(
            model, batch, device=CPU, pad_token_id=0, group=group, reference=reference, gather=gather, reduce=total
        )

    return run_ranks(cp, member)


def _units(vocab: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    context = torch.randint(1, vocab, (150,), generator=g).tolist()
    units = [continuation_unit(context, torch.randint(1, vocab, (4,), generator=g).tolist(), 512) for _ in range(3)]
    units.append(continuation_unit(torch.randint(1, vocab, (90,), generator=g).tolist(), [5, 6, 7], 512))
    return units


@pytest.mark.parametrize("family", ["llama", "qwen3-mixed-window", "mistral-window"])
@pytest.mark.parametrize("mode", [ShareMode.PREFIX, ShareMode.INPUTS])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_a_groups_forward_is_one_forward_split(family, mode, dtype):
    """Tree rows and plain rows, full and sliding-window layers: every member of a group of 2 or 4 builds the same
    unit table (the same bits: any number of groups gives one result), equal to one forward of the whole batch in
    float64 and within float32 rounding in float32 (a member's matrix products have a share of the tokens)."""
    model = family_model(family, dtype=dtype)
    record_paths(model, probe(model, CPU, 0, 512))
    rows = build_rows(_units(model.config.vocab_size), mode)
    _assert_split_is_whole(model, rows, 1e-9 if dtype == torch.float64 else 1e-4, (family, mode))


def _assert_split_is_whole(model, rows, tolerance, label):
    """Groups of 2 and 4 (:func:`_simulated`): every member the same unit table, within ``tolerance`` of one forward
    of the whole batch, the same greedy flags and token counts."""
    whole = score_batch(model, rows, device=CPU, pad_token_id=0)
    cp_attention.use(model)
    try:
        for cp in (2, 4):
            members = _simulated(model, rows, cp)
            assert all(np.array_equal(m.stats, members[0].stats) for m in members), (label, cp)
            assert np.abs(members[0].stats - whole.stats).max() <= tolerance, (label, cp)
            assert np.array_equal(members[0].stats[:, 1:3], whole.stats[:, 1:3])  # greedy flags, token counts
    finally:
        model.set_attn_implementation("sdpa")


def _dynamic_ntk_llama():
    """A random Llama with dynamic NTK RoPE above 48 positions (float64)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from distperp_harness.model.lengths import fresh_rope_each_forward

    base = {k: v for k, v in family_model("llama").config.to_dict().items() if k != "model_type"}
    rope = {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0}
    config = AutoConfig.for_model("llama", **{**base, "max_position_embeddings": 48, "rope_parameters": rope})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").double().eval()
    assert fresh_rope_each_forward(model) == 1  # as the load stage makes it
    return model


@pytest.mark.parametrize("family", ["phi3-longrope", "dynamic-ntk"])
@pytest.mark.parametrize("mode", [ShareMode.PREFIX, ShareMode.INPUTS])
def test_a_length_chosen_rope_takes_the_whole_rows_frequencies_on_every_member(family, mode):
    """Rows of 59-67 tokens under a RoPE chosen by length above 48 positions (Phi-3's longrope; dynamic NTK): one
    forward takes the frequencies of its longest position; split over a group of 2 or 4, a member whose columns all
    lie within the first 48 positions takes them too, and the unit table is the whole forward's (float64)."""
    model = family_model(family, dtype=torch.float64) if family != "dynamic-ntk" else _dynamic_ntk_llama()
    record_paths(model, probe(model, CPU, 0, 512))
    g = torch.Generator().manual_seed(2)
    context = torch.randint(1, model.config.vocab_size, (55,), generator=g).tolist()
    units = [continuation_unit(context, torch.randint(1, 99, (4,), generator=g).tolist(), 512) for _ in range(3)]
    _assert_split_is_whole(model, build_rows(units, mode), 1e-9, (family, mode))


@pytest.mark.parametrize("tokens, cp", [(2048, 2), (4096, 4), (3072, 3), (1024, 2), (2048, 4)])
def test_against_cp_size_1_the_same_bits_only_for_rows_of_a_multiple_of_1024_tokens_per_member(tokens, cp):
    """The claim of docs/big-models.md ("Exactness"), float32 on CPU: a group's window has cp_size=1's bits exactly
    when each of its 2N chunks is a multiple of 512 tokens (the block in which torch's CPU attention sums keys), a
    row of a multiple of 1,024 x cp_size tokens; other rows are within float32 rounding (a random Llama of the
    tests' shape, one window; on wt2-llama-5m's shape 1,024 tokens at cp_size=2 differ by 1.6e-6 nats)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from distperp_harness.planning.requests import window_units

    shape = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    config = LlamaConfig(**shape, num_key_value_heads=2, head_dim=16, max_position_embeddings=tokens)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    model.set_attn_implementation("sdpa")
    record_paths(model, probe(model, CPU, 0, tokens))
    ids = torch.randint(1, 512, (tokens,), generator=torch.Generator().manual_seed(1)).tolist()
    rows = build_rows(window_units(ids, 0, tokens, None), ShareMode.OFF)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank of a CPU launch
    try:
        whole = score_batch(model, rows, device=CPU, pad_token_id=0)
        cp_attention.use(model)
        member = _simulated(model, rows, cp)[0]
    finally:
        torch.set_num_threads(threads)
        model.set_attn_implementation("sdpa")
    if tokens % (1024 * cp) == 0:  # every chunk a multiple of 512 tokens
        assert np.array_equal(member.stats, whole.stats), (tokens, cp)
    assert abs(member.stats[:, 0].sum() - whole.stats[:, 0].sum()) <= 1e-9 * abs(whole.stats[:, 0].sum())


def test_the_docs_claim_what_is_measured():
    """README and docs/big-models.md state the rule the test above holds (before: "the same bits when each member
    holds a few hundred tokens", which a 1,024-token window on 2 members disproved)."""
    from helpers import REPO_ROOT

    for page in ("README.md", "docs/big-models.md"):
        text = " ".join((REPO_ROOT / page).read_text().split())
        assert "a few hundred tokens" not in text and "multiple of 1,024 × `cp_size` tokens" in text, page


@pytest.mark.parametrize("family", ["llama", "qwen3-mixed-window"])
def test_a_reference_is_split_the_same_way(family):
    """With a reference (another random model of the family), every member's unit table (log-likelihoods of both,
    top-1 agreements, per-token KL) equals one forward of each model over the whole batch, in float64."""
    model = family_model(family, dtype=torch.float64)
    reference = family_model(family, dtype=torch.float64, seed=1)
    for m in (model, reference):
        record_paths(m, probe(m, CPU, 0, 512))
    rows = build_rows(_units(model.config.vocab_size), ShareMode.PREFIX)
    whole = score_batch(model, rows, device=CPU, pad_token_id=0, reference=reference)
    for m in (model, reference):
        cp_attention.use(m)
    try:
        members = _simulated(model, rows, 2, reference)
        for member in members:
            assert np.abs(member.stats - whole.stats).max() <= 1e-9, family
            assert np.array_equal(member.stats[:, 1:3], whole.stats[:, 1:3])
            assert all(np.abs(a - b).max() <= 1e-9 for a, b in zip(member.kl_rows(), whole.kl_rows()))
        assert whole.stats[:, 3].any() and any(k.any() for k in whole.kl_rows())  # the reference was scored
    finally:
        for m in (model, reference):
            m.set_attn_implementation("sdpa")


def test_query_blocks_are_even_and_bounded():
    for rows, keys in ((2048, 6144), (100, 8192), (64001, 10**6), (2048, 2048), (1, 5)):
        blocks = cp_attention.query_blocks(rows, keys)
        sizes = [b.stop - b.start for b in blocks]
        assert blocks[0].start == 0 and blocks[-1].stop == rows and max(sizes) - min(sizes) <= 1
        assert all(a.stop == b.start for a, b in zip(blocks, blocks[1:]))
        assert max(sizes) * keys <= cp_attention.MASK_BLOCK or max(sizes) <= cp_attention.MIN_QUERY_BLOCK


@pytest.mark.parametrize("family", ["llama", "mistral-window"])
def test_a_members_queries_in_blocks_give_the_bits_of_one_call(family, monkeypatch):
    """A member's queries go to sdpa in blocks bounded by MASK_BLOCK mask entries, one call per key-value head:
    blocks of 16 rows give the bits of blocks of a whole chunk (float32 on CPU), so the bound costs no exactness."""
    model = family_model(family, dtype=torch.float32)
    record_paths(model, probe(model, CPU, 0, 512))
    rows = build_rows(_units(model.config.vocab_size), ShareMode.PREFIX)
    cp_attention.use(model)
    try:
        whole = _simulated(model, rows, 2)[0]
        monkeypatch.setattr(cp_attention, "MASK_BLOCK", 1)
        monkeypatch.setattr(cp_attention, "MIN_QUERY_BLOCK", 16)
        calls, one_call = [], torch.nn.functional.scaled_dot_product_attention

        def counted(query, *args, **kwargs):
            calls.append(query.shape[2])  # the block's query rows
            return one_call(query, *args, **kwargs)

        monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counted)
        blocked = _simulated(model, rows, 2)[0]
        assert calls and max(calls) <= 16 and len(calls) > 4 * model.config.num_hidden_layers
        assert np.array_equal(blocked.stats, whole.stats), family
    finally:
        model.set_attn_implementation("sdpa")


def test_an_attention_that_is_more_than_a_mask_is_refused():
    model = family_model("gemma2-softcaps")  # eager: soft-capped scores
    with pytest.raises(InputError, match="cp_size=2: 'x' attends with 'eager'"):
        cp_attention.check_attention(model, 2, "x")
    cp_attention.check_attention(model, 1, "x")


@pytest.mark.parametrize(
    "extra, key", [({"shard_size": 2}, "shard_size"), ({"batch_invariant": True}, "batch_invariant")]
)
def test_cp_size_with_what_it_cannot_split_is_one_error(extra, key):
    with pytest.raises(ValueError, match=rf"{key}=.* with cp_size=2: context parallelism needs"):
        Options(pretrained="x", cp_size=2, **extra)


@pytest.mark.parametrize(
    "args, says",
    [
        ({"cp_min_tokens": "8192"}, "cp_min_tokens=8192 is not valid"),  # no effect without cp_size
        ({"cp_size": 2, "cp_min_tokens": "0"}, "cp_min_tokens=0 is not valid"),
        ({"cp_size": 2, "cp_min_tokens": "long"}, "cp_min_tokens='long' is not valid"),
    ],
)
def test_cp_min_tokens_is_auto_or_a_positive_count_with_cp_size(args, says):
    with pytest.raises(ValueError, match="Fix: e.g. cp_size=2,cp_min_tokens=8192") as info:
        Options.from_kwargs(pretrained="x", **args)
    assert says in str(info.value)


def test_auto_sends_rows_of_2048_tokens_per_member_to_the_group():
    assert Options.from_kwargs(pretrained="x", cp_size="2", cp_min_tokens="8192").cp_min_tokens == 8192
    auto = Options(pretrained="x", cp_size=2).cp_min_tokens
    assert cp_attention.min_tokens(auto, 2) == 4096 and cp_attention.min_tokens(auto, 4) == 8192
    assert cp_attention.min_tokens(512, 2) == 512 and cp_attention.min_tokens(auto, 1) > 10**12


# ------------------------------------------------------------------------------------------ real launches
@pytest.fixture(scope="module")
def cp_runs(tiny_model_dir, tasks_dir, tmp_path_factory):
    """One process (no cp, batch_invariant=false); every row on the groups (``cp_min_tokens=1``) with a reference
    (the same checkpoint, split the same way): ``cp_size=2`` on 2 processes, 4 processes (2 groups) and 2 nodes x 2
    (``node``); and ``cp_size=2`` with its default threshold, above every row of the test tasks (``short``)."""
    root = tmp_path_factory.mktemp("cp")
    out = {name: root / name for name in ("1p", "2p", "4p", "2nodes", "short")}

    def args(name, extra):
        return [*distperp_args(tiny_model_dir, tasks_dir, out[name], extra, TASKS), "--log_samples"]

    # batch_invariant=false: the mode a cp_size > 1 run computes its data-parallel rows in (auto is off there)
    run_command([*accelerate_launch_prefix(1), *args("1p", ",batch_invariant=false")], cwd=root)
    grouped = f",cp_min_tokens=1,reference={tiny_model_dir}"  # every row on the groups; a reference split likewise
    run_command([*accelerate_launch_prefix(2), *args("2p", ",cp_size=2" + grouped)], cwd=root)
    run_command([*accelerate_launch_prefix(4), *args("4p", ",cp_size=2" + grouped)], cwd=root)
    run_two_nodes(args("2nodes", ",cp_size=node" + grouped), cwd=root, per_node=2)
    run_command([*accelerate_launch_prefix(2), *args("short", ",cp_size=2")], cwd=root)
    return out


def _per_doc(samples):
    return {r["doc_id"]: [resp[0] for resp in r["resps"]] for r in samples}


@pytest.mark.distributed
def test_a_fixed_cp_size_gives_the_same_bits_on_any_number_of_groups_and_nodes(cp_runs):
    """cp_size=2: the same fingerprint (marked cp2:) and per-document results on 2 processes, 4 processes (two
    groups) and 2 nodes x 2; against one process, log-likelihoods within float32 rounding and the same greedy
    texts (every generation prompt, ``cp_min_tokens=1``, generated by a group: prefill split, cache split, each
    decode step combined over the members, the leader's tokens)."""
    base = load_results(cp_runs["1p"])["config"]["distperp"]
    first = load_results(cp_runs["2p"])["config"]["distperp"]
    assert first["fingerprint"].startswith("cp2:") and not base["fingerprint"].startswith("cp")
    for setup, world in (("2p", 2), ("4p", 4), ("2nodes", 4)):
        info = load_results(cp_runs[setup])["config"]["distperp"]
        assert info["world_size"] == world and info["sharding"]["cp_size"] == 2, setup
        assert info["fingerprint"] == first["fingerprint"], setup
        assert {"dptest_rolling", "dptest_mc", "dptest_fewshot"} <= set(info["reference"]["tasks"]), setup
        generated = [c for c in info["calls"] if c["kind"] == "generate_until"]
        assert [(c["engines"], c["context_parallel_jobs"]) for c in generated] == [(["group"], generated[0]["jobs"])]
        for task in TASKS.split(","):
            assert _per_doc(load_samples(cp_runs[setup], task)) == _per_doc(load_samples(cp_runs["2p"], task))
    for task in TASKS.split(","):
        one, two = _per_doc(load_samples(cp_runs["1p"], task)), _per_doc(load_samples(cp_runs["2p"], task))
        assert one.keys() == two.keys()
        for doc, answers in one.items():
            for a, b in zip(answers, two[doc]):
                a, b = (a[0], b[0]) if isinstance(a, list) else (a, b)
                if task == "dptest_gen":  # greedy texts
                    assert a == b, (task, doc)
                else:  # log-likelihoods (as logged: numbers or their strings)
                    assert abs(float(a) - float(b)) <= 1e-4 * max(1.0, abs(float(a))), (task, doc, a, b)


@pytest.mark.distributed
def test_a_groups_measured_traffic_is_the_formula(cp_runs, tiny_model_dir):
    """Bytes each member receives per scored token, counted from the collectives of real forwards at start
    (``config.distperp.traffic``), equal the formula: every layer's keys and values gathered, the scores summed."""
    from transformers import AutoConfig

    traffic = load_results(cp_runs["2p"])["config"]["distperp"]["traffic"]["scoring_received_bytes"]
    formula = cp_attention.received_bytes_per_token(AutoConfig.from_pretrained(tiny_model_dir), 2, 4)
    assert traffic == {"fixed": 0, "per_token": round(formula)}, (traffic, formula)


@pytest.mark.distributed
def test_rows_below_cp_min_tokens_are_computed_as_with_cp_size_1(cp_runs):
    """cp_size=2 with the default threshold (4,096 tokens) on rows of at most 128: every row stays data parallel,
    so the fingerprint and every document's results are one process's (with batch_invariant=false: auto is off
    with cp_size > 1), and no call counts a group's row."""
    base, short = (load_results(cp_runs[name]) for name in ("1p", "short"))
    assert short["config"]["distperp"]["fingerprint"] == base["config"]["distperp"]["fingerprint"]
    assert not any(call.get("context_parallel_rows") for call in short["config"]["distperp"]["calls"])
    assert not any(call.get("context_parallel_jobs") for call in short["config"]["distperp"]["calls"])
    everywhere = load_results(cp_runs["2p"])["config"]["distperp"]["calls"]
    assert all(call["context_parallel_rows"] == call["rows"] for call in everywhere if call.get("rows"))
    for task in TASKS.split(","):
        assert _per_doc(load_samples(cp_runs["short"], task)) == _per_doc(load_samples(cp_runs["1p"], task)), task


@pytest.mark.distributed
@pytest.mark.parametrize("failing", [0, 1])
def test_a_failing_member_of_a_cp_group_stops_every_rank_named(tiny_model_dir, tasks_dir, tmp_path, failing):
    run = LaunchOutputs(
        [
            subprocess.Popen(
                [
                    *accelerate_launch_prefix(2),
                    *distperp_args(
                        tiny_model_dir, tasks_dir, tmp_path / "out", ",cp_size=2,cp_min_tokens=1,timeout=60"
                    ),
                ],
                cwd=tmp_path,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                env=offline_env({"DISTPERP_TEST_FAIL": f"{failing}:1"}),
            )
        ]
    )
    run.wait_all(timeout=120)
    text = run.texts[0]
    assert run.procs[0].returncode != 0, text[-3000:]
    assert f"distperp: rank {failing} (" in text and "injected failure for tests" in text, text[-3000:]
    assert not list((tmp_path / "out").rglob("results_*.json"))
