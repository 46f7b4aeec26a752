"""``DistPerpLM``: the lm-eval face of distperp. It wires stages and holds no math.

options → load (device, tokenizer, model) → quantize → per call: requests → units → global plan → score →
gather → results. Each stage lives in its own module; this class only connects them to lm-eval's contract
(``loglikelihood``, ``loglikelihood_rolling``, ``generate_until`` and the attributes the evaluator reads).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from typing import TYPE_CHECKING, Any, cast

import torch
from accelerate.logging import get_logger
from lm_eval.api.model import TemplateLM

from distperp_harness import __version__
from distperp_harness.distributed.collective import AccelerateCollective
from distperp_harness.distributed.failfast import set_device, stop_together
from distperp_harness.distributed.liveness import set_base_stage
from distperp_harness.distributed.testfaults import fail_for_tests
from distperp_harness.docsplit import fill_empty_ranks, install_document_split
from distperp_harness.errors import InputError
from distperp_harness.model.chat import ChatTemplate
from distperp_harness.model.devices import (
    device_identity,
    find_disagreement,
    find_shared_gpus,
    local_world_size,
    physical_device,
    resolve_device,
)
from distperp_harness.model.given import check_given, split_given
from distperp_harness.model.identity import checkpoint_identity
from distperp_harness.model.loading import check_prefix_token, load_all
from distperp_harness.model.memory import activation_bytes_per_token, kv_cache_bytes_per_token
from distperp_harness.model.quantize import weight_bytes
from distperp_harness.model.sharding import check_groups_within_hosts, make_mesh, resolve_shard_size
from distperp_harness.model.tensor_parallel import make_tp_mesh, resolve_tp_size
from distperp_harness.options import Options
from distperp_harness.planning.requests import continuation_unit, window_units
from distperp_harness.planning.rows import ShareMode
from distperp_harness.report.quantcost import ReferenceComparison, evaluator_tasks, quantization_warnings
from distperp_harness.report.results import Score
from distperp_harness.run.budget import agree_on_batching, generation_rows
from distperp_harness.run.compiling.regional import compile_extra_bytes, compile_models
from distperp_harness.run.execution.calls import RunStats, ScoringCall
from distperp_harness.run.execution.executor import Executor, model_forwards
from distperp_harness.run.execution.probes import model_traffic
from distperp_harness.run.execution.progress import generation_progress, setup_logging, token_progress
from distperp_harness.run.execution.record import run_record
from distperp_harness.run.execution.resume import BatchStore
from distperp_harness.run.fit import check_fits
from distperp_harness.run.generation.engines import decode_step
from distperp_harness.run.generation.generate import generate
from distperp_harness.run.generation.setup import MIN_SHARED_TOKENS, NO_SHARING, GenerationSetup
from distperp_harness.run.pipeline import score_requests
from distperp_harness.run.rules import Batching, ScoringRule, Sharing, one_slot
from distperp_harness.run.runtime import attention_coefficient, choose_sharing, head_coefficient
from distperp_harness.tokens import Tokenization, loglikelihood_strings

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from distperp_harness.run.generation.batchgen import CausalLM

log = get_logger(__name__)

ROW_PER_UNIT = Sharing(ShareMode.OFF)
"""Rolling windows' sharing: one unit per row (windows never share a prefix)."""

# torchao's wheel prints load failures for its CUDA-only kernels on CPU machines; they are not needed there.
if not torch.cuda.is_available():
    os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")


