"""What the decode loop costs the host, per forward: reads of the device back, and loop time outside the model.

    python -m benchmarks.decode_host                                    # the tiny test model, built in a temp dir
    python -m benchmarks.decode_host --model ~/.cache/distperp/smollm2-135m-instruct --prompts 16 --new 48

On a GPU a read of a tensor's values (``.tolist()``, ``.item()``, ``bool(t)``...) waits for the device, and the
Python between two forwards leaves it idle: both decide a small model's decode speed there, and both can be
counted on a CPU. For each decode step kind (``dynamic``: the ``DynamicCache`` batch, the default without a CUDA
graph; ``static``: the fixed-shape step, eager, which a CUDA graph records) one lane of ``--prompts`` prompts is
decoded greedily in ``--slots`` slots (stop at EOS or a blank line, ``--new`` tokens at most), alternating kinds,
``--repeats`` times:

* *reads per forward*: every read of tensor values by Python code during the lane (the model's forward included),
  counted by patching ``torch.Tensor`` (:func:`~distperp_harness.run.generation.engine.transfer.counting_reads`), over
  prefill and decode forwards;
* *loop ms per forward*: the lane's wall time minus the time inside the model's forward calls, per forward (the
  scheduler, stop rules, batch edits and token choice: what a GPU would wait for);
* *forward ms*: time inside the model per forward (compute on this CPU).

Texts of the two kinds are compared (greedy; they may differ only where a near-tie meets other rounding).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.common import WIKITEXT_TEST


def _prompts(tokenizer, count: int) -> list[list[int]]:
    if WIKITEXT_TEST.exists():
        words = WIKITEXT_TEST.read_text(encoding="utf-8").split()
    else:
        from distperp_harness.commands.tiny import sample_text

        words = sample_text().split() * 4
    return [tokenizer.encode(" ".join(words[500 + 97 * i : 500 + 97 * i + 60 + 9 * i])) for i in range(count)]


class ForwardClock:
    """Seconds spent inside ``model``'s forward calls (hooks on the top module)."""

    def __init__(self, model) -> None:
        self.seconds, self._t0 = 0.0, 0.0
        model.register_forward_pre_hook(lambda *_: self._start())
        model.register_forward_hook(lambda *_: self._stop())

    def _start(self) -> None:
        self._t0 = time.perf_counter()

    def _stop(self) -> None:
        self.seconds += time.perf_counter() - self._t0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a causal LM folder (default: the tiny test model)")
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--new", type=int, default=24)
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--kinds", default="dynamic,static", help="decode step kinds, of dynamic and static")
    args = parser.parse_args(argv)

    import torch
    from accelerate import PartialState
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from distperp_harness.run.generation.engine.loop import Decoder, decode_lane
    from distperp_harness.run.generation.engine.scheduler import Lane, StopRule, eos_ids
    from distperp_harness.run.generation.engine.transfer import counting_reads

    PartialState()
    with tempfile.TemporaryDirectory() as tmp:
        path = args.model
        if path is None:
            from distperp_harness.commands.tiny import TEST_SPEC, build_tiny_model

            path = str(build_tiny_model(TEST_SPEC, Path(tmp) / "tiny"))
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        tokenizer = AutoTokenizer.from_pretrained(path)
    cpu = torch.device("cpu")
    clock = ForwardClock(model)
    prompts = _prompts(tokenizer, args.prompts)
    rule = StopRule.of(tokenizer, ["\n\n"], eos_ids(tokenizer, model), args.new)
    kinds = {kind: _step(kind, model, cpu, tokenizer.pad_token_id) for kind in args.kinds.split(",")}
    rows: dict[str, list[tuple[float, float, int, int]]] = {k: [] for k in kinds}
    texts = {}
    for _ in range(args.repeats):
        for kind, step in kinds.items():
            clock.seconds = 0.0
            with counting_reads() as reads, torch.no_grad():
                t0 = time.perf_counter()
                texts[kind], stats = decode_lane(
                    Decoder(model, tokenizer, cpu, static=step), Lane(prompts, (), args.slots), rule
                )
                wall = time.perf_counter() - t0
            forwards = stats.prefill_forwards + stats.decode_forwards
            rows[kind].append((wall, clock.seconds, forwards, reads.total))
    print(
        f"model {Path(path).name if args.model else 'tiny test model'}, {args.prompts} prompts, {args.slots} slots, "
        f"{args.new} new tokens at most, CPU float32, {torch.get_num_threads()} threads, median of {args.repeats}\n"
    )
    print("| decode step | forwards | reads per forward | loop ms per forward | forward ms | lane s |")
    print("|---|---:|---:|---:|---:|---:|")
    for kind, runs in rows.items():
        forwards = runs[0][2]
        loop_ms = statistics.median((w - f) / forwards * 1e3 for w, f, _, _ in runs)
        fwd_ms = statistics.median(f / forwards * 1e3 for _, f, _, _ in runs)
        wall = statistics.median(w for w, _, _, _ in runs)
        print(f"| {kind} | {forwards} | {runs[0][3] / forwards:.2f} | {loop_ms:.2f} | {fwd_ms:.2f} | {wall:.2f} |")
    if len(texts) == 2:
        a, b = texts.values()
        same = sum(x == y for x, y in zip(a, b))
        print(f"\ntexts equal: {same}/{len(prompts)}{'' if same == len(prompts) else ' (DIFFER)'}")
    return 0


def _step(kind: str, model, device, pad):
    if kind == "dynamic":
        return None
    if kind != "static":
        raise SystemExit(f"--kinds: {kind!r} is not a decode step kind (dynamic, static)")
    from distperp_harness.run.generation.engine.step import StaticStep

    return StaticStep(model, device, pad)


if __name__ == "__main__":
    raise SystemExit(main())
