"""Scoring: chunked float64 log-probs, greedy flags and KL equal an independent float64 computation."""

import copy
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from distperp_harness.planning.requests import Unit
from distperp_harness.run.rules import Batching, CachedPrefix
from distperp_harness.run.runtime import choose_sharing
from distperp_harness.run.scoring.engine import forward as scoring
from distperp_harness.run.scoring.engine import support
from distperp_harness.run.scoring.engine.forward import (
    GREEDY,
    LL,
    N_TOKENS,
    REF_LL,
    TOP1,
    NonFiniteLogitsError,
    score_batch,
)


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def _reference_scores(model, unit, ref=None):
    """Hand-written float64: full logits of the unpadded sequence, explicit log-softmax, fsum."""
    with torch.no_grad():
        logits = model(torch.tensor([unit.tokens[:-1]])).logits[0].double()
        ref_logits = ref(torch.tensor([unit.tokens[:-1]])).logits[0].double() if ref is not None else None
    first = unit.input_length - unit.n_score
    lps, greedy, kls, ref_lps, agree = [], True, [], [], 0
    for pos in range(first, unit.input_length):
        row = logits[pos].tolist()
        top = max(row)
        log_z = top + math.log(math.fsum(math.exp(x - top) for x in row))
        target = unit.tokens[pos + 1]
        lps.append(row[target] - log_z)
        greedy &= row.index(top) == target
        if ref_logits is not None:
            rrow = ref_logits[pos].tolist()
            rtop = max(rrow)
            r_log_z = rtop + math.log(math.fsum(math.exp(x - rtop) for x in rrow))
            ref_lps.append(rrow[target] - r_log_z)
            kls.append(math.fsum(math.exp(r - r_log_z) * ((r - r_log_z) - (m - log_z)) for r, m in zip(rrow, row)))
            agree += rrow.index(rtop) == row.index(top)
    return math.fsum(lps), greedy, kls, math.fsum(ref_lps), agree


def _units(seed=0):
    rng = np.random.default_rng(seed)
    return [
        Unit(tuple(int(t) for t in rng.integers(4, 400, size=n)), k)
        for n, k in [(40, 39), (33, 5), (12, 1), (64, 20), (7, 6)]
    ]


def test_log_likelihoods_match_float64_reference(model):
    units = _units()
    out = score_batch(model, units, device=torch.device("cpu"), pad_token_id=3)
    assert out.stats.dtype == np.float64 and out.kl is None
    for unit, row in zip(units, out.stats):
        ll, greedy, _, _, _ = _reference_scores(model, unit)
        assert row[LL] == pytest.approx(ll, rel=1e-6, abs=1e-5)
        assert bool(row[GREEDY]) == greedy and row[N_TOKENS] == unit.n_score


def test_chunking_changes_nothing_but_rounding(model, monkeypatch):
    units = _units(1)
    whole = score_batch(model, units, device=torch.device("cpu"), pad_token_id=3).stats
    monkeypatch.setitem(scoring._CHUNK_ELEMENTS, "cpu", 7 * model.config.vocab_size)  # 7 positions per chunk
    chunked = score_batch(model, units, device=torch.device("cpu"), pad_token_id=3).stats
    np.testing.assert_allclose(chunked, whole, rtol=1e-6)
    again = score_batch(model, units, device=torch.device("cpu"), pad_token_id=3).stats
    assert np.array_equal(chunked, again)  # same batch, same chunks: same bits


def test_no_device_to_host_sync_per_chunk_on_accelerators(model, monkeypatch):
    """On a GPU every read of a value (``bool``, ``item``, ``nonzero``, ``tolist``) waits for the queue; the chunk
    loop must not do one per chunk. The accelerator path runs here on the CPU with the reads counted."""
    monkeypatch.setattr(scoring, "_HOST_DEVICE_TYPES", ())
    reads = []
    for name in ("__bool__", "item", "nonzero", "tolist"):
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, _name=name, **kwargs):
            reads.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    units = _units(1)
    whole = score_batch(model, units, device=torch.device("cpu"), pad_token_id=3)
    one_chunk = len(reads)
    monkeypatch.setitem(scoring._CHUNK_ELEMENTS, "cpu", 3 * model.config.vocab_size)
    reads.clear()
    chunked = score_batch(model, units, device=torch.device("cpu"), pad_token_id=3)
    assert sum(u.n_score for u in units) > 9  # several chunks
    assert len(reads) == one_chunk, reads
    np.testing.assert_allclose(chunked.stats, whole.stats, rtol=1e-6)