class DistPerpLM(Tokenization, TemplateLM):
    """lm-eval model ``distperp``: exact, world-size-independent log-likelihoods for Hugging Face causal LMs.

    Results of ``loglikelihood`` / ``loglikelihood_rolling`` are float64 sums (returned as
    :class:`~distperp_harness.report.results.Score`, a float carrying token counts) and are bit-identical for any
    number of processes and nodes.
    """

    backend = "causal"

    def __init__(
        self, reference_model: torch.nn.Module | None = None, *, mesh_of_one: bool = False, **kwargs: Any
    ) -> None:
        """``kwargs``: the ``--model_args`` keys (:class:`Options`). ``reference_model``: for in-process callers
        (``sweep``) only, an already loaded model that ``reference=`` names, reused instead of loaded again (with
        ``shard_size`` > 1 it is loaded again: a sharded model belongs to its run's mesh). ``mesh_of_one``: for
        checks only (``benchmarks/shard_check.py --processes 1``), not a ``--model_args`` key: at ``shard_size=1``
        still build the device mesh and apply FSDP2 (each rank a shard group of one), so that one device runs the
        sharded load and forward code paths; the bits equal those of the unsharded run."""
        super().__init__()
        t0 = time.perf_counter()
        kwargs, given = split_given(kwargs)  # simple_evaluate may pass a model (and tokenizer) object
        self.options = Options.from_kwargs(**kwargs)
        if given is not None:
            check_given(self.options, given)
        if reference_model is not None and self.options.reference is None:
            raise InputError(
                "reference_model was given without reference=; it would be ignored. Fix: pass "
                "reference=base (or the reference's path) with it."
            )
        wants_cpu = (self.options.device or "").strip().lower() == "cpu" or not torch.cuda.is_available()
        self.collective = AccelerateCollective(self.options.timeout, cpu=wants_cpu)
        self._rank, self._world_size = self.collective.rank, self.collective.world_size
        self._device = resolve_device(self.options, self.collective.local_rank, self._world_size)
        set_device(self._device)  # a failure anywhere in this process is recorded as this rank's, on this device
        self.device_identity = device_identity(self._device)
        self.shard_size = resolve_shard_size(
            self.options.shard_size, self._world_size, local_world_size(self._world_size)
        )
        self.tp_size = resolve_tp_size(
            self.options.tensor_parallel, self._world_size, local_world_size(self._world_size)
        )
        self._check_ranks_agree()  # before loading: a mismatch fails in seconds, not after minutes of loading
        self.estimate = (
            None
            if given is not None
            else check_fits(  # an in-memory model is loaded already
                self.collective,
                self.options,
                self._device,
                self.shard_size,
                local_world_size(self._world_size),
                tp_size=self.tp_size,
            )
        )
        mesh = (
            make_mesh(self._device, self._world_size, self.shard_size, self.options.timeout)
            if self.shard_size > 1 or mesh_of_one
            else None
        )
        tp_mesh = (
            make_tp_mesh(self._device, self._world_size, self.tp_size, self.options.timeout)
            if self.tp_size > 1
            else None
        )
        if reference_model is not None and (mesh is not None or tp_mesh is not None):
            reference_model = None  # a sharded reference lives on its own run's mesh: load it again
        to_load = self.options if reference_model is None else dataclasses.replace(self.options, reference=None)
        loaded = load_all(to_load, self._device, mesh, given=given, tp_mesh=tp_mesh)
        self.tokenizer = loaded.tokenizer
        self._model = cast("PreTrainedModel", loaded.model)  # what every loader returns: a transformers model
        self.reference = cast("PreTrainedModel | None", loaded.reference)
        self.quant_report, self.weight_bytes = loaded.quant_report, loaded.weight_bytes
        self.reference_weight_bytes = loaded.reference_weight_bytes
        if reference_model is not None:
            self.reference = cast("PreTrainedModel", reference_model)
            self.reference_weight_bytes = weight_bytes(reference_model)
        self.comparison = ReferenceComparison() if self.reference is not None else None
        self.loaded = loaded
        self.per_rank = self.collective.all_gather_object(
            {
                "load_memory": loaded.load_memory,
                "model_bytes": weight_bytes(self._model),
                "reference_bytes": weight_bytes(self.reference) if self.reference is not None else None,
            },
            "gather load memory and resident weight bytes",
        )
        self._max_length = loaded.max_length
        self.batching: Batching = agree_on_batching(
            self.collective,
            self.options,
            self._model,
            self._device,
            self._max_length,
            reference=self.reference,
            pad_token_id=self.tokenizer.pad_token_id,
            unsharded_bytes=loaded.weight_bytes
            + (self.reference_weight_bytes or 0)
            + (loaded.int4_products.transient_bytes if loaded.int4_products else 0)
            + compile_extra_bytes(
                self.options.compile_mode, [self._model, self.reference], self._device, self.shard_size
            ),
        )
        # fail now, not mid-run, if there is no (valid) token to condition on
        check_prefix_token(
            self.prefix_token_id,
            [m for m in (self._model, self.reference) if m is not None],
            given=self.options.prefix_token_id is not None,
        )
        self.warnings = quantization_warnings(self.quant_report, self.options.reference, self._model, self.reference)
        for line in self.warnings:
            log.warning(line, main_process_only=True)
        self.stats = RunStats(tp_size=self.tp_size)
        self.sharing, self.sharing_fallback, self.row_budget_reason, self._sharing_line = choose_sharing(
            self.options.share_prefix,
            [m for m in (self._model, self.reference) if m is not None],
            self.batching,
            self._max_length,
            batch_invariant=self.options.batch_invariant,
        )
        self.compiled = compile_models(  # after loading, quantization and the batching rule (its warm-up shapes)
            self.options.compile_mode,
            [self._model, self.reference],
            collective=self.collective,
            rows_for=self.batching.rows_for,
            max_length=self._max_length,
            packed=self.sharing.mode == ShareMode.PREFIX,
            pad_token_id=self.tokenizer.pad_token_id,
            device=self._device,
            shard_size=self.shard_size,
        )
        self.static_decoding, self.decode_step_line = decode_step(  # generation's decode step
            self._model,
            self._device,
            self.tokenizer.pad_token_id,
            compiled=self.compiled,
            batch_invariant=self.options.batch_invariant,
            grouped=self.shard_size > 1 or self.tp_size > 1,
            cuda_graphs=self.options.cuda_graphs,
        )
        self._identity: dict | None = None
        self.store = (
            None
            if not self.options.resume_dir
            else BatchStore(
                self.options.resume_dir,
                self._scoring_config(),
                with_kl=self.reference is not None,
                is_main=self.collective.is_main,
                exit_on_sigterm=True,
            )
        )
        self.executor = Executor(
            self.collective,
            model_forwards(
                self._model,
                self.reference,
                self._device,
                self.tokenizer.pad_token_id,
                self.tok_decode,
                self.shard_size,
                self.collective,
                self.tp_size,
                row_at_a_time=self.options.batch_invariant,
            ),
            device=self._device,
            store=self.store,
            claiming=self.options.claim,
            local_world_size=local_world_size(self._world_size),
            shard_size=self.shard_size,
            tp_size=self.tp_size,
        )
        with stop_together(self.collective, self._device, "probing the forwards' collective traffic"):
            self.traffic = model_traffic(
                self._model,
                self._device,
                self.tokenizer.pad_token_id,
                sharded=self.shard_size > 1,
                tensor_parallel=self.tp_size > 1,
            )
        self.document_split = install_document_split(self._world_size)  # lm-eval's split as one process's
        self.chat = ChatTemplate(
            self.options.chat_kwargs,
            self.options.think_end_token,
            functools.partial(log.warning, main_process_only=True),
        )
        self.load_seconds = time.perf_counter() - t0
        set_base_stage("running lm-eval's code (between distperp's calls)")  # what a lost peer's survivors print

    def _run_identity(self) -> dict:
        """What every rank must share for results to be one computation: options, versions, device identity."""
        import lm_eval
        import transformers

        return {
            "options": {
                k: v
                for k, v in self.options.to_dict().items()
                if k not in ("batch_size", "max_batch_size", "timeout", "resume_dir", "device")
            },
            "versions": [__version__, torch.__version__, transformers.__version__, lm_eval.__version__],
            "device": self.device_identity,
        }

    def _scoring_config(self) -> dict:
        """Everything besides the units that determines scores (the resume key); not ``shard_size`` or ``claim``,
        which change where the weights live and which rank computes a batch, not the bits. The resolved
        ``tp_size`` is in it (tensor parallelism sums in another order), however it was spelled."""
        identity = self._run_identity()
        identity["options"] = {
            k: v for k, v in identity["options"].items() if k not in ("shard_size", "claim", "tp_plan")
        }
        identity["options"]["tp_size"] = self.tp_size
        return {
            **identity,
            "dtype": str(next(self._model.parameters()).dtype),
            "compiled": self.compiled.active_mode,
            "checkpoint": self.checkpoint_identity,
        }

    @property
    def checkpoint_identity(self) -> dict:
        """``model_sha`` (and ``peft_sha``, ``delta_sha``, ``gguf_*``) of the weights (model/identity.py), computed
        once: content hashes of local files read them whole."""
        if self._identity is None:
            self._identity = checkpoint_identity(self.options)
        return self._identity

    def _check_ranks_agree(self) -> None:
        """Every rank runs the same options, versions and kind of device, each on its own GPU; else ValueError."""
        everyone = self.collective.all_gather_object(
            (self._run_identity(), physical_device(self._device)), "compare configurations"
        )
        problem = find_disagreement([mine for mine, _ in everyone]) or find_shared_gpus([w for _, w in everyone])
        if problem:
            raise InputError(problem, same_on_every_rank=True)
        hosts = [where["host"] for _, where in everyone]
        check_groups_within_hosts(hosts, self.shard_size)
        check_groups_within_hosts(hosts, self.tp_size, "tp_size")

    # ------------------------------------------------------------------------- lm-eval request methods
    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[Score, bool]]:
        """TemplateLM's tokenization and :meth:`_loglikelihood_tokens`, then the per-task reference comparison
        (which needs the ``Instance``s that ``_loglikelihood_tokens`` no longer sees). Within the call, a context
        shared by several answers is tokenized once (TemplateLM encodes it again for every answer)."""
        self._encoded = {}
        if self._sharing_line:  # said where it applies: loglikelihood requests (a rolling task never shares rows)
            log.info(self._sharing_line, main_process_only=True)
            self._sharing_line = None
        try:
            with stop_together(self.collective, self._device, "tokenizing or comparing loglikelihood requests"):
                self.pre_encode(loglikelihood_strings(req.args for req in requests))
                answers = super().loglikelihood(requests, disable_tqdm=disable_tqdm)
                self._compare(requests, [score for score, _ in answers])
        finally:
            self._encoded = None
        return answers

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[Score, bool]]:
        """``requests``: ``((context, continuation), context_tokens, continuation_tokens)`` from TemplateLM.

        Returns ``(log-likelihood, is_greedy)`` per request, in order.
        """
        # An empty continuation (possible after tokenization) has probability 1: log-likelihood 0, greedy. A
        # context that tokenizes to nothing (e.g. only spaces, moved to the continuation) is the prefix token.
        units = [
            [continuation_unit(ctx or [self.prefix_token_id], cont, self.max_length)] if cont else []
            for _, ctx, cont in requests
        ]
        results = self._score(units, "loglikelihood", disable_tqdm, self.sharing)
        out = []
        for (request_str, _, _), r in zip(requests, results):
            answer = (self._as_score(r), r.is_greedy)
            if request_str is not None:
                self.cache_hook.add_partial("loglikelihood", request_str, answer)
            out.append(answer)
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[Score]:
        """Log-likelihood of each whole text (``Instance.args == (text,)``), conditioned on the prefix token."""
        with stop_together(self.collective, self._device, "tokenizing or comparing loglikelihood_rolling requests"):
            self._encoded = {}  # each text encoded once, in batches
            try:
                self.pre_encode((text, None) for (text,) in (req.args for req in requests))
                units = [
                    window_units(self.tok_encode(text), self.prefix_token_id, self.max_length, self.options.stride)
                    for (text,) in (req.args for req in requests)
                ]
            finally:
                self._encoded = None
            results = self._score(units, "loglikelihood_rolling", disable_tqdm)
            out = []
            for req, r in zip(requests, results):
                score = self._as_score(r)
                self.cache_hook.add_partial("loglikelihood_rolling", req.args, score)
                out.append(score)
            self._compare(requests, out)
        return out

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy or sampled continuations (``Instance.args == (context, gen_kwargs)``), cut at ``until``."""
        with stop_together(self.collective, self._device, "generating"):  # an error stops every rank at once
            fail_for_tests(self.rank, "generation")
            outputs = self._generate(requests, disable_tqdm)
            if self.comparison is not None:
                self._compare_generations(requests, outputs)
        for req, text in zip(requests, outputs):
            self.cache_hook.add_partial("generate_until", req.args, text)
        return outputs

    def _generate(self, requests, disable_tqdm: bool) -> list[str]:
        if self.decode_step_line:  # said where it applies: the first generate_until call
            log.info(f"generate_until decodes with {self.decode_step_line}", main_process_only=True)
            self.decode_step_line = ""
        setup = GenerationSetup(
            model=cast("CausalLM", self._model),  # transformers' *ForCausalLM classes generate
            tokenizer=self.tokenizer,
            executor=self.executor,
            device=self._device,
            max_length=self.max_length,
            max_gen_toks=self.max_gen_toks,
            add_bos_token=self.options.add_bos_token,
            rows_for=one_slot
            if self.options.batch_invariant
            else functools.partial(
                generation_rows,
                self.batching,
                activation_bytes=activation_bytes_per_token(self._model, self.max_length),
                kv_bytes=kv_cache_bytes_per_token(self._model),
            ),
            seed=torch.initial_seed(),  # lm-eval's --seed (its torch value) seeds sampled requests
            min_shared_tokens=MIN_SHARED_TOKENS
            if self.options.share_prefix and not self.options.batch_invariant
            else NO_SHARING,
            progress=None if disable_tqdm else generation_progress("distperp generate_until", self.collective.is_main),
            think_end=self.options.think_end_token,
            static=self.static_decoding,
        )
        return generate(
            setup,
            [req.args for req in requests],
            calls=self.stats.calls,
            identities=[(req.task_name, req.doc_id, req.idx) for req in requests],
        )

    def _compare_generations(self, requests, texts: list[str]) -> None:
        """What the quantized model's own outputs cost: its answers scored as continuations of their prompts by
        both models (one teacher-forced pass, the scoring path), recorded per task like log-likelihood tasks'
        (per-token KL and top-1 agreement of the reference along what the model said). Every rank calls this."""
        pairs = [self._encode_pair(req.args[0], text) if text else ([], []) for req, text in zip(requests, texts)]
        units = [
            [continuation_unit(ctx or [self.prefix_token_id], cont, self.max_length)] if cont else []
            for ctx, cont in pairs
        ]
        scores = [self._as_score(r) for r in self._score(units, "generate_until_reference", True, self.sharing)]
        kept = [(req, score) for req, score in zip(requests, scores) if score.n_tokens]
        self._compare([req for req, _ in kept], [score for _, score in kept])

    def _score(self, per_request_units, kind: str, disable_tqdm: bool, sharing: Sharing = ROW_PER_UNIT):
        """:meth:`_score_planned` inside the failure channel: an error while exchanging, planning, routing or
        returning results stops every rank at once, naming this one (a forward's error is named as scoring)."""
        with stop_together(self.collective, self._device, f"planning, exchanging or gathering {kind}"):
            fail_for_tests(self.rank, "planning")
            return self._score_planned(per_request_units, kind, disable_tqdm, sharing)

    def _score_planned(self, per_request_units, kind: str, disable_tqdm: bool, sharing: Sharing):
        rule = ScoringRule(
            self.batching,
            sharing,
            attention_coefficient(self._model),
            head_coefficient(self._model),
            with_reference=self.reference is not None,
        )
        results = score_requests(
            per_request_units,
            self.executor,
            rule,
            kind=kind,
            stats=self.stats,
            log=functools.partial(log.warning, main_process_only=True),
            prepare=functools.partial(self.compiled.prepare, self.collective),
            progress=None if disable_tqdm else token_progress(f"distperp {kind}", self.collective.is_main),
        )
        call = self.stats.calls[-1]
        if not isinstance(call, ScoringCall):  # the call just made is a scoring call
            return results
        log.info(
            f"{kind}: {call.scored_tokens} tokens in {call.units} units, {call.rows} rows "
            f"({call.tokens_saved} input tokens saved), {call.batches} batches on "
            f"{self.world_size} process(es) in {call.total_seconds:.1f} s "
            f"({call.scored_tokens / max(call.total_seconds, 1e-9):.0f} tok/s); load max/mean "
            f"{call.max_over_mean:.3f}; fingerprint {self.stats.fingerprint}",
            main_process_only=True,
        )
        return results

    def _compare(self, requests, scores: list[Score]) -> None:
        """With a reference: gather this call's per-request comparisons (every rank) and log one line per task."""
        if self.comparison is not None:
            for line in self.comparison.add(requests, scores, self.collective, evaluator_tasks()):
                log.info(line, main_process_only=True)

    @staticmethod
    def _as_score(r) -> Score:
        return Score(r.loglikelihood, r.n_tokens, r.ref_loglikelihood, r.kl, r.top1_agree)

    # ------------------------------------------------------------------ what the evaluator and loggers read
    @property
    def model(self) -> torch.nn.Module:
        return self._model

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return 256

    @property
    def batch_size(self) -> int | str:
        return self.options.batch_size

    @property
    def batch_sizes(self) -> dict[int, int]:
        """lm-eval's record of the batch size: the fixed one, or under ``auto`` the most rows a batch held so far."""
        if self.batching.batch_size:
            return {0: self.batching.batch_size}
        rows = [getattr(c, "max_batch_rows", 0) for c in self.stats.calls]
        return {0: max(rows)} if any(rows) else {}

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.name_or_path.replace("/", "__")

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's ``tensor`` concatenated along dim 0 (a 0-d tensor counts as one element)."""
        with stop_together(self.collective, self._device, "taking part in lm-eval's all_gather"):
            parts = self.collective.all_gather_tensor(
                tensor.reshape(1) if tensor.dim() == 0 else tensor, "lm-eval all_gather"
            )
            return torch.cat(parts).to(tensor.device)

    def gather_object(self, obj, dst: int = 0):
        with stop_together(self.collective, self._device, "taking part in lm-eval's gather_object"):
            gathered = self.collective.gather_object(obj, dst, "lm-eval gather_object")
            return fill_empty_ranks(gathered, self.document_split) if gathered is not None else None

    def barrier(self) -> None:
        with stop_together(self.collective, self._device, "taking part in lm-eval's barrier"):
            self.collective.barrier("lm-eval barrier")

    def set_cache_hook(self, cache_hook) -> None:
        if self.world_size > 1 and getattr(cache_hook, "dbdict", None) is not None:
            raise InputError(
                f"--use_cache with {self.world_size} processes is not supported by --model distperp: each rank "
                "would skip the requests it finds in its own cache, and the ranks would no longer score the same "
                "global plan together. Fix: run without --use_cache (results are exact and reproducible), or "
                "with one process."
            )
        super().set_cache_hook(cache_hook)

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self.chat(self.tokenizer, chat_history, add_generation_prompt)

    def get_model_info(self) -> dict:
        """Model and run metadata merged into the results JSON's ``config`` (:func:`run_record`)."""
        return run_record(self)

    # lm-eval passes the CLI's batch_size/max_batch_size/device as extra keyword arguments; a value the user gave
    # in --model_args wins, and the CLI's device default is marked so a missing GPU can fall back to the CPU.
    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None):
        from lm_eval.utils import simple_parse_args_string

        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None):
        extra = {k: v for k, v in (additional_config or {}).items() if v is not None and k not in arg_dict}
        if "device" in extra:
            extra["device_from_cli"] = True
        Options.from_kwargs(**split_given(arg_dict)[0])  # only --model_args keys: in-process keywords are refused
        return cls(**arg_dict, **extra)


setup_logging()
