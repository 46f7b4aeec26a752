"""The stages :class:`~distperp_harness.lm.DistPerpLM` wires, each returning a typed record.

``place`` (process group, device, shard and TP groups, the ranks' agreement, the fit check, meshes) →
``load_models`` (:func:`~distperp_harness.model.loading.load_all`, the reference, per-rank load facts) →
``prepare`` (the batching rule, prefix sharing, compiling, the decode step, the resume store, the executor, the
traffic probe, lm-eval's document split, the chat template). The face keeps the records and answers lm-eval.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence, cast

import torch
from accelerate.logging import get_logger

from distperp_harness import __version__
from distperp_harness.distributed.agreement import agreed
from distperp_harness.distributed.collective import AccelerateCollective
from distperp_harness.distributed.failfast import set_device, stop_together
from distperp_harness.distributed.testfaults import fail_for_tests
from distperp_harness.docsplit import install_document_split
from distperp_harness.errors import InputError
from distperp_harness.model.chat import ChatTemplate
from distperp_harness.model.cp_attention import Group, check_attention, make_group, min_tokens
from distperp_harness.model.cp_attention import use as use_cp_attention
from distperp_harness.model.devices import (
    device_identity,
    find_disagreement,
    find_shared_gpus,
    local_world_size,
    physical_device,
    resolve_device,
)
from distperp_harness.model.lengths import fresh_rope_each_forward
from distperp_harness.model.loading import Loaded, check_prefix_token, load_all
from distperp_harness.model.memory import activation_bytes_per_token, kv_cache_bytes_per_token
from distperp_harness.model.quantize import weight_bytes
from distperp_harness.model.row_products import routed_products
from distperp_harness.model.sharding import check_groups_within_hosts, make_mesh, resolve_shard_size
from distperp_harness.model.tensor_parallel import make_tp_mesh, resolve_tp_size
from distperp_harness.options import GROUPS, BatchInvariant, Options, resolve_group_size
from distperp_harness.planning.rows import ShareMode
from distperp_harness.report.quantcost import ReferenceComparison, quantization_warnings
from distperp_harness.run.budget import agree_on_batching, generation_rows
from distperp_harness.run.compiling.regional import compile_extra_bytes, compile_models
from distperp_harness.run.execution.calls import RunStats
from distperp_harness.run.execution.executor import Executor, model_forwards
from distperp_harness.run.execution.probes import model_traffic
from distperp_harness.run.execution.resume import BatchStore
from distperp_harness.run.fit import check_fits
from distperp_harness.run.generation.engine.engines import decode_step
from distperp_harness.run.generation.setup import MIN_SHARED_TOKENS, NO_SHARING, GenerationSetup, WideLanes
from distperp_harness.run.rules import Sharing, lane_slots
from distperp_harness.run.runtime import (
    choose_sharing,
    decide_invariance,
    decide_paths,
    invariance_blocked,
    invariance_modes,
    probe_target,
)
from distperp_harness.run.scoring.engine.invariance import Invariance
from distperp_harness.run.scoring.routes import WideRows

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from distperp_harness.run.generation.engine.batchgen import CausalLM

log = get_logger(__name__)


@dataclass(frozen=True)
class InProcess:
    """What only in-process callers pass (``DistPerpLM.in_process``), never ``--model_args``: ``reference_model``,
    an already loaded model that ``reference=`` names, reused instead of loaded again (with ``shard_size`` > 1 it
    is loaded again: a sharded model belongs to its run's mesh); ``mesh_of_one``, for checks
    (``benchmarks/shard_check.py --processes 1``): at ``shard_size=1`` still build the device mesh and apply FSDP2
    (each rank a shard group of one), so one device runs the sharded load and forward paths, with the unsharded
    run's bits."""

    reference_model: torch.nn.Module | None = None
    mesh_of_one: bool = False


@dataclass
class Placement:
    """Where the run computes: the process group, this rank's device and its identity, the shard and
    tensor-parallel group sizes, the fit check's estimate (None for an in-memory model) and the meshes."""

    collective: AccelerateCollective
    device: torch.device
    device_identity: dict
    shard_size: int
    tp_size: int
    estimate: Any
    mesh: Any
    tp_mesh: Any
    cp: Group = field(default_factory=lambda: Group(1, 0))


def run_identity(options: Options, identity: dict) -> dict:
    """What every rank must share for results to be one computation: options, versions, device identity."""
    import lm_eval
    import transformers

    return {
        "options": {
            k: v
            for k, v in options.to_dict().items()
            if k not in ("batch_size", "max_batch_size", "timeout", "resume_dir", "device")
        },
        "versions": [__version__, torch.__version__, transformers.__version__, lm_eval.__version__],
        "device": identity,
    }


def place(options: Options, given: Any, extra: InProcess) -> Placement:
    """The process group and this rank's device; every rank checked to run the same configuration (before
    loading: a mismatch fails in seconds, not after minutes of loading), the fit estimated, the meshes built."""
    if extra.reference_model is not None and options.reference is None:
        raise InputError(
            "reference_model was given without reference=; it would be ignored. Fix: pass "
            "reference=base (or the reference's path) with it."
        )
    wants_cpu = (options.device or "").strip().lower() == "cpu" or not torch.cuda.is_available()
    collective = AccelerateCollective(options.timeout, cpu=wants_cpu)
    world = collective.world_size
    device = resolve_device(options, collective.local_rank, world)
    set_device(device)  # a failure anywhere in this process is recorded as this rank's, on this device
    identity = device_identity(device)
    shard_size = resolve_shard_size(options.shard_size, world, local_world_size(world))
    tp_size = resolve_tp_size(options.tensor_parallel, world, local_world_size(world))
    cp_size = resolve_group_size("cp_size", options.cp_size, world, local_world_size(world), GROUPS["cp_size"])
    everyone = collective.all_gather_object(
        (run_identity(options, identity), physical_device(device)), "compare configurations"
    )
    problem = find_disagreement([mine for mine, _ in everyone]) or find_shared_gpus([w for _, w in everyone])
    if problem:
        raise InputError(problem, same_on_every_rank=True)
    hosts = [where["host"] for _, where in everyone]
    check_groups_within_hosts(hosts, shard_size)
    check_groups_within_hosts(hosts, tp_size, "tp_size")
    check_groups_within_hosts(hosts, cp_size, "cp_size")
    estimate = (
        None
        if given is not None  # an in-memory model is loaded already
        else check_fits(collective, options, device, shard_size, local_world_size(world), tp_size=tp_size)
    )
    mesh = make_mesh(device, world, shard_size, options.timeout) if shard_size > 1 or extra.mesh_of_one else None
    tp_mesh = make_tp_mesh(device, world, tp_size, options.timeout) if tp_size > 1 else None
    cp = make_group(device, world, collective.rank, cp_size, options.timeout)
    return Placement(collective, device, identity, shard_size, tp_size, estimate, mesh, tp_mesh, cp)


@dataclass
class Models:
    """The load stage's result: :class:`~distperp_harness.model.loading.Loaded`, the model and the reference as
    transformers models, the reference's bytes, each rank's load facts and the reference comparison."""

    loaded: Loaded
    model: PreTrainedModel
    reference: PreTrainedModel | None
    reference_weight_bytes: int | None
    per_rank: list[dict]
    comparison: ReferenceComparison | None


def load_models(options: Options, placement: Placement, given: Any, extra: InProcess) -> Models:
    """The model (and reference) on this rank's device; a reused ``reference_model`` unless the run is sharded."""
    reference_model = extra.reference_model
    if reference_model is not None and (placement.mesh is not None or placement.tp_mesh is not None):
        reference_model = None  # a sharded reference lives on its own run's mesh: load it again
    to_load = options if reference_model is None else dataclasses.replace(options, reference=None)
    with agreed(placement.collective, "loading the model"):  # one rank's failed load fails every rank alike
        fail_for_tests(placement.collective.rank, "load")
        loaded = load_all(to_load, placement.device, placement.mesh, given=given, tp_mesh=placement.tp_mesh)
    reference = cast("PreTrainedModel | None", loaded.reference)
    reference_bytes = loaded.reference_weight_bytes
    if reference_model is not None:
        reference, reference_bytes = cast("PreTrainedModel", reference_model), weight_bytes(reference_model)
    model = cast("PreTrainedModel", loaded.model)  # what every loader returns: a transformers model
    per_rank = placement.collective.all_gather_object(
        {
            "load_memory": loaded.load_memory,
            "model_bytes": weight_bytes(model),
            "reference_bytes": weight_bytes(reference) if reference is not None else None,
        },
        "gather load memory and resident weight bytes",
    )
    comparison = ReferenceComparison() if reference is not None else None
    return Models(loaded, model, reference, reference_bytes, per_rank, comparison)


@dataclass
class PreparedRun:
    """What a call runs with: the batching rule, prefix sharing (and why not, the row budget, the line to say at the
    first loglikelihood call), compiled models, the decode step (and its line), quantization warnings, the call
    records, the resume store, the executor, the measured traffic, lm-eval's document split, the chat template and
    the scoring paths the probe decided (``model``, ``reference``: :meth:`ModelPaths.to_dict`), the rolling
    windows' sharing (one unit per row, under the models' length rule) and how ``batch_invariant`` holds rows
    (:class:`~distperp_harness.run.scoring.engine.invariance.Invariance`, and why each row goes alone where it does)."""

    batching: Any
    sharing: Any
    sharing_fallback: str | None
    row_budget_reason: str | None
    sharing_line: str | None
    compiled: Any
    static_decoding: Any
    decode_step_line: str
    warnings: list[str]
    stats: RunStats
    store: BatchStore | None
    executor: Executor
    wide: WideRows | None
    traffic: Any
    document_split: Any
    chat: ChatTemplate
    paths: dict[str, dict]
    rolling: Sharing
    invariance: Invariance = Invariance.OFF
    invariance_why: str | None = None


@dataclass(frozen=True)
class Tokens:
    """What the prepare stage needs of the tokenizer: the pad and prefix token ids, and a decoder for messages."""

    pad_token_id: int
    prefix_token_id: int
    describe: Callable[[Sequence[int]], str]


def prepare(
    options: Options, placement: Placement, models: Models, tokens: Tokens, scoring_config: Callable[[Any], dict]
) -> PreparedRun:
    """Everything after loading, agreed on by every rank where it must be (``scoring_config``: the resume key,
    given the compiled state)."""
    pad_token_id = tokens.pad_token_id
    loaded, model, reference = models.loaded, models.model, models.reference
    collective, device = placement.collective, placement.device
    both = [m for m in (model, reference) if m is not None]
    local = local_world_size(collective.world_size)
    for each in both:
        fresh_rope_each_forward(each)  # dynamic RoPE: each forward from the configured frequencies
    batching = agree_on_batching(
        collective,
        options,
        model,
        device,
        loaded.max_length,
        reference=reference,
        pad_token_id=pad_token_id,
        unsharded_bytes=loaded.weight_bytes
        + (models.reference_weight_bytes or 0)
        + (loaded.int4_products.transient_bytes if loaded.int4_products else 0)
        + compile_extra_bytes(options.compile_mode, [model, reference], device, placement.shard_size),
    )
    blocked = invariance_blocked(options.batch_invariant, options.compile, options.cp_size, device.type, both)
    modes = invariance_modes(options.batch_invariant, blocked)
    target = probe_target(list(both), batching, loaded.max_length, options.share_prefix, modes)
    with stop_together(collective, device, "probing what the model's forwards allow"):
        decided = decide_paths(collective, list(both), device, pad_token_id, target)
    for name, paths in zip(("model", "reference"), decided):
        log.info(f"{name}: {paths.line()}", main_process_only=True)
    # fail now, not mid-run, if there is no (valid) token to condition on
    check_prefix_token(tokens.prefix_token_id, list(both), given=options.prefix_token_id is not None)
    warnings = quantization_warnings(loaded.quant_report, options.reference, model, reference)
    for line in warnings:
        log.warning(line, main_process_only=True)
    with stop_together(collective, device, "checking that rows attend alone (batch_invariant)"):
        invariance, alone_why = decide_invariance(
            collective, list(both), device, pad_token_id, loaded.max_length, options.batch_invariant, blocked
        )
    if options.batch_invariant is not BatchInvariant.OFF:
        why = "" if alone_why is None else f" ({alone_why})"
        log.info(f"batch_invariant={options.batch_invariant}: {invariance.value}{why}", main_process_only=True)
    sharing, fallback, budget_reason, sharing_line = choose_sharing(
        options.share_prefix, list(both), batching, loaded.max_length, invariance
    )
    if placement.cp.size > 1:  # plain sdpa outside a group's forward: short rows and generation as with cp_size=1
        for which, source in ((model, options.pretrained), (reference, f"reference={options.reference}")):
            if which is not None:
                check_attention(which, placement.cp.size, source)
                use_cp_attention(which)
    compiled = compile_models(  # after loading, quantization and the batching rule (its warm-up shapes)
        options.compile_mode,
        [model, reference],
        collective=collective,
        rows_for=batching.rows_for,
        max_length=loaded.max_length,
        packed=sharing.mode == ShareMode.PREFIX,
        pad_token_id=pad_token_id,
        device=device,
        shard_size=placement.shard_size,
    )
    static, step_line = decode_step(  # generation's decode step
        model,
        device,
        pad_token_id,
        compiled=compiled,
        batch_invariant=invariance is not Invariance.OFF,
        grouped=placement.shard_size > 1 or placement.tp_size > 1,
        cuda_graphs=options.cuda_graphs,
    )
    store = (
        None
        if not options.resume_dir
        else BatchStore(
            options.resume_dir,
            scoring_config(compiled),
            with_kl=reference is not None,
            is_main=collective.is_main,
            exit_on_sigterm=True,
        )
    )

    def executor(cp: Group | None) -> Executor:
        group = max(placement.tp_size, cp.size if cp is not None else 1)  # ranks that compute each forward together
        forwards = model_forwards(
            model,
            reference,
            device,
            pad_token_id,
            tokens.describe,
            placement.shard_size,
            collective,
            placement.tp_size,
            invariance=invariance,
            cp=cp,
        )
        return Executor(
            collective,
            forwards,
            device=device,
            store=store,
            claiming=options.claim,
            local_world_size=local,
            shard_size=placement.shard_size,
            tp_size=group,
        )

    wide = (
        WideRows(executor(placement.cp), min_tokens(options.cp_min_tokens, placement.cp.size))
        if placement.cp.size > 1
        else None
    )
    with stop_together(collective, device, "probing the forwards' collective traffic"):
        traffic = model_traffic(
            model,
            device,
            pad_token_id,
            sharded=placement.shard_size > 1,
            tensor_parallel=placement.tp_size > 1,
            cp=placement.cp,
        )
    chat = ChatTemplate(
        options.chat_kwargs, options.think_end_token, functools.partial(log.warning, main_process_only=True)
    )
    return PreparedRun(
        batching,
        sharing,
        fallback,
        budget_reason,
        sharing_line,
        compiled,
        static,
        step_line,
        warnings,
        RunStats(tp_size=placement.tp_size, cp_size=placement.cp.size),
        store,
        executor(None),
        wide,
        traffic,
        install_document_split(collective.world_size),  # lm-eval's split as one process's
        chat,
        {name: paths.to_dict() for name, paths in zip(("model", "reference"), decided)},
        Sharing(ShareMode.OFF, lengths=sharing.lengths),
        invariance,
        alone_why,
    )


def scoring_config(options: Options, placement: Placement, model: torch.nn.Module, compiled: Any, checkpoint: dict):
    """Everything besides the units that determines scores (the resume key); not ``shard_size`` or ``claim``,
    which change where the weights live and which rank computes a batch, not the bits. The resolved ``tp_size`` is
    in it (tensor parallelism sums in another order), however it was spelled."""
    identity = run_identity(options, placement.device_identity)
    identity["options"] = {k: v for k, v in identity["options"].items() if k not in ("shard_size", "claim", "tp_plan")}
    identity["options"]["tp_size"] = placement.tp_size
    return {
        **identity,
        "dtype": str(next(model.parameters()).dtype),
        "compiled": compiled.active_mode,
        "checkpoint": checkpoint,
    }


def generation_setup(
    options: Options,
    placement: Placement,
    models: Models,
    prepared: PreparedRun,
    tokenizer: Any,
    max_gen_toks: int,
    progress: Any,
) -> GenerationSetup:
    """What ``generate_until`` runs with (:class:`~distperp_harness.run.generation.setup.GenerationSetup`). Under
    ``batch_invariant`` (its check passed) sequences share a lane's slots with every row attending alone, each
    continuing its prefix group's shared block whatever the lane; where ``batch_invariant=true``'s check failed each
    decodes alone (one slot); a model whose length rule keeps lengths apart (a longrope model's forward takes the
    factor of the longest sequence in it; rows past the probe's longest) keeps slots only in lanes whose rows stay
    within one key of the rule."""
    model, max_length = models.model, models.loaded.max_length
    lengths = prepared.sharing.lengths
    batched = prepared.invariance is Invariance.BATCHED  # rows attend alone: a sequence's bits whatever its batch
    # a sequence decodes alone (one slot) where rows cannot share a step whatever its batch-mates: the check failed
    # under batch_invariant=true, or products whose rows follow the batch
    alone = prepared.invariance.row_at_a_time or (batched and routed_products(model) is not None)
    rows_for, may_share = lane_slots(
        functools.partial(
            generation_rows,
            prepared.batching,
            activation_bytes=activation_bytes_per_token(model, max_length),
            kv_bytes=kv_cache_bytes_per_token(model),
        ),
        lengths,
        alone,
    )
    wide = prepared.wide
    wide_lanes = None if wide is None else WideLanes(wide.executor, wide.min_tokens, placement.cp)
    return GenerationSetup(
        model=cast("CausalLM", model),  # transformers' *ForCausalLM classes generate
        tokenizer=tokenizer,
        executor=prepared.executor,
        device=placement.device,
        max_length=max_length,
        max_gen_toks=max_gen_toks,
        add_bos_token=options.add_bos_token,
        rows_for=rows_for,
        seed=torch.initial_seed(),  # lm-eval's --seed (its torch value) seeds sampled requests
        min_shared_tokens=MIN_SHARED_TOKENS if options.share_prefix and may_share else NO_SHARING,
        progress=progress,
        think_end=options.think_end_token,
        static=prepared.static_decoding,
        rows_alone=batched,
        wide=wide_lanes,
    )
