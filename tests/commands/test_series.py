"""series: checkpoints found and ordered by step; the table and the figure from fixed runs; one watched series of tiny
checkpoints (one with another tokenizer, one that fails to load, one written while the series runs) whose results
have the fingerprints of separate evaluations, then a second watch that evaluates nothing and a 2-process launch
that resumes a stopped series with the same fingerprints (one checkpoint failing to load on rank 1 only); two LoRA
adapters over one base read once, each with the bits of its separate evaluation."""

import json
import shutil
import threading
import time
from pathlib import Path

import pytest
from helpers import accelerate_launch_prefix, load_results, lora_adapter, run_command, sharpened_model

from distperp_harness.commands.checkpoints import Checkpoint, Kind, discover, step_of
from distperp_harness.commands.cli import main
from distperp_harness.commands.compare import Run
from distperp_harness.commands.series_table import Column, Row, Status, columns, read_rows, series_table
from distperp_harness.errors import InputError

TASKS = "dptest_mc,dptest_rolling"

# --- finding checkpoints (pure) ------------------------------------------------------------------------------------


def _folder(path: Path, *files: str) -> Path:
    path.mkdir(parents=True)
    for name in files:
        (path / name).write_text("{}")
    return path


def test_a_run_folder_gives_its_checkpoints_by_step(tmp_path):
    run = tmp_path / "run"
    _folder(run / "checkpoint-1000", "config.json")
    _folder(run / "checkpoint-500", "config.json")
    _folder(run / "global_step3000")  # named as a checkpoint, files missing: kept, to fail as a row
    _folder(run / "lora_a", "adapter_config.json", "trainer_state.json")
    (run / "lora_a" / "trainer_state.json").write_text(json.dumps({"global_step": 2000}))
    (run / "final.gguf").write_bytes(b"GGUF")
    _folder(run / "logs")  # neither
    (run / "notes.txt").write_text("")
    found = discover(str(run))
    assert [(c.label, c.step, c.kind) for c in found] == [
        ("checkpoint-500", 500, Kind.MODEL),
        ("checkpoint-1000", 1000, Kind.MODEL),
        ("lora_a", 2000, Kind.ADAPTER),
        ("global_step3000", 3000, Kind.MODEL),
        ("final", None, Kind.GGUF),
    ]
    assert found[4].model_args(None) == {"pretrained": str(run), "gguf_file": "final.gguf"}
    assert found[2].model_args("base/model") == {"pretrained": "base/model", "peft": str(run / "lora_a")}
    with pytest.raises(InputError, match="no base model was given. Fix: add --base"):
        found[2].model_args(None)


def test_lists_globs_and_kinds_given(tmp_path):
    for name in ("a/step_20", "b/step_20", "c/step_10"):
        _folder(tmp_path / name, "config.json")
    _folder(tmp_path / "d" / "merged", "config.json")
    found = discover(f"{tmp_path}/*/step_20, delta={tmp_path / 'd' / 'merged'},{tmp_path / 'c' / 'step_10'}")
    assert [(c.label, c.step, c.kind) for c in found] == [
        ("step_10", 10, Kind.MODEL),
        ("a-step_20", 20, Kind.MODEL),
        ("b-step_20", 20, Kind.MODEL),
        ("merged", None, Kind.DELTA),
    ]
    assert found[3].model_args("base") == {"pretrained": "base", "delta": str(tmp_path / "d" / "merged")}
    assert step_of(Path("runs/iter-0042")) == 42 and step_of(Path("model-v7.gguf")) == 7


