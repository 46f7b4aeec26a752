"""Greedy ``generate_until`` on leaderboard shapes: lm-eval's ``hf`` model vs ``distperp``, in one process.

    python -m benchmarks.bench_generate --model ~/.cache/distperp/smollm2-135m-instruct --batch-size 8

Shapes (``--shapes``, comma-separated):

* ``instruct``: instruction following as IFEval runs it: the model's chat template (SmolLM2's adds its default
  system prompt: a shared prefix), stop at EOS only, ``--instruct-new`` new tokens at most (IFEval: 1,280).
* ``gsm8k_cot``: lm-eval's own ``gsm8k_cot`` task YAML (its 8 fixed exemplars, ``first_n``; stop at ``Q:``; 256
  new tokens), on local problems in GSM8K's schema (``question``, ``answer``) that this script writes.
* ``gsm8k``: lm-eval's own ``gsm8k`` YAML (5 exemplars drawn at random from the train split per question: no
  shared prefix; stop at ``Question:``), on the same local problems.

Both models are built in-process from lm-eval's registry and called with the same ``Instance``s, alternating per
repeat (rotated order), median of ``--repeats``. Every position through the decoder is counted on both sides
(``hf``: a hook on ``base_model``; distperp: its own statistics, since a hook would be traced into a compiled step
and skipped by a CUDA graph's replay): *decode positions* (rows of forwards of one new token, a fixed-shape step's
free slots included), *prefill positions* (everything else, pads included). *Useful tokens*: new tokens up to and
including the one that ends each row (distperp's count; a row of ``hf`` computes those too before its batch may
stop). For every text that differs, the first differing token
and the top-2 logit gap of the model there (a near-tie, or not) are printed.

``distperp-invariant`` is ``batch_invariant=true`` (each sequence decoded alone: what the option costs).
``--backends hf,distperp,distperp-compile`` adds ``compile=true`` (its texts compared with eager ``distperp``'s),
and then one decode step is also timed bare at ``--batch-size`` rows and a ``--step-context``-token context:
the eager engine's (a ``DynamicCache``) against the compiled static step's, alternating blocks, median.
``distperp-nographs`` is ``cuda_graphs=false`` (on CUDA: the eager fixed-shape step). ``--device cuda --dtype
bfloat16`` runs both sides there; a second table gives each distperp backend's decode step, reads of the device per
forward, ms per forward and, with ``--bandwidth`` (GB/s), the fraction of the memory floor (weights and the rows'
keys and values read once per decode step).

``--random-shape NAME`` generates with a random-init model of ``_scoring_common.RANDOM_SHAPES`` instead of
``--model`` (e.g. ``gemma3-270m``, ``gpt-oss-scaled``; built once into ``--workdir``); ``--share-model`` loads the
weights once and gives every backend the same model object. The scoring paths distperp's probe decided are printed
under the tables.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks._scoring_common import RANDOM_SHAPES, Counter, load_model, make_lm, probe_decision, resolve_model

TOPICS = [
    "the sea",
    "a mountain village",
    "autumn leaves",
    "a busy train station",
    "the moon",
    "an old library",
    "a thunderstorm",
    "a bicycle ride",
    "the first snow",
    "a lighthouse",
    "a market at dawn",
    "a quiet river",
    "city lights",
    "a desert road",
    "a garden in spring",
    "a winter night",
    "the harbour",
    "a forest path",
    "a kitchen in the morning",
    "a school bell",
    "a long journey",
    "a paper boat",
    "the stars",
    "a rainy day",
]
ASKS = [
    "Write a short poem about {}.",
    "Describe {} in three sentences.",
    "Give three facts about {}.",
    "Write a two-line story about {}.",
]


def instruct_prompts(lm, count: int) -> list[str]:
    """Chat-formatted instructions (a plain ``User:/Assistant:`` frame for a model without a chat template)."""
    asks = [ASKS[i % len(ASKS)].format(TOPICS[i % len(TOPICS)]) for i in range(count)]
    if getattr(lm.tokenizer, "chat_template", None) is None:
        return [f"System: You are a helpful assistant.\nUser: {ask}\nAssistant:" for ask in asks]
    return [lm.apply_chat_template([{"role": "user", "content": ask}]) for ask in asks]


def gsm8k_rows(count: int) -> list[dict]:
    """Arithmetic word problems in GSM8K's schema (this script's own text, answers after ``####``)."""
    names, things = ["Tom", "Ana", "Lee", "Mia", "Sam", "Ivy", "Raj", "Zoe"], ["apples", "books", "coins", "stamps"]
    rows = []
    for i in range(count):
        a, b, c = 12 + 7 * i % 40, 3 + i % 9, 2 + i % 4
        name, thing = names[i % len(names)], things[i % len(things)]
        rows.append(
            {
                "question": f"{name} has {a} {thing}. {name} buys {b} more {thing} and then gives away "
                f"{c} {thing} to each of 2 friends. How many {thing} does {name} have now?",
                "answer": f"{name} starts with {a} {thing}. After buying {b} more, {name} has {a} + {b} = "
                f"{a + b}. Giving {c} to each of 2 friends is {2 * c}. {a + b} - {2 * c} = "
                f"{a + b - 2 * c}.\n#### {a + b - 2 * c}",
            }
        )
    return rows