def test_greedy_flag_on_the_models_own_argmax(model):
    tokens = [5]
    with torch.no_grad():
        for _ in range(6):
            tokens.append(int(model(torch.tensor([tokens])).logits[0, -1].argmax()))
    out = score_batch(model, [Unit(tuple(tokens), 6)], device=torch.device("cpu"), pad_token_id=3)
    assert out.stats[0, GREEDY] == 1.0


def test_kl_against_reference_matches_float64(model):
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.02 * torch.randn_like(p, generator=torch.Generator().manual_seed(0)))
    units = _units(2)
    out = score_batch(model, units, device=torch.device("cpu"), pad_token_id=3, reference=ref)
    for unit, row, kl in zip(units, out.stats, out.kl):
        ll, _, kls, ref_ll, agree = _reference_scores(model, unit, ref)
        assert row[LL] == pytest.approx(ll, rel=1e-6, abs=1e-5)
        assert row[REF_LL] == pytest.approx(ref_ll, rel=1e-6, abs=1e-5)
        assert row[TOP1] == agree
        assert len(kl) == unit.n_score and (kl > 0).all()
        np.testing.assert_allclose(kl, kls, rtol=1e-4, atol=1e-7)


def test_self_reference_has_zero_kl(model):
    out = score_batch(model, _units(3), device=torch.device("cpu"), pad_token_id=3, reference=model)
    for row, kl in zip(out.stats, out.kl):
        assert np.all(np.abs(kl) < 1e-12) and row[TOP1] == row[N_TOKENS] and row[REF_LL] == row[LL]


def test_non_finite_logits_are_reported(model):
    broken = copy.deepcopy(model)
    with torch.no_grad():
        broken.lm_head.weight[7, 0] = float("nan")
    with pytest.raises(NonFiniteLogitsError) as info:
        score_batch(broken, _units(4), device=torch.device("cpu"), pad_token_id=3)
    assert info.value.rows


# ------------------------------------------------------------------------------ shared rows (multiple choice)
def _choice_units(model, seed=0, max_length=128):
    """Four contexts (1..40 tokens), each with four answers of 1-6 tokens; the first answer of each context is the
    model's own greedy continuation, so greedy flags are exercised in packed rows."""
    from distperp_harness.planning.requests import UnitTable, continuation_unit

    rng = np.random.default_rng(seed)
    units = []
    for n_context in (1, 9, 23, 40):
        context = [int(t) for t in rng.integers(4, 400, size=n_context)]
        greedy = list(context)
        with torch.no_grad():
            for _ in range(3):
                greedy.append(int(model(torch.tensor([greedy])).logits[0, -1].argmax()))
        answers = [greedy[n_context:]] + [[int(t) for t in rng.integers(4, 400, size=k)] for k in (1, 4, 6)]
        answers.append([int(rng.integers(4, 400))])  # a second one-token answer
        units += [continuation_unit(context, a, max_length) for a in answers]
    return UnitTable(units).units


def _close(value, expected):
    """The issue's accuracy bound: within 1e-5 absolute or 5e-6 relative."""
    return abs(value - expected) <= max(1e-5, 5e-6 * abs(expected))


