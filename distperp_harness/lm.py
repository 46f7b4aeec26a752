"""``DistPerpLM``: the lm-eval face of distperp. It wires stages (:mod:`distperp_harness.stages`: place → load →
prepare, then per call: requests → units → global plan → score → gather) and holds no math; it only answers
lm-eval's contract (``loglikelihood``, ``loglikelihood_rolling``, ``generate_until``, what the evaluator reads)."""

from __future__ import annotations

import functools
import os
import time
from typing import Any

import torch
from accelerate.logging import get_logger
from lm_eval.api.model import TemplateLM
from lm_eval.utils import simple_parse_args_string

from distperp_harness.distributed.failfast import stop_together
from distperp_harness.distributed.liveness import set_base_stage
from distperp_harness.distributed.testfaults import fail_for_tests
from distperp_harness.docsplit import detach_padding
from distperp_harness.groupcalls import GroupCalls
from distperp_harness.model.given import check_given, split_given
from distperp_harness.model.identity import checkpoint_identity
from distperp_harness.model.parts import check_chat_template
from distperp_harness.options import Options, cli_extras
from distperp_harness.planning.requests import continuation_unit, window_units
from distperp_harness.report.quantcost import evaluator_tasks
from distperp_harness.report.results import Score
from distperp_harness.run.execution.calls import ScoringCall
from distperp_harness.run.execution.progress import generation_progress, setup_logging, token_progress
from distperp_harness.run.execution.record import run_record
from distperp_harness.run.generation.generate import generate
from distperp_harness.run.rules import ScoringRule, Sharing
from distperp_harness.run.runtime import attention_coefficient, head_coefficient
from distperp_harness.run.scoring.pipeline import score_requests
from distperp_harness.runfacts import run_facts
from distperp_harness.stages import InProcess, Tokens, generation_setup, load_models, place, prepare, scoring_config
from distperp_harness.tokens import Tokenization, loglikelihood_strings

log = get_logger(__name__)

# torchao's wheel prints load failures for its CUDA-only kernels on CPU machines; they are not needed there.
if not torch.cuda.is_available():
    os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")


