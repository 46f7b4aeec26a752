"""The fixed-shape decode step replayed as CUDA graphs (:class:`GraphStep`): the default decode step on CUDA.

A decode step of a small or mid-sized model launches hundreds of kernels; eager, the host's launches take longer
than the device's work. A CUDA graph records one bucket's step once and replays it with one launch. What makes it
possible is the fixed-shape batch (:mod:`.static_batch`): every input of the step (tokens, positions, the mask,
the keys and values, each layer's write column) lives in tensors allocated once per bucket and edited in place,
and the step reads nothing back to the host.

* **Capture** happens when a bucket's buffers are allocated, before any row joins them: two warm-up steps on a
  side stream, then the recorded one, on empty buffers (emptied again afterwards).
* **Checked once.** The first replay of each graph runs the eager step on the same inputs too; the graph is used
  only if its logits equal the eager step's bit for bit (else every lane decodes eager from then on, and the run's
  record says why). So a replay can never change a result.
* **Any failure** to capture (an operation that reads the device back, a kernel that refuses capture) means the
  eager fixed-shape step for the rest of the run, said once.

Only for a model that runs whole on one device (no shard or tensor-parallel group): a graph cannot hold a group's
collectives in step with members that decode other lanes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch
from accelerate.logging import get_logger

from distperp_harness.run.generation.engine.static_batch import StaticBuffers
from distperp_harness.run.generation.engine.step import BUCKET, StaticStep, StepState

if TYPE_CHECKING:
    from transformers import PreTrainedModel

log = get_logger(__name__)

Replay = Callable[[], torch.Tensor]
"""A captured step: replays the graph and returns its (reused) output tensor."""

Capture = Callable[[Callable[[], torch.Tensor], StaticBuffers], Replay]
"""``capture(step, buffers)``: records ``step()`` over ``buffers`` (whose contents it may change) as a replay."""


def _empty(buffers: StaticBuffers, pad: int) -> None:
    buffers.reset()
    buffers.inputs[0].fill_(pad)
    buffers.allowed[:, 0] = True


def cuda_capture(device: torch.device, pad: int) -> Capture:
    """A :data:`Capture` that records with ``torch.cuda.CUDAGraph`` (every graph in one memory pool, made at the
    first capture)."""
    pools: list = []

    def capture(step: Callable[[], torch.Tensor], buffers: StaticBuffers) -> Replay:
        if not pools:
            pools.append(torch.cuda.graph_pool_handle())
        pool = pools[0]
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # warm-up: lazy initialisations and kernel choices happen outside the graph
            for _ in range(2):
                _empty(buffers, pad)
                step()
        torch.cuda.current_stream(device).wait_stream(side)
        _empty(buffers, pad)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = step()

        def replay() -> torch.Tensor:
            graph.replay()
            return out

        return replay

    return capture


class GraphStep(StaticStep):
    """:class:`~.step.StaticStep` whose buckets replay as CUDA graphs (module docstring). ``capture``: how a graph
    is recorded (default: :func:`cuda_capture`; tests pass one that runs on CPU). ``state``: ``graphs`` lists the
    buckets captured, ``compiled_calls`` the replays, ``step``/``failure`` whether graphs are still in use."""

    kind = "cuda graphs"

    def __init__(
        self,
        model: PreTrainedModel,
        device: torch.device,
        pad_token_id: int | None,
        bucket: int = BUCKET,
        capture: Capture | None = None,
    ) -> None:
        super().__init__(model, device, pad_token_id, bucket)
        self.state.mode = "cuda graphs"
        self.state.step = StepState.COMPILED
        self._capture = capture if capture is not None else cuda_capture(device, self.pad)
        self._replays: dict[int, Replay] = {}  # by id() of the buffers they were captured over
        self._checked: set[int] = set()

    def allocated(self, buffers: StaticBuffers) -> None:
        self._replays.clear()  # the previous bucket's buffers are gone: so are its graphs
        self._checked.clear()
        if self.state.step is StepState.EAGER:
            return
        try:
            with torch.no_grad():
                replay = self._capture(lambda: self.forward_over(buffers), buffers)
        except Exception as exc:  # whatever refuses capture (named in the record), the eager step serves
            self._stop(f"capturing the {buffers.slots}x{buffers.capacity} step failed: {type(exc).__name__}: {exc}")
        else:
            self._replays[id(buffers)] = replay
            self.state.graphs.append(f"{buffers.slots}x{buffers.capacity}")
        finally:
            _empty(buffers, self.pad)

    def forward_over(self, buffers: StaticBuffers) -> torch.Tensor:
        return self.forward(buffers.cache, buffers.ids, buffers.allowed, buffers.positions, buffers.key_positions)

    def run(self, buffers: StaticBuffers) -> torch.Tensor:
        replay = self._replays.get(id(buffers))
        if replay is None:
            self.state.eager_calls["compile_failed"] += 1
            return self.forward_over(buffers)
        if id(buffers) in self._checked:
            self.state.compiled_calls += 1
            return replay()
        column = buffers.length  # the eager step writes the column, then the replay writes it again
        eager = self.forward_over(buffers).clone()
        buffers.set_length(column)
        out = replay()
        self._checked.add(id(buffers))
        if not torch.equal(out, eager):  # once per bucket: the one extra read of a graph's life
            diff = (out.float() - eager.float()).abs().max().item()
            self._stop(f"a replay's logits differed from the eager step's (max |diff| {diff:.3g})")
            return eager
        self.state.compiled_calls += 1
        return out

    def _stop(self, why: str) -> None:
        self.state.step, self.state.failure = StepState.EAGER, why
        self._replays.clear()
        log.warning(f"decode step: CUDA graphs off, the eager step decodes from here on: {why}", main_process_only=True)

    def release(self) -> None:
        self._replays.clear()
        self._checked.clear()
        super().release()