@pytest.mark.parametrize("batch_rows", [1, 3, 64])
def test_shared_rows_match_float64_per_unit(model, batch_rows):
    from distperp_harness.planning.rows import build_rows

    units = _choice_units(model)
    rows = build_rows(units, "prefix", max_row_length=128)
    assert len(rows) == 4 and all(r.packed for r in rows)
    unshared = score_batch(model, units, device=torch.device("cpu"), pad_token_id=3).stats
    greedy_seen = 0
    for start in range(0, len(rows), batch_rows):
        batch = rows[start : start + batch_rows]
        out = score_batch(model, batch, device=torch.device("cpu"), pad_token_id=3).stats
        for row_stats, uid in zip(out, [i for r in batch for i in r.unit_ids]):
            ll, greedy, _, _, _ = _reference_scores(model, units[uid])
            assert _close(row_stats[LL], ll), (uid, row_stats[LL], ll)
            assert row_stats[GREEDY] == unshared[uid, GREEDY] == float(greedy)
            assert row_stats[N_TOKENS] == units[uid].n_score
            greedy_seen += int(greedy)
    assert greedy_seen >= 4  # every context's own continuation


def test_shared_rows_with_reference_match_float64(model):
    from distperp_harness.planning.rows import build_rows

    ref = _perturbed_copy(model)
    units = _choice_units(model, seed=1)
    rows = build_rows(units, "prefix")
    out = score_batch(model, rows, device=torch.device("cpu"), pad_token_id=3, reference=ref)
    _assert_matches_float64_with_reference(model, ref, units, rows, out)


def _perturbed_copy(model):
    """A reference model: ``model`` with small seeded noise on every weight."""
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.02 * torch.randn_like(p, generator=torch.Generator().manual_seed(1)))
    return ref


def _assert_matches_float64_with_reference(model, ref, units, rows, out):
    for row_stats, kl, uid in zip(out.stats, out.kl, [i for r in rows for i in r.unit_ids]):
        ll, _, kls, ref_ll, agree = _reference_scores(model, units[uid], ref)
        assert _close(row_stats[LL], ll) and _close(row_stats[REF_LL], ref_ll)
        assert row_stats[TOP1] == agree
        np.testing.assert_allclose(kl, kls, rtol=1e-4, atol=1e-7)


def _tiny_config(model_type):
    from transformers import AutoConfig

    extra = {"rotary_dim": 4} if model_type == "gptj" else {}
    return AutoConfig.for_model(
        model_type,
        vocab_size=300,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        pad_token_id=0,
        bos_token_id=0,
        eos_token_id=0,
        **extra,
    )


def test_attention_implementations_and_layer_types_that_cannot_take_the_mask_are_named(model):
    """Refused before any probe: flash attention (no custom mask) and layers that attend by more than a mask
    (linear attention); a window is a layout rule now, not a refusal."""
    assert support.implementation_refuses(model) is None
    flash = copy.copy(model.config)
    flash._attn_implementation = "flash_attention_2"
    holder = torch.nn.Module()
    holder.config = flash
    assert "flash_attention_2" in support.implementation_refuses(holder)
    linear = _tiny_config("qwen3_next")
    linear.layer_types = ["linear_attention", "full_attention"]
    linear._attn_implementation = "sdpa"
    holder.config = linear
    assert "'linear_attention' layers attend by more than a mask" in support.declared_paths(holder).packed_rows
    windowed = _tiny_config("mistral")
    windowed.sliding_window = 64
    windowed._attn_implementation = "sdpa"
    holder.config = windowed
    paths = support.declared_paths(holder, 128)
    assert paths.packed_rows is None and paths.layout.span == 64
    assert support.declared_paths(holder, 64).layout.span == 0  # a window as long as every path never applies


SHARED_MODEL = Path(__file__).resolve().parents[3].parent / "shared" / "models" / "wt2-llama-5m"
SHARED_TEXT = SHARED_MODEL.parents[1] / "data" / "wikitext-2" / "valid.txt"


