"""One executor for both stages: how this rank runs the global plan's units of work (scoring batches and
generation lanes) once the plan says who owns what.

The policy both stages need lives here and nowhere else:

* **which units** — this rank's own in plan order, then its ward's
  (:class:`~distperp_harness.run.execution.claims.Claims`, when ``claim=true`` and someone can help);
* **reuse** — a unit saved in ``resume_dir`` is read back, never recomputed (its saved bits are the computed ones);
* **failure** — a unit is computed inside the failure channel (:func:`stop_together`: an error stops every rank at
  once, naming this one), with the fault points the tests use;
* **shard groups** — with sharded weights (``shard_size`` > 1) every forward gathers the group's weights, so the
  group walks in steps (:class:`~distperp_harness.run.execution.claims.GroupSteps`) and a member with less to do in a
  step makes idle forwards, scoring's (:meth:`Executor.batches`) and generation's (:meth:`Executor.decoding`) alike;
* **tensor-parallel groups** — with ``tp_size`` > 1 a group computes every forward together and is one worker of
  the plan (:mod:`distperp_harness.run.execution.groups`): its leader claims and decides (reuse or compute), the members
  follow the published decisions (:meth:`Executor.walk`), and only the leader reports (:attr:`Executor.reports`);
* **what each rank did** — :class:`~distperp_harness.run.execution.calls.RankFacts` gathered at the end of a call.

The forwards themselves come in :class:`Forwards` (:func:`model_forwards` for a loaded model; tests pass fakes),
so planning and this policy are testable with thread collectives and no model.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Iterator, Sequence

import torch

from distperp_harness.distributed.collective import naming_failures
from distperp_harness.distributed.failfast import stop_together
from distperp_harness.distributed.protocol import Collective
from distperp_harness.distributed.store import default_store
from distperp_harness.distributed.testfaults import fail_for_tests
from distperp_harness.model.cp_attention import Group
from distperp_harness.model.memory import peak_memory_bytes
from distperp_harness.model.sharding import gathered, regather
from distperp_harness.planning.requests import Unit
from distperp_harness.run.execution.calls import RankFacts
from distperp_harness.run.execution.claims import Claiming, Claims, GroupSteps, helper_step
from distperp_harness.run.execution.groups import Follow, Workers
from distperp_harness.run.execution.resume import fault_for_tests
from distperp_harness.run.scoring.engine.cp_forward import score_batch_cp
from distperp_harness.run.scoring.engine.forward import (
    BatchScores,
    NonFiniteLogitsError,
    forward_calls,
    score_batch,
    score_each_row,
)
from distperp_harness.run.scoring.engine.invariance import Invariance

if TYPE_CHECKING:
    from transformers import PreTrainedModel


@dataclass(frozen=True)
class Forwards:
    """The forwards the executor runs.

    ``score(rows, shared)``: one batch's :class:`BatchScores` (rows sharing their first ``shared`` tokens);
    ``idle_score()``: a scoring forward whose result is dropped; ``root()``: the context of one generation forward
    (the model's root weights gathered); ``idle_decode()``: a one-token generation forward, result dropped;
    ``row_at_a_time``: ``score`` runs each row alone
    (:func:`~distperp_harness.run.scoring.engine.forward.score_each_row`)."""

    score: Callable[[Sequence[Any], int], BatchScores]
    idle_score: Callable[[], None] = lambda: None
    root: Callable[[], ContextManager] = contextlib.nullcontext
    idle_decode: Callable[[], None] = lambda: None
    row_at_a_time: bool = False


def _scoring_pad(pad_token_id: int | None) -> int:
    """The pad token scoring lays rows out with (generation alone runs without one)."""
    if pad_token_id is None:
        raise ValueError("scoring needs a pad token id, and the tokenizer has none (nor an eos or unk token)")
    return pad_token_id


def model_forwards(  # noqa: PLR0913 - the load stage's facts, each read once here
    model: PreTrainedModel,
    reference: PreTrainedModel | None,
    device: torch.device,
    pad_token_id: int | None,
    describe: Callable[[Sequence[int]], str],
    shard_size: int = 1,
    collective: Collective | None = None,
    tp_size: int = 1,
    invariance: Invariance = Invariance.OFF,
    cp: Group | None = None,
) -> Forwards:
    """:class:`Forwards` of a loaded model (and reference): sharded weights gathered around each forward, a failed
    gather or all-reduce named (:func:`naming_failures`), NaN/inf logits turned into a ValueError that shows the
    rows; under ``invariance`` (``batch_invariant=true``) each row attends alone, in a batch or a forward of its own
    (:class:`~distperp_harness.run.scoring.engine.invariance.Invariance`); with ``cp`` (a
    context-parallel group of more than one) every member computes its share of each row
    (:func:`~distperp_harness.run.scoring.engine.cp_forward.score_batch_cp`)."""
    sharded = shard_size > 1 or tp_size > 1 or (cp is not None and cp.size > 1)

    def score(rows, shared: int = 0) -> BatchScores:
        try:
            with naming_failures(collective, sharded), gathered(model, reference):
                if invariance.row_at_a_time and shared:
                    raise ValueError("internal error: rows scored one at a time share no cached prefix")
                if cp is not None and cp.size > 1:
                    if shared:
                        raise ValueError("internal error: a context-parallel batch has no cached prefix")
                    pad = _scoring_pad(pad_token_id)
                    return score_batch_cp(model, rows, device=device, pad_token_id=pad, group=cp, reference=reference)
                scorer = score_each_row if invariance.row_at_a_time else functools.partial(score_batch, shared=shared)
                return scorer(
                    model,
                    rows,
                    device=device,
                    pad_token_id=_scoring_pad(pad_token_id),
                    reference=reference,
                    between_forwards=functools.partial(regather, model, reference),
                    rows_alone=invariance.rows_alone,
                )
        except NonFiniteLogitsError as exc:
            where = "; ".join(
                f"the window {describe(list(rows[r].root[:24]))!r}... ({rows[r].length} tokens)" for r in exc.rows[:3]
            )
            raise ValueError(
                f"the model produced NaN/inf logits while scoring {where}: results would be "
                "meaningless. Try dtype=float32, or check the checkpoint."
            ) from exc

    def idle_score() -> None:
        with naming_failures(collective, True), gathered(model, reference):
            pad = _scoring_pad(pad_token_id)
            score_batch(
                model,
                [Unit((pad, pad), 1)],
                device=device,
                pad_token_id=pad,
                reference=reference,
            )

    @contextlib.contextmanager
    def root():
        with naming_failures(collective, True), gathered(model):
            yield

    def idle_decode() -> None:
        with torch.no_grad(), root():
            pad = pad_token_id if pad_token_id is not None else 0
            model(input_ids=torch.tensor([[pad]], device=device), use_cache=False, logits_to_keep=1)

    return Forwards(score, idle_score, root, idle_decode, invariance.row_at_a_time)


class Executor:
    """This rank's runner of planned work (module docstring). Every rank builds one with the same settings.

    Args:
        collective: the run's :class:`~distperp_harness.distributed.collective.Collective` (or a test's).
        forwards: what a unit's computation calls (:func:`model_forwards`).
        store: ``resume_dir``'s :class:`~distperp_harness.run.execution.resume.BatchStore`, or ``None``.
        claiming: ``claim=``; ``local_world_size``: processes per node (a rank's helper is then on another node);
        shard_size: ranks per shard group (1: unsharded); ``tp_size``: ranks per tensor-parallel group (1: none).
    """

    def __init__(  # noqa: PLR0913 - keyword-only facts of the run, each defaulted
        self,
        collective: Collective,
        forwards: Forwards,
        *,
        device: torch.device | None = None,
        store: Any = None,
        claiming: bool = True,
        local_world_size: int = 1,
        shard_size: int = 1,
        tp_size: int = 1,
    ) -> None:
        self.collective, self.forwards, self.device, self.store = collective, forwards, device, store
        self.shard_size, self.tp_size = shard_size, tp_size
        self.rank, self.world_size = collective.rank, collective.world_size
        self.workers = Workers(self.world_size, tp_size)
        self.worker = self.workers.of(self.rank)
        self.reports = self.workers.leads(self.rank)
        """Whether this rank reports what it computes (a TP group's members compute it too, and stay silent)."""
        self.step = helper_step(self.workers.count, max(1, local_world_size // tp_size), shard_size) if claiming else 0
        self._follow: Follow | None = None

    @property
    def claiming_mode(self) -> Claiming:
        return Claiming.DYNAMIC if self.step else Claiming.STATIC

    def stage(self, what: str) -> ContextManager:
        """The failure channel around a stage that is not one unit (planning, exchanging, gathering)."""
        return stop_together(self.collective, self.device, what)

    # ------------------------------------------------------------------ which units
    def claims(self, batches_of: Callable[[int], list[int]], prefix: str) -> Claims:
        """The units this rank computes: its own (``batches_of(rank)``, plan order), then its ward's when claiming.
        ``prefix``: the call's store prefix, equal on every rank."""
        count = self.workers.count
        ward = batches_of((self.worker - self.step) % count) if self.step else []
        return Claims(batches_of(self.worker), ward, default_store() if self.step else None, prefix)

    def walk(self, claims: Claims, prefix: str) -> Iterator[int]:
        """The units this rank computes, in order: its claims; in a TP group, the leader's claims, which it
        publishes and its members read (:class:`~distperp_harness.run.execution.groups.Follow`), ending with ``-1``."""
        if self.tp_size <= 1:
            self._follow = None
            yield from claims
            return
        store = default_store()
        if store is None:
            raise RuntimeError(
                "tensor parallelism needs the process group's store to keep a group's decisions "
                "together, and torch.distributed did not provide it"
            )
        follow = self._follow = Follow(store, f"{prefix}/walk", self.rank, self.tp_size)
        try:
            if follow.leader:
                for unit in claims:
                    follow.share(unit)
                    yield unit
                follow.share(-1)
                return
            while (unit := follow.share(-1)) >= 0:
                yield unit
        finally:
            self._follow = None  # decisions belong to this walk: a later call must not read past its end

    def _computes(self, saved: bool) -> bool:
        """Whether this rank computes the unit at hand: not when ``resume_dir`` holds it; in a TP group, the
        leader's answer (published), so that every member makes the forwards the leader makes."""
        if self._follow is None:
            if self.tp_size > 1:
                raise RuntimeError("a tensor-parallel rank decided outside a walk: its group could split")
            return not saved
        return bool(self._follow.share(int(not saved)))

    def batches(self, claims: Claims, calls_of: Callable[[int], int], prefix: str) -> Iterator[int]:
        """Scoring's walk: the batches this rank computes, in order. A shard group walks in steps: after this rank's
        batch of a step (computed by the caller when the generator resumes), idle forwards up to the step's largest
        number of forward calls (``calls_of(batch)``)."""
        if self.shard_size <= 1:
            yield from self.walk(claims, prefix)
            return
        steps = self._group_steps(prefix)
        walk = iter(claims)
        while True:
            b = next(walk, None)
            calls = calls_of(b) if b is not None else 0
            peak = steps.agree(calls)
            if peak == 0:
                return
            if b is not None:
                yield b
            for _ in range(peak - calls):
                self.idle_score()

    @contextlib.contextmanager
    def decoding(self, prefix: str) -> Iterator[Callable[[], ContextManager]]:
        """Generation's walk: yields ``around``, the context of each generation forward. A shard group announces
        each forward as one step and gathers the root weights for it; when this rank's lanes are done, it makes
        idle forwards until every member of its group is done."""
        if self.tp_size > 1:  # the members make the leader's forwards: only a failed all-reduce needs naming
            yield self.forwards.root
            return
        if self.shard_size <= 1:
            yield contextlib.nullcontext
            return
        steps = self._group_steps(prefix)

        @contextlib.contextmanager
        def around():
            steps.agree(1)
            with self.forwards.root():
                yield

        yield around
        while steps.agree(0) > 0:  # the group's others still decode: match their forwards
            self.idle_decode()

    def _group_steps(self, prefix: str) -> GroupSteps:
        """This rank's shard group's lockstep for the call with store prefix ``prefix``."""
        store = default_store()
        if store is None:
            raise RuntimeError(
                "sharded weights need the process group's store to keep a shard group's forward "
                "calls in step, and torch.distributed did not provide it"
            )
        return GroupSteps(store, f"{prefix}/groups", self.rank, self.shard_size)

    def forward_calls(self, rows: int, shared: int) -> int:
        """Forward calls of each model for a batch of ``rows`` rows sharing ``shared`` tokens computed once."""
        return forward_calls(shared, rows, self.forwards.row_at_a_time)

    # ------------------------------------------------------------------ one unit
    def score(self, rows: Sequence[Any], shared: int = 0) -> BatchScores | None:
        """One scoring batch: from ``resume_dir`` when saved there (a shard group's member still makes its share of
        the group's forwards, as idle ones), else computed in the failure channel and saved. ``None`` on a TP
        group's member when its leader read the batch back (a member reports nothing)."""
        saved = self.store.load(rows) if self.store and self.reports else None
        if not self._computes(saved is not None):
            if self.shard_size > 1:
                for _ in range(self.forward_calls(len(rows), shared)):
                    self.idle_score()
            return saved
        with stop_together(self.collective, self.device):
            fail_for_tests(self.rank)
            scores = self.forwards.score(rows, shared)
        if self.store and self.reports:
            self.store.save(rows, scores)
        fault_for_tests(self.rank)
        return scores

    def lane(
        self, key: bytes | None, jobs: int, what: str, compute: Callable[[], tuple[list[str], Any]]
    ) -> tuple[list[str], Any]:
        """One generation lane's texts and statistics (``None`` when read back from ``resume_dir`` under ``key``):
        computed in the failure channel (``what`` names it) and saved. A TP group's member gets ``([], None)`` when
        its leader read the lane back."""
        saved = self.store.load_lane(key, jobs) if self.store is not None and key is not None and self.reports else None
        if not self._computes(saved is not None):
            return saved or [], None
        with stop_together(self.collective, self.device, what):
            fail_for_tests(self.rank, "lane")
            texts, stats = compute()
        if self.store is not None and key is not None and self.reports:
            self.store.save_lane(key, texts)
        return texts, stats

    def idle_score(self) -> None:
        """A scoring forward whose result is dropped (a shard group's member with fewer calls in a step)."""
        with stop_together(self.collective, self.device):  # named as scoring, like the forward it matches
            fail_for_tests(self.rank)
            self.forwards.idle_score()

    def idle_decode(self) -> None:
        """A one-token generation forward whose result is dropped (a shard group's member with no lane left)."""
        with stop_together(self.collective, self.device, "generating (idle forward)"):
            fail_for_tests(self.rank)
            self.forwards.idle_decode()

    # ------------------------------------------------------------------ end of a call
    def facts(self, received_before: int) -> list[RankFacts]:
        """Every rank's :class:`RankFacts` for the call that began when ``bytes_received`` was ``received_before``;
        with ``resume_dir``, the store's counters are added up across ranks (every rank calls this together)."""
        mine = RankFacts(
            peak_memory_bytes(self.device) if self.device is not None else 0,
            getattr(self.collective, "bytes_received", 0) - received_before,
            self.store.local_counts() if self.store else None,
        )
        everyone = self.collective.all_gather_object(mine, "gather peak memory, resume counts and traffic")
        if self.store:
            self.store.add_up([f.resume_counts for f in everyone])
        return everyone