@pytest.mark.parametrize(
    "spec, says",
    [("missing", "no such file or folder"), ("nothing*", "matches nothing"), ("empty", "no checkpoint in it")],
)
def test_what_names_no_checkpoint_says_so(spec, says, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(InputError, match=says):
        discover(spec)


class _Clock:
    """A clock the test moves: one poll of the watch is one ``tick``."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def _shards(folder: Path) -> dict[str, bytes]:
    """The bytes of a two-shard safetensors checkpoint and its index (written last by a real writer)."""
    import torch
    from safetensors.torch import save

    first, second = save({"a": torch.ones(500)}), save({"b": torch.ones(700)})
    index = {
        "metadata": {"total_size": 4 * 1200},
        "weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"},
    }
    return {
        "model-00001-of-00002.safetensors": first,
        "model-00002-of-00002.safetensors": second,
        "model.safetensors.index.json": json.dumps(index).encode(),
    }


def test_the_watch_reads_a_checkpoint_written_in_parts_once_it_is_whole_and_settled(tmp_path):
    """A writer that writes in parts, renames late and writes the index last: at no step before the last is the
    checkpoint readable, however long the writer pauses (settle 3 s, polls of 1 s); once whole it is read after
    the settle time (2 polls and 3 s unchanged), or at once with the writer's marker."""
    from distperp_harness.commands.series_decide import Watcher

    ckpt = _folder(tmp_path / "step_1", "config.json")
    checkpoint = Checkpoint(ckpt, Kind.MODEL, 1, "step_1")
    clock = _Clock()
    watcher = Watcher((), settle_s=3.0, retries=1, clock=clock)

    def polls(n):
        verdicts = []
        for _ in range(n):
            verdicts.append(watcher.ready(checkpoint))
            clock.now += 1.0
        return verdicts

    parts = _shards(tmp_path)
    first, second = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    steps = [
        lambda: None,  # config.json alone: no weight file
        lambda: (ckpt / f"{first}.tmp").write_bytes(parts[first][:300]),  # the first shard, in parts, as .tmp
        lambda: (ckpt / f"{first}.tmp").write_bytes(parts[first]),
        lambda: (ckpt / f"{first}.tmp").rename(ckpt / first),  # renamed late: one of the two shards
        lambda: (ckpt / second).write_bytes(parts[second][:1000]),  # the second, cut where the writer paused
        lambda: (ckpt / second).write_bytes(parts[second]),  # both whole, the index not yet
    ]
    reasons = []
    for step in steps:
        step()
        assert polls(6) == [False] * 6  # settled 5 s, and still not whole
        reasons.append(watcher.stuck(checkpoint))
    assert reasons == [
        "no weight file yet (*.safetensors, *.bin, *.pt, *.gguf)",
        f"{first}.tmp is still being written (named as a temporary file)",
        f"{first}.tmp is still being written (named as a temporary file)",
        f"1 of the 2 shards named like {first} are there",
        f"{second} holds 1,000 of the {len(parts[second]):,} bytes its header says",
        f"{first} is a shard, but no *.safetensors.index.json is there yet",
    ]
    (ckpt / "model.safetensors.index.json").write_bytes(parts["model.safetensors.index.json"])
    assert polls(4) == [False, False, False, True]  # unchanged for 2 polls and 3 s
    assert watcher.stuck(checkpoint) is None
    (ckpt / "DONE").write_text("")  # the writer's marker: read at its first look
    assert polls(1) == [True]


def test_a_checkpoint_that_failed_is_read_again_when_its_files_change_at_most_n_times(tmp_path):
    from distperp_harness.commands.series_decide import Watcher

    ckpt = _folder(tmp_path / "step_1", "config.json")
    checkpoint = Checkpoint(ckpt, Kind.MODEL, 1, "step_1")
    watcher = Watcher((), settle_s=0.0, retries=1)
    watcher.failed_now(checkpoint)
    assert not watcher.again(checkpoint)  # unchanged: not again
    (ckpt / "config.json").write_text('{"model_type": "llama"}')
    assert watcher.again(checkpoint)
    watcher.retrying(checkpoint)
    watcher.failed_now(checkpoint)  # failed again
    (ckpt / "config.json").write_text("{}")
    assert not watcher.again(checkpoint)  # retried once already: --retries 1


def test_a_cut_short_or_unreadable_weight_file_and_a_gguf_are_judged_by_their_headers(tmp_path):
    from distperp_harness.commands.checkpoints import not_whole

    parts = _shards(tmp_path)
    ckpt = _folder(tmp_path / "one", "config.json")
    (ckpt / "model.safetensors").write_bytes(parts["model-00001-of-00002.safetensors"])
    assert not_whole(ckpt) is None
    (ckpt / "model.safetensors").write_bytes(b"not safetensors at all, a damaged file the load names")
    assert not_whole(ckpt) is None  # not a header of a file being written: the load says what is wrong
    index = json.loads(parts["model.safetensors.index.json"])
    index["metadata"]["total_size"] += 4
    sharded = _folder(tmp_path / "sharded", "config.json")
    for name, data in parts.items():
        (sharded / name).write_bytes(json.dumps(index).encode() if name.endswith(".json") else data)
    assert (
        not_whole(sharded)
        == "model.safetensors.index.json says total_size 4,804, its files hold 4,800 bytes of tensors"
    )
    pytest.importorskip("gguf")
    gguf_file = tmp_path / "m.gguf"
    gguf_file.write_bytes(b"GGUF\x03\x00\x00\x00")
    assert not_whole(gguf_file).startswith("m.gguf cannot be read whole yet")


# --- the table (pure: fixed runs) ----------------------------------------------------------------------------------


def _run(acc, ppl, kl=None):
    tasks = {"mc": {"acc,none": acc, "acc_stderr,none": 0.1, "alias": "mc"}, "wiki": {"word_perplexity,none": ppl}}
    reference = {"wiki": {"kl_divergence": kl, "kl_divergence_stderr": kl / 10}} if kl is not None else {}
    return Run(Path("r"), "m", "none", 1, tasks, None, None, "f", reference=reference)


def test_table_has_a_row_per_checkpoint_by_step_and_the_failure(tmp_path):
    rows = [
        Row("checkpoint-200", "p2", 200, Status.DONE),
        Row("checkpoint-100", "p1", 100, Status.DONE),
        Row("broken", "p3", 150, Status.FAILED, "OSError: no | weights"),
    ]
    runs = {"checkpoint-100": _run(0.25, 30.0), "checkpoint-200": _run(0.5, 20.0, kl=0.02)}
    assert columns(list(runs.values())) == [
        Column("mc", "acc,none"),
        Column("wiki", "word_perplexity,none"),
        Column("wiki", "kl_divergence", reference=True),
    ]
    lines = series_table(rows, runs).splitlines()
    assert lines[0] == "| step | checkpoint | status | seconds | mc acc | wiki word_perplexity | wiki KL |"
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines[2:]]
    assert [c[0] for c in cells] == ["100", "150", "200"]
    assert cells[0][4:] == ["0.25 ± 0.1", "30", "–"] and cells[2][4:] == ["0.5 ± 0.1", "20", "0.02 ± 0.002"]
    assert cells[1][2] == "failed: OSError: no / weights" and cells[1][4:] == ["–", "–", "–"]