@pytest.mark.skipif(
    not (SHARED_MODEL / "config.json").is_file() or not SHARED_TEXT.is_file(),
    reason="optional: ../shared/models/wt2-llama-5m and ../shared/data/wikitext-2 not present",
)
def test_shared_rows_on_the_shared_model():
    """HellaSwag- and MMLU-shaped questions from WikiText-2 valid on wt2-llama-5m: shared rows vs float64."""
    from transformers import AutoTokenizer

    from distperp_harness.planning.requests import UnitTable, continuation_unit
    from distperp_harness.planning.rows import build_rows

    shared = AutoModelForCausalLM.from_pretrained(SHARED_MODEL, dtype=torch.float32).eval()
    ids = AutoTokenizer.from_pretrained(SHARED_MODEL).encode(SHARED_TEXT.read_text(encoding="utf-8")[:20000])
    units = []
    for q in range(6):
        start = 200 * q
        context = ids[start : start + 60]
        endings = [ids[start + 60 + 40 * k : start + 72 + 40 * k] for k in range(4)]
        units += [continuation_unit(context, e, 1024) for e in endings]
        units += [continuation_unit(context, [ids[start + 60 + 40 * k]], 1024) for k in range(4, 8)]
    units = UnitTable(units).units
    rows = build_rows(units, "prefix", 1024)
    assert len(rows) == 6 and sum(r.length for r in rows) < sum(u.input_length for u in units) / 3
    out = score_batch(shared, rows, device=torch.device("cpu"), pad_token_id=0).stats
    unshared = score_batch(shared, units, device=torch.device("cpu"), pad_token_id=0).stats
    for row_stats, uid in zip(out, [i for r in rows for i in r.unit_ids]):
        unit = units[uid]
        with torch.no_grad():  # float64 by hand, vectorized over the vocabulary (8,192 entries)
            logits = shared(torch.tensor([unit.tokens[:-1]])).logits[0, -unit.n_score :].double()
        top = logits.max(dim=-1).values
        log_z = top + torch.log(torch.exp(logits - top[:, None]).sum(dim=-1))
        targets = torch.tensor(unit.tokens[-unit.n_score :])
        ll = math.fsum((logits[torch.arange(unit.n_score), targets] - log_z).tolist())
        greedy = bool((logits.argmax(dim=-1) == targets).all())
        assert _close(row_stats[LL], ll), (uid, row_stats[LL], ll)
        assert row_stats[GREEDY] == unshared[uid, GREEDY] == float(greedy)


# ------------------------------------------------------------- tree rows and prefixes computed once per batch
def _few_shot_units(model, seed=0, shots=40, questions=6, max_length=128):
    """A ``shots``-token few-shot block shared by every question (first_n), each question 3-9 tokens, four
    answers: the model's own greedy continuation, a one-token, a 4-token and a 2-token answer."""
    from distperp_harness.planning.requests import UnitTable, continuation_unit

    rng = np.random.default_rng(seed)
    block = [int(t) for t in rng.integers(4, 400, size=shots)]
    units = []
    for q in range(questions):
        context = block + [int(t) for t in rng.integers(4, 400, size=3 + q)]
        greedy = list(context)
        with torch.no_grad():
            for _ in range(2):
                greedy.append(int(model(torch.tensor([greedy])).logits[0, -1].argmax()))
        answers = [greedy[len(context) :], [int(rng.integers(4, 400))]] + [
            [int(t) for t in rng.integers(4, 400, size=k)] for k in (4, 2)
        ]
        units += [continuation_unit(context, a, max_length) for a in answers]
    return UnitTable(units).units


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("rows_per_batch", [1, 2, 4])
def test_tree_rows_and_shared_prefixes_match_float64(tiny_model_dir, impl, rows_per_batch):
    """Few-shot questions in tree rows, batches computing their shared block once: every unit equals the float64
    log-softmax of its own unshared logits; greedy flags equal the unshared path's."""
    from distperp_harness.planning.plan import make_batches
    from distperp_harness.planning.rows import plan_rows, shared_prefix

    tiny = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation=impl).eval()
    units = _few_shot_units(tiny)
    plan = plan_rows(units, "prefix", max_row_length=64)
    assert any(len(r.runs) > 3 for r in plan.rows) and len(plan.rows) >= 3
    unshared = score_batch(tiny, units, device=torch.device("cpu"), pad_token_id=3).stats
    batches = make_batches([r.length for r in plan.rows], batch_size=rows_per_batch, group_starts=plan.group_starts)
    shared_seen = 0
    for batch in batches:
        rows = plan.rows[batch.start : batch.stop]
        shared = shared_prefix(rows)
        shared_seen += shared > 0
        out = score_batch(tiny, rows, device=torch.device("cpu"), pad_token_id=3, shared=shared).stats
        for row_stats, uid in zip(out, [i for r in rows for i in r.unit_ids]):
            ll, greedy, _, _, _ = _reference_scores(tiny, units[uid])
            assert _close(row_stats[LL], ll), (uid, row_stats[LL], ll)
            assert row_stats[GREEDY] == unshared[uid, GREEDY] == float(greedy)
    assert (shared_seen > 0) == (rows_per_batch > 1)