def task_requests(name: str, count: int, folder: Path):
    """``count`` requests of lm-eval's own task ``name`` (its YAML as shipped), on local data in its schema."""
    import lm_eval
    import yaml
    from lm_eval.api.task import ConfigurableTask

    path = (
        Path(lm_eval.__file__).parent / "tasks" / "gsm8k" / {"gsm8k_cot": "gsm8k-cot.yaml", "gsm8k": "gsm8k.yaml"}[name]
    )
    config = yaml.safe_load(path.read_text())
    data = {split: folder / f"{split}.jsonl" for split in ("train", "test")}
    for split, rows in (("train", gsm8k_rows(40)), ("test", gsm8k_rows(count + 40)[40:])):
        data[split].write_text("".join(json.dumps(r) + "\n" for r in rows))
    config.update(
        dataset_path="json", dataset_name=None, dataset_kwargs={"data_files": {k: str(v) for k, v in data.items()}}
    )
    config.pop("tag", None)
    task = ConfigurableTask(config=config)
    task.set_fewshot_seed(seed=1234)  # lm-eval's default few-shot seed: the same prompts in every run
    task.build_all_requests(limit=count, rank=0, world_size=1)
    return [inst for inst in task.instances]


def first_difference(lm, context: str, a: str, b: str) -> str:
    """Where two texts' tokens first differ and the model's top-2 logit gap after the common part."""
    import torch

    ta, tb = lm.tok_encode(a), lm.tok_encode(b)
    n = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), min(len(ta), len(tb)))
    ids = torch.tensor([lm.tok_encode(context) + ta[:n]], device=lm.model.device)
    with torch.no_grad():
        top = lm.model(ids).logits[0, -1].float().topk(2).values
    return f"token {n}: top-2 logit gap {float(top[0] - top[1]):.2e}"


def run_shape(shape: str, lms: dict, counters: dict, args, folder: Path) -> dict:
    if shape == "instruct":
        kwargs = {"until": [], "max_gen_toks": args.instruct_new, "do_sample": False}
        from lm_eval.api.instance import Instance

        requests = [
            Instance("generate_until", {}, (p, dict(kwargs)), i)
            for i, p in enumerate(instruct_prompts(lms["distperp"], args.prompts))
        ]
    else:
        requests = task_requests(shape, args.prompts, folder)
        if args.task_new is not None:  # smoke tests only: the YAML's limit otherwise
            for request in requests:
                request.args[1]["max_gen_toks"] = args.task_new
    seconds: dict[str, list[float]] = {name: [] for name in lms}
    work: dict[str, tuple[int, int]] = {}
    outputs: dict[str, list[str]] = {}
    names = list(lms)
    for repeat in range(args.repeats):
        for name in names[repeat % 2 :] + names[: repeat % 2]:
            if name in counters:
                counters[name].decode = counters[name].prefill = 0
            start = time.perf_counter()
            outputs[name] = lms[name].generate_until(requests, disable_tqdm=True)
            seconds[name].append(time.perf_counter() - start)
            if name in counters:
                work[name] = (counters[name].decode, counters[name].prefill)
            else:  # distperp's own statistics (a hook would be traced into a compiled step, skipped by a graph)
                call = lms[name].stats.calls[-1].to_dict()
                work[name] = (call["decode_positions"] + call["padded_positions"], call["prefill_positions"])
    call = lms["distperp"].stats.calls[-1].to_dict()
    useful = call["generated"]
    steps = {name: lm.stats.calls[-1].to_dict() for name, lm in lms.items() if name.startswith("distperp")}
    rows = {
        name: {
            "median_s": statistics.median(t),
            "decode_per_useful": work[name][0] / max(1, useful),
            "prefill": work[name][1],
            "tok_s": useful / statistics.median(t),
        }
        for name, t in seconds.items()
    }
    base = "hf" if "hf" in lms else "distperp"
    diffs = {
        name: [
            (i, first_difference(lms["distperp"], r.args[0], outputs[base][i], outputs[name][i]))
            for i, r in enumerate(requests)
            if outputs[base][i] != outputs[name][i]
        ]
        for name in lms
        if name != base
    }
    if "distperp-compile" in lms and base == "hf":  # compiled against eager distperp
        diffs["distperp-compile"] = [
            (i, first_difference(lms["distperp"], r.args[0], outputs["distperp"][i], outputs["distperp-compile"][i]))
            for i, r in enumerate(requests)
            if outputs["distperp"][i] != outputs["distperp-compile"][i]
        ]
    return {
        "base": base,
        "shape": shape,
        "requests": len(requests),
        "useful": useful,
        "seconds": seconds,
        "rows": rows,
        "diffs": diffs,
        "same": {k: len(requests) - len(v) for k, v in diffs.items()},
        "lanes": call["lanes"],
        "slots": call["slots_max"],
        "shared_lanes": call["shared_lanes"],
        "steps": steps,
    }