def test_figure_draws_each_metric_against_step(tmp_path):
    pytest.importorskip("matplotlib")
    from PIL import Image

    from distperp_harness.commands.series_plot import plot_series, series_panels

    rows = [Row(f"s{i}", "p", 100 * i, Status.DONE) for i in (1, 2, 3)]
    runs = {f"s{i}": _run(0.2 * i, 40.0 / i, kl=0.01 * i) for i in (1, 2, 3)}
    panels = series_panels(rows, runs)
    assert [c.title for c, _ in panels] == ["mc acc", "wiki word_perplexity", "wiki KL"]
    assert panels[0][1] == [(100.0, 0.2, 0.1), (200.0, 0.4, 0.1), (300.0, pytest.approx(0.6), 0.1)]
    drawn = plot_series(rows, runs, tmp_path / "series.png")
    with Image.open(drawn.path) as image:
        assert image.text["Description"] == "panels: mc acc, wiki word_perplexity, wiki KL"


def test_a_cut_short_checkpoint_is_a_failed_row_with_its_whole_reason_and_exit_3(tiny_model_dir, tmp_path, capfd):
    """``series --checkpoints run/`` whose only checkpoint's ``model.safetensors`` is cut short: the row is failed
    with the loader's whole reason (the fix included) in the log, ``series.json`` and ``series.md``, and the launch
    exits 3 after writing it (before: exit 0, the reason cut at 300 characters)."""
    broken = shutil.copytree(tiny_model_dir, tmp_path / "run" / "step_1")
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    out = tmp_path / "out"
    assert main(_series_args(tmp_path / "run", out)) == 3
    reason = read_rows(out)[0].reason
    assert reason.startswith("InputError: pretrained=") and "model.safetensors is damaged" in reason
    assert reason.endswith(".") and "Fix: download or copy that file again" in reason and len(reason) > 300
    assert f"failed: {reason.replace('|', '/')} |" in (out / "series.md").read_text()
    said = capfd.readouterr()
    assert f"step_1 failed: {reason}; the series goes on" in said.err
    assert said.out.rstrip().endswith("series: exit 3: 1 checkpoint(s) failed (--allow-failures: exit 0)")


