"""Command line: ``python -m distperp_harness {demo,demo-model,tasks-path,new-task,babilong-local,compare,sweep,series,
check,parity}``
(also ``distperp``)."""

from __future__ import annotations

import argparse
import sys

from distperp_harness.commands.taskdir import tasks_path
from distperp_harness.commands.tiny import DEMO_BUILD
from distperp_harness.errors import install_excepthook


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m distperp_harness", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="offline demo on a tiny model the project builds: 2 processes, fp32 vs int4")
    demo.add_argument(
        "--out",
        default=None,
        help="folder for the results and the figure compare.png (default: the results in a temporary folder, the "
        "figure in the current folder)",
    )
    demo.add_argument("--processes", type=int, default=2, help="processes for the distributed runs (default 2)")

    sub.add_parser("tasks-path", help="print the folder to pass to lm-eval as --include_path")
    sub.add_parser(
        "demo-model",
        help="print the demo model's folder (a small Llama trained on the packaged "
        f"sample; built once, {DEMO_BUILD}, then cached)",
    )

    new_task = sub.add_parser(
        "new-task", help="write a task YAML of your own (perplexity of your documents) that runs from your folder"
    )
    new_task.add_argument("name", help="the task's name (what --tasks takes)")
    new_task.add_argument("--data", required=True, help="a folder of .txt/.jsonl documents, or one such file")
    new_task.add_argument("--out", default=".", help="folder to write NAME.yaml in (default: the current one)")
    new_task.add_argument("--force", action="store_true", help="overwrite an existing NAME.yaml")

    babilong = sub.add_parser(
        "babilong-local", help="lm-eval's babilong tasks on a local copy of their dataset (offline)"
    )
    babilong.add_argument("--data", required=True, help="the downloaded RMT-team/babilong-1k-samples folder")
    babilong.add_argument("--out", default=".", help="folder to write the task YAMLs in (default: the current one)")
    babilong.add_argument("--force", action="store_true", help="overwrite existing files")

    compare = sub.add_parser("compare", help="markdown table of one or more results JSON files")
    compare.add_argument("results", nargs="*", help="results_*.json files or folders holding them")
    compare.add_argument("--plot", default=None, help="also write a PNG figure to this path")
    compare.add_argument(
        "--same-bits",
        dest="same_bits",
        nargs=2,
        metavar=("A", "B"),
        default=None,
        help="one line: whether runs A and B are the same bits (fingerprints and per-document values), or where "
        "they first differ; exit 3 when they differ",
    )

    from distperp_harness.commands.sweep import add_arguments as sweep_arguments

    sweep_arguments(
        sub.add_parser(
            "sweep",
            help="quantization leaderboard: several schemes against one reference "
            "on lm-eval tasks (works under accelerate launch)",
        )
    )

    from distperp_harness.commands.series import add_arguments as series_arguments

    series_arguments(
        sub.add_parser(
            "series",
            help="a training run's checkpoints in one launch: a results folder, a table row and curve points per "
            "checkpoint (works under accelerate launch; --watch evaluates them as the run writes them)",
        )
    )

    from distperp_harness.commands.check import add_arguments as check_arguments
    from distperp_harness.commands.parity import add_arguments as parity_arguments

    check_arguments(
        sub.add_parser(
            "check",
            help="self-check of this machine: load, bf16 and int4 scoring, same bits twice, memory released, "
            "1 vs 2 processes; a table and a verdict",
        )
    )
    parity_arguments(
        sub.add_parser(
            "parity",
            help="your checkpoint through lm-eval's hf and through distperp on a few tasks: per-request "
            "differences, metrics side by side, a verdict",
        )
    )

    args = parser.parse_args(argv)
    install_excepthook()
    if args.command == "tasks-path":
        print(tasks_path())
        return 0
    if args.command == "demo-model":
        from distperp_harness.run.execution.progress import setup_logging

        setup_logging()  # before torchao loads: its import notes are dropped
        from transformers.utils import logging as transformers_logging

        from distperp_harness.commands.tiny import demo_model

        transformers_logging.disable_progress_bar()  # stdout is the folder alone; stderr one line when it builds
        print(demo_model())
        return 0
    if args.command == "demo":
        from distperp_harness.commands.demo import run_demo

        return run_demo(out=args.out, processes=args.processes)
    if args.command == "new-task":
        from distperp_harness.commands.newtask import write_task

        written = write_task(args.name, args.data, args.out, force=args.force)
        print(
            f"{written}\nrun it: lm_eval --model distperp --model_args pretrained=MODEL --tasks {args.name} "
            f"--include_path {written.parent}"
        )
        return 0
    if args.command == "babilong-local":
        from distperp_harness.commands.babilong import GROUP, write_tasks

        files = write_tasks(args.data, args.out, force=args.force)
        print("\n".join(str(f) for f in files))
        print(
            f"run them: lm_eval --model distperp --model_args pretrained=MODEL --tasks {GROUP} "
            f'--include_path {files[0].parent} --metadata \'{{"max_seq_lengths": "4k"}}\''
        )
        return 0
    if args.command == "compare":
        from distperp_harness.commands.compare import run_compare

        if not args.results and not args.same_bits:
            compare.error("give results files or folders, or --same-bits A B")
        return run_compare(args.results, plot=args.plot, same_bits=args.same_bits)
    if args.command == "sweep":
        from distperp_harness.commands.sweep import run_sweep

        return run_sweep(args)
    if args.command == "series":
        from distperp_harness.commands.series import run_series

        return run_series(args)
    if args.command == "check":
        from distperp_harness.commands.check import run_check

        return run_check(args)
    if args.command == "parity":
        from distperp_harness.commands.parity import run_parity

        return run_parity(args)
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