def print_steps(results: list[dict], lms: dict, bandwidth: float | None) -> None:
    """Per distperp backend and shape: the decode step it ran, reads of the device per forward, ms per forward
    (the median wall over prefill and decode forwards) and, given ``bandwidth`` (GB/s), the fraction of the memory
    floor (weights plus the rows' keys and values read once per decode step)."""
    from distperp_harness.model.memory import kv_cache_bytes_per_token

    print(
        "\n| shape | backend | decode step | forwards | reads per forward | ms per forward | new tokens/s | "
        "fraction of the floor |\n|---|---|---|---:|---:|---:|---:|---:|"
    )
    for r in results:
        for name, call in r["steps"].items():
            model = lms[name].model
            forwards = call["prefill_forwards"] + call["decode_forwards"]
            row = r["rows"][name]
            floor = ""
            if bandwidth and call["decode_forwards"]:
                weights = sum(p.numel() * p.element_size() for p in model.parameters())
                context = (call["prompt_tokens"] + call["generated"] / 2) / max(1, call["jobs"])
                rows = call["decode_positions"] / call["decode_forwards"]
                step_s = (weights + rows * context * kv_cache_bytes_per_token(model)) / (bandwidth * 1e9)
                floor_tok_s = call["generated"] / (call["decode_forwards"] * step_s)
                floor = f"{row['tok_s'] / floor_tok_s:.1%}"
            reads = call.get("host_reads", 0) / max(1, forwards)
            print(
                f"| {r['shape']} | {name} | {call.get('decode_step', '?')} | {forwards} | {reads:.2f} | "
                f"{row['median_s'] / max(1, forwards) * 1e3:.1f} | {row['tok_s']:.0f} | {floor} |"
            )