def _referenced_run(step):
    """A ``--reference previous`` checkpoint's run as distperp's perplexity task and a multiple-choice task report
    it: the perplexity task's own KL and top-1 metrics, n_tokens, and the reference's entries of both tasks."""
    names = ["token_perplexity", "word_perplexity", "byte_perplexity", "bits_per_byte", "n_tokens"]
    names += ["kl_divergence", "kl_p99", "kl_max", "top1_agreement", "ref_token_perplexity", "ln_ppl_ratio"]
    wiki = {f"{name},none": float(step + i) for i, name in enumerate(names)}
    tasks = {"wiki": wiki, "mc": {"acc,none": 0.5, "acc_norm,none": 0.4}}
    entry = {"kl_divergence": 0.01 * step, "top1_agreement": 0.9}
    reference = {"wiki": dict(entry), "mc": {**entry, "flips": 0.1}}
    return Run(Path("r"), "m", "none", 1, tasks, None, None, "f", reference=reference)


def test_each_metric_once_and_every_reference_metric_before_counts(tmp_path):
    """With a reference, the perplexity task reports KL and top-1 agreement itself: the table and the figure show
    each once (not again as the reference's "KL" and "top-1"), the task's metrics first, every metric that compares
    with the reference next, counts (n_tokens) last (before: both twice, and the 12 panels spent on n_tokens and
    a duplicate dropped top1_agreement)."""
    from distperp_harness.commands.series_plot import series_panels

    rows = [Row(f"s{i}", "p", 100 * i, Status.DONE) for i in (1, 2)]
    runs = {f"s{i}": _referenced_run(i) for i in (1, 2)}
    titles = [c.title for c in columns(list(runs.values()))]
    assert titles == [
        "mc acc", "mc acc_norm", "wiki token_perplexity", "wiki word_perplexity", "wiki byte_perplexity",
        "wiki bits_per_byte", "wiki kl_divergence", "wiki kl_p99", "wiki kl_max", "wiki top1_agreement",
        "wiki ref_token_perplexity", "wiki ln_ppl_ratio", "mc KL", "mc top-1", "mc flips", "wiki n_tokens",
    ]  # fmt: skip
    head = series_table(rows, runs).splitlines()[0]
    assert head.count("kl_divergence") + head.count("KL") == 2 and "wiki KL" not in head and "wiki top-1" not in head
    assert [c.title for c, _ in series_panels(rows, runs)] == titles  # 16 panels: all of them, the count last


# --- one watched series, a second watch, a 2-process resume ------------------------------------------------------