def test_shared_prefix_with_reference_matches_float64(model):
    from distperp_harness.planning.rows import plan_rows, shared_prefix

    ref = _perturbed_copy(model)
    units = _few_shot_units(model, seed=2)
    rows = plan_rows(units, "prefix", max_row_length=64).rows
    shared = shared_prefix(rows)
    assert shared >= 40
    out = score_batch(model, rows, device=torch.device("cpu"), pad_token_id=3, reference=ref, shared=shared)
    _assert_matches_float64_with_reference(model, ref, units, rows, out)


def test_a_batch_with_a_shared_prefix_makes_two_forward_calls_per_model(model):
    """Prefix then rows, for the model and the reference in turn: what an idle rank of a shard group mirrors."""
    from distperp_harness.planning.rows import plan_rows, shared_prefix, unit_rows

    units = _few_shot_units(model, seed=3)
    rows = plan_rows(units, "prefix", max_row_length=64).rows
    shared = shared_prefix(rows)
    ref = copy.deepcopy(model)
    calls = []
    hooks = [
        m.base_model.register_forward_hook(
            lambda mod, args, kwargs, out, name=name: calls.append(name), with_kwargs=True
        )
        for name, m in (("model", model), ("ref", ref))
    ]
    try:
        score_batch(model, rows, device=torch.device("cpu"), pad_token_id=3, reference=ref, shared=shared)
    finally:
        for h in hooks:
            h.remove()
    assert scoring.forward_calls(shared) == 2 and calls == ["model", "ref", "model", "ref"]
    with pytest.raises(ValueError, match="do not share"):
        score_batch(
            model,
            rows[:1] + unit_rows([Unit(tuple(range(4, 80)), 1)]),
            device=torch.device("cpu"),
            pad_token_id=3,
            shared=shared,
        )


@pytest.mark.slow
@pytest.mark.skipif(
    shutil.which("g++") is None and shutil.which("c++") is None,
    reason="flex_attention on CPU compiles C++ kernels (torch inductor) and needs a C++ compiler",
)
def test_flex_attention_takes_tree_rows_and_shared_prefixes(tiny_model_dir):
    """attn_implementation=flex_attention: the tree mask as a BlockMask; every unit equals the float64 log-softmax of
    its own unshared logits, greedy flags equal sdpa's. The batch's common prefix is computed in each row
    (implementation_refuses_cache), so the plan never gives a flex batch a cached prefix."""
    from distperp_harness.planning.rows import plan_rows, shared_prefix

    models = {
        impl: AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation=impl).eval()
        for impl in ("sdpa", "flex_attention")
    }
    assert support.implementation_refuses(models["flex_attention"]) is None
    units = _few_shot_units(models["sdpa"], seed=4, questions=4)
    rows = plan_rows(units, "prefix", max_row_length=64).rows[:2]
    shared = shared_prefix(rows)
    assert shared >= 40 and all(r.packed for r in rows)
    assert (
        support.implementation_refuses_cache(models["flex_attention"])
        and support.implementation_refuses_cache(models["sdpa"]) is None
    )
    sharing, _, _, _ = choose_sharing(True, [models["flex_attention"]], Batching(batch_size=2), 128)
    assert sharing.mode == "prefix" and sharing.cached_prefix is CachedPrefix.NONE
    for prefix in (0,):
        out = {
            impl: score_batch(m, rows, device=torch.device("cpu"), pad_token_id=3, shared=prefix).stats
            for impl, m in models.items()
        }
        for row_stats, sdpa_stats, uid in zip(
            out["flex_attention"], out["sdpa"], [i for r in rows for i in r.unit_ids]
        ):
            ll, greedy, _, _, _ = _reference_scores(models["sdpa"], units[uid])
            assert _close(row_stats[LL], ll), (prefix, uid, row_stats[LL], ll)
            assert row_stats[GREEDY] == sdpa_stats[GREEDY] == float(greedy)