class DistPerpLM(Tokenization, GroupCalls, TemplateLM):
    """lm-eval model ``distperp``: exact, world-size-independent log-likelihoods for Hugging Face causal LMs.

    Results of ``loglikelihood`` / ``loglikelihood_rolling`` are float64 sums (returned as
    :class:`~distperp_harness.report.results.Score`, a float carrying token counts) and are bit-identical for any
    number of processes and nodes.
    """

    backend = "causal"

    def __init__(self, *, _in_process: InProcess | None = None, **kwargs: Any) -> None:
        """``kwargs``: the ``--model_args`` keys (:class:`Options`); in-process callers use :meth:`in_process`.
        Stages: place → load → prepare (:mod:`distperp_harness.stages`), each a typed record kept here."""
        super().__init__()
        t0 = time.perf_counter()
        extra = _in_process or InProcess()
        kwargs, given = split_given(kwargs)  # simple_evaluate may pass a model (and tokenizer) object
        self.options = Options.from_kwargs(**kwargs)
        if given is not None:
            check_given(self.options, given)
        self.placement = placed = place(self.options, given, extra)
        self.collective, self._device, self.device_identity = placed.collective, placed.device, placed.device_identity
        self._rank, self._world_size = self.collective.rank, self.collective.world_size
        self.shard_size, self.tp_size, self.estimate = placed.shard_size, placed.tp_size, placed.estimate
        self.models = models = load_models(self.options, placed, given, extra)
        self.loaded, self.tokenizer = models.loaded, models.loaded.tokenizer
        self._model, self.reference, self.comparison = models.model, models.reference, models.comparison
        self.quant_report, self.weight_bytes = self.loaded.quant_report, self.loaded.weight_bytes
        self.reference_weight_bytes, self.per_rank = models.reference_weight_bytes, models.per_rank
        self._max_length = self.loaded.max_length
        tokens = Tokens(self.tokenizer.pad_token_id, self.prefix_token_id, self.tok_decode)
        self.prepared = ready = prepare(self.options, placed, models, tokens, self._scoring_config)
        self.batching, self.sharing, self.compiled = ready.batching, ready.sharing, ready.compiled
        self.sharing_fallback, self.row_budget_reason = ready.sharing_fallback, ready.row_budget_reason
        self._sharing_line, self.decode_step_line = ready.sharing_line, ready.decode_step_line
        self.static_decoding, self.warnings, self.stats = ready.static_decoding, ready.warnings, ready.stats
        self.store, self.executor, self.wide, self.traffic = ready.store, ready.executor, ready.wide, ready.traffic
        self.document_split, self.chat = ready.document_split, ready.chat
        self.load_seconds = time.perf_counter() - t0
        set_base_stage("running lm-eval's code (between distperp's calls)")  # what a lost peer's survivors print

    @classmethod
    def in_process(
        cls, *, reference_model: torch.nn.Module | None = None, mesh_of_one: bool = False, **kwargs: Any
    ) -> DistPerpLM:
        """For in-process callers (``sweep``, checks), never ``--model_args``: :class:`~.stages.InProcess`."""
        return cls(_in_process=InProcess(reference_model, mesh_of_one), **kwargs)

    def _scoring_config(self, compiled: Any = None) -> dict:
        """The resume key (:func:`~distperp_harness.stages.scoring_config`)."""
        compiled = compiled if compiled is not None else self.compiled
        return scoring_config(self.options, self.placement, self._model, compiled, self.checkpoint_identity)

    @functools.cached_property
    def checkpoint_identity(self) -> dict:
        """``model_sha`` (and ``peft_sha``, ``delta_sha``, ``gguf_*``) of the weights (model/identity.py), computed
        once: content hashes of local files read them whole."""
        return checkpoint_identity(self.options)

    # ------------------------------------------------------------------------- lm-eval request methods
    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[Score, bool]]:
        """TemplateLM's tokenization and :meth:`_loglikelihood_tokens`, then the per-task reference comparison
        (which needs the ``Instance``s that ``_loglikelihood_tokens`` no longer sees). Within the call, a context
        shared by several answers is tokenized once (TemplateLM encodes it again for every answer)."""
        if self._sharing_line:  # said where it applies: loglikelihood requests (a rolling task never shares rows)
            log.info(self._sharing_line, main_process_only=True)
            self._sharing_line = None
        what, requests = "tokenizing or comparing loglikelihood requests", detach_padding(requests)
        with self.one_call(), stop_together(self.collective, self._device, what):
            self.pre_encode(loglikelihood_strings(req.args for req in requests))
            answers = super().loglikelihood(requests, disable_tqdm=disable_tqdm)
            self._compare(requests, [score for score, _ in answers])
        return answers

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[Score, bool]]:
        """``requests``: ``((context, continuation), context_tokens, continuation_tokens)`` from TemplateLM.

        Returns ``(log-likelihood, is_greedy)`` per request, in order.
        """
        units = self._continuations((ctx, cont) for _, ctx, cont in requests)
        results = self._score(units, "loglikelihood", disable_tqdm, self.sharing)
        out = []
        for (request_str, _, _), r in zip(requests, results):
            answer = (Score.of(r), r.is_greedy)
            if request_str is not None:
                self.cache_hook.add_partial("loglikelihood", request_str, answer)
            out.append(answer)
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[Score]:
        """Log-likelihood of each whole text (``Instance.args == (text,)``), conditioned on the prefix token."""
        requests = detach_padding(requests)  # lm-eval's padding: responses of its own (docsplit.detach_padding)
        with stop_together(self.collective, self._device, "tokenizing or comparing loglikelihood_rolling requests"):
            with self.one_call():  # each text encoded once, in batches
                self.pre_encode((text, None) for (text,) in (req.args for req in requests))
                units = [
                    window_units(self.tok_encode(text), self.prefix_token_id, self.max_length, self.options.stride)
                    for (text,) in (req.args for req in requests)
                ]
            results = self._score(units, "loglikelihood_rolling", disable_tqdm, self.prepared.rolling)
            out = []
            for req, r in zip(requests, results):
                score = Score.of(r)
                self.cache_hook.add_partial("loglikelihood_rolling", req.args, score)
                out.append(score)
            self._compare(requests, out)
        return out

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy or sampled continuations (``Instance.args == (context, gen_kwargs)``), cut at ``until``."""
        requests = detach_padding(requests)
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
        progress = None if disable_tqdm else generation_progress("distperp generate_until", self.collective.is_main)
        setup = generation_setup(
            self.options, self.placement, self.models, self.prepared, self.tokenizer, self.max_gen_toks, progress
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
        units = self._continuations(pairs)
        scores = [Score.of(r) for r in self._score(units, "generate_until_reference", True, self.sharing)]
        kept = [(req, score) for req, score in zip(requests, scores) if score.n_tokens]
        self._compare([req for req, _ in kept], [score for _, score in kept])

    def _continuations(self, pairs) -> list[list]:
        """One continuation unit per ``(context ids, continuation ids)``. An empty continuation (possible after
        tokenization) has probability 1 (no unit: log-likelihood 0, greedy); an empty context is the prefix token."""
        return [
            [continuation_unit(ctx or [self.prefix_token_id], cont, self.max_length)] if cont else []
            for ctx, cont in pairs
        ]

    def _score(self, per_request_units, kind: str, disable_tqdm: bool, sharing: Sharing):
        """The global plan's scores, inside the failure channel: an error while exchanging, planning, routing or
        returning results stops every rank at once, naming this one (a forward's error is named as scoring)."""
        model, warn = self._model, functools.partial(log.warning, main_process_only=True)
        rule = ScoringRule(
            self.batching, sharing, attention_coefficient(model), head_coefficient(model), self.reference is not None
        )  # batches, rows, their costs, and whether the reference is scored too
        progress = None if disable_tqdm else token_progress(f"distperp {kind}", self.collective.is_main)
        prepare = functools.partial(self.compiled.prepare, self.collective)
        with stop_together(self.collective, self._device, f"planning, exchanging or gathering {kind}"):
            fail_for_tests(self.rank, "planning")
            results = score_requests(
                per_request_units, self.executor, rule, kind=kind, stats=self.stats, log=warn, prepare=prepare,
                progress=progress, wide=self.wide,
            )  # fmt: skip
        call = self.stats.calls[-1]
        if isinstance(call, ScoringCall):  # the call just made
            log.info(call.summary(self.world_size, self.stats.fingerprint), main_process_only=True)
            if self.store is not None:
                log.info(self.store.reuse_line(kind, call.batches, "batches"), main_process_only=True)
        return results

    def _compare(self, requests, scores: list[Score]) -> None:
        """With a reference: gather this call's per-request comparisons (every rank) and log one line per task."""
        if self.comparison is not None:
            for line in self.comparison.add(requests, scores, self.collective, evaluator_tasks()):
                log.info(line, main_process_only=True)

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

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        """lm-eval's choice of template (it asks before evaluating); asked of a tokenizer without one, an
        :class:`~distperp_harness.errors.InputError` naming the fix (:func:`~distperp_harness.model.parts.
        check_chat_template`) instead of a traceback at the first prompt."""
        if chat_template:
            check_chat_template(self.tokenizer, self.options.tokenizer or self.options.pretrained)
        return super().chat_template(chat_template)

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self.chat(self.tokenizer, chat_history, add_generation_prompt)

    def get_model_info(self) -> dict:
        """Model and run metadata merged into the results JSON's ``config`` (:func:`run_record`)."""
        facts = (self.options, self.placement, self.models, self.prepared, self.load_seconds, self.checkpoint_identity)
        return run_record(run_facts(*facts))

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None):
        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None):
        """``--model_args`` (in-process keywords refused) and the CLI's extras (:func:`~.options.cli_extras`)."""
        Options.from_kwargs(**split_given(arg_dict)[0])
        return cls(**arg_dict, **cli_extras(arg_dict, additional_config))


setup_logging()