VARIANTS = {
    "distperp-compile": ",compile=true",
    "distperp-invariant": ",batch_invariant=true",
    "distperp-nographs": ",cuda_graphs=false",
}
"""Backends that are distperp with one more --model_args key."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model folder (or --random-shape)")
    parser.add_argument(
        "--random-shape", default=None, choices=tuple(RANDOM_SHAPES), help="a random-init model of this shape"
    )
    parser.add_argument("--workdir", default=None, help="where to build the random model (default: a temp folder)")
    parser.add_argument(
        "--share-model", action="store_true", help="load the weights once and give every backend the same object"
    )
    parser.add_argument("--shapes", default="instruct,gsm8k_cot,gsm8k")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--instruct-new", type=int, default=192, help="instruct: max_gen_toks")
    parser.add_argument("--task-new", type=int, default=None, help="gsm8k shapes: max_gen_toks (default: the YAML's)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-length", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--backends", default="hf,distperp", help="of hf, distperp, distperp-compile, distperp-invariant"
    )
    parser.add_argument("--step-context", type=int, default=600, help="context of the bare decode step timing")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (both backends)")
    parser.add_argument("--dtype", default="float32", help="float32 or bfloat16 (both backends)")
    parser.add_argument(
        "--bandwidth", type=float, default=None, help="memory GB/s: report each distperp row's fraction of the floor"
    )
    args = parser.parse_args(argv)
    if args.random_shape:
        workdir = Path(args.workdir or tempfile.mkdtemp(prefix="bench_generate_"))
        args.model = str(resolve_model(f"random-{args.random_shape}", workdir))
    if not args.model:
        parser.error("give --model FOLDER or --random-shape NAME")
    shared = load_model(Path(args.model), args.device, args.dtype) if args.share_model else None
    lms = {
        name: make_lm(
            name,
            Path(args.model),
            args.max_length,
            args.batch_size,
            VARIANTS.get(name, ""),
            device=args.device,
            dtype=args.dtype,
            model=shared,
        )
        for name in args.backends.split(",")
    }
    counters = {name: Counter(lm.model) for name, lm in lms.items() if not name.startswith("distperp")}
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for shape in args.shapes.split(","):
            results.append(run_shape(shape, lms, counters, args, Path(tmp)))
    print(
        f"model {args.model}, batch {args.batch_size}, 1 process, {args.device} {args.dtype}, {args.repeats} "
        f"alternating repeats (median)\n"
    )
    print(
        "| shape | backend | decode positions per useful token | prefill positions | useful tokens/s | "
        "median s | vs first | texts equal |\n|---|---|---:|---:|---:|---:|---:|---:|"
    )
    for r in results:
        for name in lms:
            row, first = r["rows"][name], r["rows"][next(iter(lms))]
            same = f"{r['same'][name]}/{r['requests']}" if name in r["same"] else ""
            print(
                f"| {r['shape']} ({r['requests']} prompts, {r['useful']} useful tokens) | {name} | "
                f"{row['decode_per_useful']:.2f} | {row['prefill']:,} | {row['tok_s']:.1f} | "
                f"{row['median_s']:.1f} | {first['median_s'] / row['median_s']:.2f}x | {same} |"
            )
    print_steps(results, lms, args.bandwidth)
    for name, lm in lms.items():
        if name.startswith("distperp"):
            print(f"\n{name}: scoring paths {probe_decision(lm)}")
    for r in results:
        print(
            f"\n{r['shape']}: distperp {r['lanes']} lane(s) of {r['slots']} slots, {r['shared_lanes']} from a "
            "shared prefix"
        )
        for name, diffs in r["diffs"].items():
            for i, where in diffs:
                print(f"  {name}: prompt {i} differs at {where}")
    if "distperp-compile" in lms:
        compiled = lms["distperp-compile"]
        print("\ncompile:", json.dumps(compiled.compiled.to_dict()["decode"]))
        eager_ms, static_ms = step_times(lms["distperp"], compiled, args.batch_size, args.step_context)
        print(
            f"bare decode step, {args.batch_size} rows, {args.step_context}-token context: eager "
            f"{eager_ms:.1f} ms, compiled static {static_ms:.1f} ms ({eager_ms / static_ms:.2f}x)"
        )
    return 0


def step_times(eager_lm, compiled_lm, rows: int, context: int, steps: int = 20, blocks: int = 5) -> tuple[float, float]:
    """Median ms of one decode step of ``rows`` rows at ``context`` cached tokens: the eager engine's forward
    (``DynamicCache``, a ``[rows, context + 1]`` mask) and ``compiled_lm.static_decoding``'s step (the compiled
    static step; its bucket compiled first by ``prepare``), alternating blocks of ``steps``. Only the public faces
    of the step are used: ``prepare``, ``buffers_for`` and ``run`` over the bucket's buffers."""
    import torch
    from transformers import DynamicCache

    from distperp_harness.run.generation.engine.step import capacity_for
    from distperp_harness.run.scoring.engine.kvcache import cache_argument

    model, engine = eager_lm.model, compiled_lm.static_decoding
    capacity = capacity_for(context, 1)

    class _Plan:
        slots, longest, max_new = rows, context, 1

    engine.prepare(compiled_lm.collective, [_Plan()])
    buffers = engine.buffers_for(rows, capacity)
    buffers.reset()
    buffers.allowed[:, : context + 1] = True
    buffers.feed([7] * rows, [context] * rows)
    ids = torch.full((rows, 1), 7, dtype=torch.long)
    positions = torch.full((rows, 1), context, dtype=torch.long)
    cache = DynamicCache(config=model.config)
    arg = cache_argument(model)  # ``cache`` or ``past_key_values``, by the transformers version
    with torch.no_grad():
        model(input_ids=torch.full((rows, context), 7), use_cache=True, **{arg: cache})
    mask = torch.ones((rows, context + 1), dtype=torch.long)
    times: dict[str, list[float]] = {"eager": [], "static": []}
    with torch.no_grad():
        for _ in range(blocks):
            for name in ("eager", "static"):
                start = time.perf_counter()
                for _ in range(steps):
                    if name == "eager":
                        model(
                            input_ids=ids,
                            attention_mask=mask,
                            position_ids=positions,
                            use_cache=True,
                            logits_to_keep=1,
                            **{arg: cache},
                        )
                        cache.crop(-1)  # the next step writes the same column again
                    else:
                        buffers.set_length(context)
                        engine.run(buffers)
                times[name].append((time.perf_counter() - start) / steps * 1000)
    return statistics.median(times["eager"]), statistics.median(times["static"])


if __name__ == "__main__":
    sys.exit(main())