def test_flex_attention_needs_transformers_support():
    """flex_attention on a model type transformers has no flex kernel for: named, so rows fall back."""
    tiny = AutoModelForCausalLM.from_config(_tiny_config("gpt2"), attn_implementation="sdpa").eval()
    tiny.config._attn_implementation = "flex_attention"
    assert "no flex_attention for GPT2LMHeadModel" in support.implementation_refuses(tiny)


def test_flex_attention_tree_rows_are_refused_on_cuda():
    """On CUDA flex tree rows chose other answers than sdpa (an H200): refused there with the reason and the fix,
    so every answer gets its own row; the same model type on CPU keeps them."""
    from types import SimpleNamespace

    config = SimpleNamespace(model_type="llama", _attn_implementation="flex_attention")
    on = {
        kind: SimpleNamespace(config=config, device=torch.device(kind), _supports_flex_attn=True)
        for kind in ("cpu", "cuda")
    }
    assert support.implementation_refuses(on["cpu"]) is None
    why = support.implementation_refuses(on["cuda"])
    assert "flex_attention on CUDA" in why and "attn_implementation=sdpa" in why


def test_each_row_alone_gives_the_scores_of_a_batch_of_that_row_and_the_same_bits_in_any_batch(model):
    units = _units(3)
    cpu = torch.device("cpu")
    alone = [score_batch(model, [u], device=cpu, pad_token_id=3) for u in units]
    for batch in (units, units[::-1], units[1:3]):
        out = scoring.score_each_row(model, batch, device=cpu, pad_token_id=3)
        expected = np.concatenate([alone[units.index(u)].stats for u in batch])
        assert out.stats.tobytes() == expected.tobytes() and out.kl is None
    assert scoring.forward_calls(64, rows=5, row_at_a_time=True) == 5 and scoring.forward_calls(64, rows=5) == 2


def test_each_row_alone_names_the_row_with_non_finite_logits(model, monkeypatch):
    units = _units(4)[:3]
    real = scoring.score_batch

    def poisoned(m, batch, **kwargs):
        if batch[0].units == (units[1],) or list(batch[0].units) == [units[1]]:
            raise NonFiniteLogitsError([0])
        return real(m, batch, **kwargs)

    monkeypatch.setattr(scoring, "score_batch", poisoned)
    with pytest.raises(NonFiniteLogitsError) as info:
        scoring.score_each_row(model, units, device=torch.device("cpu"), pad_token_id=3)
    assert info.value.rows == [1]


@pytest.mark.parametrize("length", [3, 6, 9, 12])
def test_a_small_batch_has_the_same_bits_on_one_thread_and_on_two(model, length):
    """Matrix products get at least MIN_GEMM_ROWS rows: CPU BLAS sums a 5-11-row product in an order that depends
    on the thread count, which differs with the number of processes per machine."""
    unit = Unit(tuple(range(5, 5 + length)), length - 1)
    threads = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2):
            torch.set_num_threads(n)
            outs.append(score_batch(model, [unit], device=torch.device("cpu"), pad_token_id=3).stats.tobytes())
    finally:
        torch.set_num_threads(threads)
    assert outs[0] == outs[1]