def _other_tokenizer(model_dir: Path, out: Path) -> Path:
    """The model with a tokenizer that lower-cases its input: the same vocabulary, other ids for some strings."""
    from tokenizers import normalizers
    from transformers import AutoTokenizer

    shutil.copytree(model_dir, out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    tokenizer.backend_tokenizer.normalizer = normalizers.Lowercase()
    tokenizer.save_pretrained(out)
    return out


def _series_args(watched, out, *more):
    return [
        "series", "--checkpoints", str(watched), "--tasks", TASKS, "--include_path", str(TASKS_DIR),
        "--model_args", "max_length=128", "--batch_size", "4", "--output_path", str(out), *more,
    ]  # fmt: skip


TASKS_DIR = Path(__file__).resolve().parents[1] / "tasks"


def _write_when(condition, action, deadline_s=120):
    def body():
        end = time.monotonic() + deadline_s
        while time.monotonic() < end and not condition():
            time.sleep(0.1)
        action()

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    return thread


def _rows(out):
    return {r.label: r for r in read_rows(out)} if (out / "series.json").exists() else {}


def _write_in_parts(source: Path, target: Path, pause_s: float) -> None:
    """Write the checkpoint ``source`` (sharded) to ``target`` as a slow trainer would: the small files first, each
    weight shard in two parts under a temporary name, renamed late, the index last, with a pause longer than the
    watch's settle time before every step."""
    target.mkdir()
    files = sorted(source.iterdir())
    for small in (f for f in files if not f.name.endswith((".safetensors", ".index.json"))):
        shutil.copy(small, target / small.name)
    for shard in (f for f in files if f.name.endswith(".safetensors")):
        data, temporary = shard.read_bytes(), target / f"{shard.name}.tmp"
        for part in (data[: len(data) // 2], data):
            time.sleep(pause_s)
            temporary.write_bytes(part)
        time.sleep(pause_s)
        temporary.rename(target / shard.name)
    time.sleep(pause_s)
    index = next(f for f in files if f.name.endswith(".index.json"))
    shutil.copy(index, target / index.name)


@pytest.fixture(scope="module")
def watched(tiny_model_dir, tmp_path_factory):
    """A watched run folder: step 100 (the test model, sharpened), 150 (whole weights, a config cut short: it cannot
    load), 200 (another tokenizer); step 300 is written in parts (:func:`_write_in_parts`) once the first result is
    in; step 150's config is rewritten (still cut short) after each of its failures, twice; then ``STOP``. One
    in-process watch (``--retries 1``), one intra-op thread (as each process of a 2-process CPU launch has);
    ``evaluated`` counts each checkpoint's evaluations."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from distperp_harness.commands import release, series

    root = tmp_path_factory.mktemp("series")
    run, out = root / "run", root / "out"
    sharpened_model(tiny_model_dir, run / "checkpoint-100", scale=4.0)
    shutil.copytree(run / "checkpoint-100", run / "checkpoint-150")
    (run / "checkpoint-150" / "config.json").write_text("{cut short")
    _other_tokenizer(run / "checkpoint-100", run / "checkpoint-200")
    later = sharpened_model(tiny_model_dir, root / "later", scale=2.0)
    sharded = root / "later-sharded"
    AutoModelForCausalLM.from_pretrained(later).save_pretrained(sharded, max_shard_size="250KB")
    AutoTokenizer.from_pretrained(later).save_pretrained(sharded)
    assert len(list(sharded.glob("*.safetensors"))) > 1 and (sharded / "model.safetensors.index.json").exists()
    evaluated: dict[str, int] = {}
    original, releases, was_released = series.evaluate_one, [], release.released

    def counted(series_, launch, checkpoint, collective):
        evaluated[checkpoint.label] = evaluated.get(checkpoint.label, 0) + 1
        return original(series_, launch, checkpoint, collective)

    def rewrite(text):
        return lambda: (run / "checkpoint-150" / "config.json").write_text(text)

    writers = [
        _write_when(
            lambda: "checkpoint-100" in _rows(out), lambda: _write_in_parts(sharded, run / "checkpoint-300", 1.0)
        ),
        _write_when(lambda: evaluated.get("checkpoint-150") == 1, rewrite("{still cut short")),
        _write_when(lambda: evaluated.get("checkpoint-150") == 2, rewrite("{cut short a third time")),
        _write_when(
            lambda: "checkpoint-300" in _rows(out) and evaluated.get("checkpoint-150") == 2,
            lambda: time.sleep(1.5) or (run / "STOP").write_text(""),  # the third config seen, not read again
        ),
    ]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(series, "evaluate_one", counted)
            patch.setattr(release, "released", lambda *a: releases.append(was_released(*a)) or releases[-1])
            args = _series_args(run, out, "--watch", "--poll", "0.3", "--settle", "0.6", "--retries", "1")
            assert main(args) == 3  # step 150 failed: every row written, then exit 3
    finally:
        torch.set_num_threads(threads)
    for writer in writers:
        writer.join(1)
    return {"run": run, "out": out, "root": root, "evaluated": evaluated, "releases": releases}


def _fingerprint(folder):
    return load_results(folder)["config"]["distperp"]["fingerprint"]


def test_watch_evaluates_each_checkpoint_once_and_the_failed_one_as_a_row(watched):
    """Each whole checkpoint once (step 300 only once its last shard was renamed and its index written: its results
    are those of the whole checkpoint, below), the failed one again after its files changed, at most once
    (``--retries 1``)."""
    assert watched["evaluated"] == {"checkpoint-100": 1, "checkpoint-150": 2, "checkpoint-200": 1, "checkpoint-300": 1}
    assert [r.ok for r in watched["releases"]] == [True] * 3  # each evaluated model collected before the next
    rows = _rows(watched["out"])
    assert sorted(rows) == ["checkpoint-100", "checkpoint-150", "checkpoint-200", "checkpoint-300"]
    assert rows["checkpoint-150"].status is Status.FAILED and "config" in rows["checkpoint-150"].reason
    assert all(rows[k].status is Status.DONE for k in ("checkpoint-100", "checkpoint-200", "checkpoint-300"))
    table = (watched["out"] / "series.md").read_text().splitlines()
    assert [line.split("|")[1].strip() for line in table[2:]] == ["100", "150", "200", "300"]
    assert "failed: " in table[3] and not (watched["out"] / ".resume" / "checkpoint-100").exists()
    # the encodings of step 100 are read back for step 300 (same tokenizer), never for step 200's tokenizer
    assert rows["checkpoint-200"].strings_reused == 0 and rows["checkpoint-200"].strings_encoded > 0
    assert rows["checkpoint-300"].strings_reused > 0 and rows["checkpoint-300"].strings_encoded == 0


def test_each_checkpoint_has_the_fingerprint_of_its_separate_evaluation(watched):
    import lm_eval
    from lm_eval.tasks import TaskManager

    for label in ("checkpoint-100", "checkpoint-200", "checkpoint-300"):
        results = lm_eval.simple_evaluate(
            model="distperp",
            model_args=f"pretrained={watched['run'] / label},max_length=128,batch_size=4",
            tasks=TASKS.split(","),
            task_manager=TaskManager(include_path=str(TASKS_DIR)),
        )
        ours = load_results(watched["out"] / label)
        assert ours["config"]["distperp"]["fingerprint"] == results["config"]["distperp"]["fingerprint"], label
        assert ours["results"] == json.loads(json.dumps(results["results"])), label


def test_a_second_watch_evaluates_nothing_again(watched, capsys):
    """A second watch skips what is done and tries the failed checkpoint again (it fails again): with
    ``--allow-failures`` its exit code is 0."""
    stamps = {p: p.stat().st_mtime_ns for p in watched["out"].rglob("results_*.json")}
    args = _series_args(watched["run"], watched["out"], "--watch", "--poll", "0.1", "--settle", "0.2")
    assert main([*args, "--allow-failures"]) == 0
    said = capsys.readouterr()
    assert "1 evaluated in this launch" in said.out  # the failed checkpoint, tried again
    assert {p: p.stat().st_mtime_ns for p in watched["out"].rglob("results_*.json")} == stamps


@pytest.mark.distributed
def test_two_processes_resume_a_stopped_series_with_the_same_fingerprints(watched, tmp_path):
    """A series stopped after its first checkpoint (its record and results folder, as the 1-process watch left
    them), resumed by a 2-process launch: the first is skipped; step 200 fails to load on rank 1 only (an injected
    fault, as a file missing on one node), which is one failed row on every rank, and step 300 after it gets the
    1-process fingerprint (the ranks' collectives still pair up)."""
    out = tmp_path / "out2"
    shutil.copytree(watched["out"] / "checkpoint-100", out / "checkpoint-100")
    first = read_rows(watched["out"])[0]
    (out / "series.json").write_text(json.dumps({"rows": [first.to_dict()]}))
    cmd = [*accelerate_launch_prefix(2), "-m", "distperp_harness", *_series_args(watched["run"], out)]
    proc = run_command(cmd, cwd=tmp_path, env={"DISTPERP_TEST_FAIL_LOAD": "1:1"}, check=False)  # rank 1: step 200
    # every row written, two failed: the ranks exit 3, which the launcher reports as its own 1 (any failed process)
    assert proc.returncode == 1 and "series: exit 3: 2 checkpoint(s) failed" in proc.stdout, proc.stderr[-3000:]
    assert "done already, skipped: checkpoint-100" in proc.stderr + proc.stdout
    rows = _rows(out)
    assert rows["checkpoint-150"].status is Status.FAILED
    assert rows["checkpoint-200"].status is Status.FAILED
    assert "rank 1" in rows["checkpoint-200"].reason and "injected failure" in rows["checkpoint-200"].reason
    assert not (out / "checkpoint-200").exists()
    two = load_results(out / "checkpoint-300")["config"]["distperp"]
    assert two["world_size"] == 2 and two["fingerprint"] == _fingerprint(watched["out"] / "checkpoint-300")


def test_checkpoint_labels_are_the_results_folders(watched):
    assert Checkpoint(watched["run"], Kind.MODEL, 1, "x").model_args(None) == {"pretrained": str(watched["run"])}
    assert sorted(p.name for p in watched["out"].iterdir() if p.is_dir() and not p.name.startswith(".")) == [
        "checkpoint-100",
        "checkpoint-200",
        "checkpoint-300",
    ]


# --- PEFT adapters of one base: the base read once ------------------------------------------------------------------


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory):
    """Two random LoRA adapters of the test model, as a sweep's outputs (``step_100``, ``step_200``)."""
    root = tmp_path_factory.mktemp("adapters")
    return [lora_adapter(tiny_model_dir, root / f"step_{100 * seed}", seed=seed) for seed in (1, 2)]


@pytest.fixture(scope="module")
def task_manager():
    """lm-eval's task index of distperp's and the test tasks' folders alone (the same YAML entries as the full
    index: those folders come last in it; a second faster)."""
    from lm_eval.tasks import TaskManager

    from distperp_harness.commands.taskdir import tasks_path

    return TaskManager(include_path=[str(tasks_path()), str(TASKS_DIR)], include_defaults=False)


@pytest.mark.parametrize("merge", ["true", "false"])
def test_adapters_of_one_base_read_it_once_with_the_bits_of_separate_runs(
    merge, adapters, task_manager, tiny_model_dir, tmp_path
):
    """Both adapters applied to one base read once (merged into it and restored, or unmerged and unloaded), each
    with the per-document results of ``pretrained=BASE,peft=ADAPTER`` evaluated alone."""
    import lm_eval

    from distperp_harness.model import loading

    read = []
    original = loading.load_model

    def counted(options, device, dtype, source=None, key="pretrained", **kwargs):
        read.append(source or options.pretrained)
        return original(options, device, dtype, source, key, **kwargs)

    out = tmp_path / "out"
    args = _series_args(",".join(map(str, adapters)), out, "--base", str(tiny_model_dir))
    args[args.index("max_length=128")] = f"max_length=128,merge_adapter={merge}"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(loading, "load_model", counted)
        assert main(args) == 0
    assert read == [str(tiny_model_dir)]  # one base for both adapters
    for adapter in adapters:
        alone = lm_eval.simple_evaluate(
            model="distperp",
            model_args=f"pretrained={tiny_model_dir},peft={adapter},merge_adapter={merge},max_length=128,batch_size=4",
            tasks=TASKS.split(","),
            task_manager=task_manager,
        )
        ours = load_results(out / adapter.name)
        assert ours["config"]["distperp"]["fingerprint"] == alone["config"]["distperp"]["fingerprint"], adapter.name
        assert ours["results"] == json.loads(json.dumps(alone["results"])), adapter.name
