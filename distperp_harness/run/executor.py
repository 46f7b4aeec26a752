"""One executor for both stages: how this rank runs the global plan's units of work (scoring batches and
generation lanes) once the plan says who owns what.

The policy both stages need lives here and nowhere else:

* **which units** — this rank's own in plan order, then its ward's (:class:`~distperp_harness.run.claims.Claims`,
  when ``claim=true`` and someone can help);
* **reuse** — a unit saved in ``resume_dir`` is read back, never recomputed (its saved bits are the computed ones);
* **failure** — a unit is computed inside the failure channel (:func:`stop_together`: an error stops every rank at
  once, naming this one), with the fault points the tests use;
* **shard groups** — with sharded weights (``shard_size`` > 1) every forward gathers the group's weights, so the
  group walks in steps (:class:`~distperp_harness.run.claims.GroupSteps`) and a member with less to do in a step
  makes idle forwards, scoring's (:meth:`Executor.batches`) and generation's (:meth:`Executor.decoding`) alike;
* **what each rank did** — :class:`~distperp_harness.run.calls.RankFacts` gathered at the end of a call.

The forwards themselves come in :class:`Forwards` (:func:`model_forwards` for a loaded model; tests pass fakes),
so planning and this policy are testable with thread collectives and no model.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Iterator, Sequence

import torch

from distperp_harness.distributed.collective import naming_failures
from distperp_harness.distributed.failfast import fail_for_tests, stop_together
from distperp_harness.distributed.store import default_store
from distperp_harness.model.memory import peak_memory_bytes
from distperp_harness.model.sharding import gathered, regather
from distperp_harness.planning.requests import Unit
from distperp_harness.run.calls import RankFacts
from distperp_harness.run.claims import Claims, GroupSteps, helper_step
from distperp_harness.run.resume import fault_for_tests
from distperp_harness.run.scoring import BatchScores, NonFiniteLogitsError, forward_calls, score_batch


@dataclass(frozen=True)
class Forwards:
    """The forwards the executor runs.

    ``score(rows, shared)``: one batch's :class:`BatchScores` (rows sharing their first ``shared`` tokens);
    ``idle_score()``: a scoring forward whose result is dropped; ``root()``: the context of one generation forward
    (the model's root weights gathered); ``idle_decode()``: a one-token generation forward, result dropped."""

    score: Callable[[Sequence[Any], int], BatchScores]
    idle_score: Callable[[], None] = lambda: None
    root: Callable[[], ContextManager] = contextlib.nullcontext
    idle_decode: Callable[[], None] = lambda: None


def model_forwards(model: torch.nn.Module, reference: torch.nn.Module | None, device: torch.device,
                   pad_token_id: int | None, describe: Callable[[Sequence[int]], str], shard_size: int = 1,
                   collective: Any = None) -> Forwards:
    """:class:`Forwards` of a loaded model (and reference): sharded weights gathered around each forward, a failed
    gather named (:func:`naming_failures`), NaN/inf logits turned into a ValueError that shows the rows."""
    sharded = shard_size > 1

    def score(rows, shared: int = 0) -> BatchScores:
        try:
            with naming_failures(collective, sharded), gathered(model, reference):
                return score_batch(model, rows, device=device, shared=shared, pad_token_id=pad_token_id,
                                   reference=reference, between_forwards=functools.partial(regather, model, reference))
        except NonFiniteLogitsError as exc:
            where = "; ".join(f"the window {describe(list(rows[r].root[:24]))!r}... ({rows[r].length} tokens)"
                              for r in exc.rows[:3])
            raise ValueError(f"the model produced NaN/inf logits while scoring {where}: results would be "
                             "meaningless. Try dtype=float32, or check the checkpoint.") from exc

    def idle_score() -> None:
        with naming_failures(collective, True), gathered(model, reference):
            score_batch(model, [Unit((pad_token_id, pad_token_id), 1)], device=device, pad_token_id=pad_token_id,
                        reference=reference)

    @contextlib.contextmanager
    def root():
        with naming_failures(collective, True), gathered(model):
            yield

    def idle_decode() -> None:
        with torch.no_grad(), root():
            pad = pad_token_id if pad_token_id is not None else 0
            model(input_ids=torch.tensor([[pad]], device=device), use_cache=False, logits_to_keep=1)

    return Forwards(score, idle_score, root, idle_decode)


class Executor:
    """This rank's runner of planned work (module docstring). Every rank builds one with the same settings.

    Args:
        collective: the run's :class:`~distperp_harness.distributed.collective.Collective` (or a test's).
        forwards: what a unit's computation calls (:func:`model_forwards`).
        store: ``resume_dir``'s :class:`~distperp_harness.run.resume.BatchStore`, or ``None``.
        claiming: ``claim=``; ``local_world_size``: processes per node (a rank's helper is then on another node);
        shard_size: ranks per shard group (1: unsharded).
    """

    def __init__(self, collective: Any, forwards: Forwards, *, device: torch.device | None = None, store: Any = None,
                 claiming: bool = True, local_world_size: int = 1, shard_size: int = 1) -> None:
        self.collective, self.forwards, self.device, self.store = collective, forwards, device, store
        self.shard_size = shard_size
        self.rank, self.world_size = collective.rank, collective.world_size
        self.step = helper_step(self.world_size, local_world_size, shard_size) if claiming else 0

    @property
    def claiming_mode(self) -> str:
        return "dynamic" if self.step else "static"

    def stage(self, what: str) -> ContextManager:
        """The failure channel around a stage that is not one unit (planning, exchanging, gathering)."""
        return stop_together(self.collective, self.device, what)

    # ------------------------------------------------------------------ which units
    def claims(self, batches_of: Callable[[int], list[int]], prefix: str) -> Claims:
        """The units this rank computes: its own (``batches_of(rank)``, plan order), then its ward's when claiming.
        ``prefix``: the call's store prefix, equal on every rank."""
        ward = batches_of((self.rank - self.step) % self.world_size) if self.step else []
        return Claims(batches_of(self.rank), ward, default_store() if self.step else None, prefix)

    def batches(self, claims: Claims, calls_of: Callable[[int], int], prefix: str) -> Iterator[int]:
        """Scoring's walk: the batches this rank computes, in order. A shard group walks in steps: after this rank's
        batch of a step (computed by the caller when the generator resumes), idle forwards up to the step's largest
        number of forward calls (``calls_of(batch)``)."""
        if self.shard_size <= 1:
            yield from claims
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
            raise RuntimeError("sharded weights need the process group's store to keep a shard group's forward "
                               "calls in step, and torch.distributed did not provide it")
        return GroupSteps(store, f"{prefix}/groups", self.rank, self.shard_size)

    # ------------------------------------------------------------------ one unit
    def score(self, rows: Sequence[Any], shared: int = 0) -> BatchScores:
        """One scoring batch: from ``resume_dir`` when saved there (a shard group's member still makes its share of
        the group's forwards, as idle ones), else computed in the failure channel and saved."""
        saved = self.store.load(rows) if self.store else None
        if saved is not None:
            if self.shard_size > 1:
                for _ in range(forward_calls(shared)):
                    self.idle_score()
            return saved
        with stop_together(self.collective, self.device):
            fail_for_tests(self.rank)
            scores = self.forwards.score(rows, shared)
        if self.store:
            self.store.save(rows, scores)
        fault_for_tests(self.rank)
        return scores

    def lane(self, key: bytes | None, jobs: int, what: str, compute: Callable[[], tuple[list[str], dict]]
             ) -> tuple[list[str], dict | None]:
        """One generation lane's texts and statistics (``None`` when read back from ``resume_dir`` under ``key``):
        computed in the failure channel (``what`` names it) and saved."""
        saved = self.store.load_lane(key, jobs) if self.store is not None and key is not None else None
        if saved is not None:
            return saved, None
        with stop_together(self.collective, self.device, what):
            fail_for_tests(self.rank, "lane")
            texts, stats = compute()
        if self.store is not None and key is not None:
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
        mine = RankFacts(peak_memory_bytes(self.device) if self.device is not None else 0,
                         getattr(self.collective, "bytes_received", 0) - received_before,
                         self.store.local_counts() if self.store else None)
        everyone = self.collective.all_gather_object(mine, "gather peak memory, resume counts and traffic")
        if self.store:
            self.store.add_up([f.resume_counts for f in everyone])
        return everyone

