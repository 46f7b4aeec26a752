"""The package's folders are its stages, and imports walk down them (docs/design.md: Layout).

Every ``distperp_harness`` import between modules — at module level or inside a function — is an arrow. Between
folders every arrow points down :data:`LAYERS`; peers on one layer do not import each other; nothing but the
commands imports the lm-eval face (``lm``, ``docsplit``, ``tokens``). No circle at all, not even through a
function-local import.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "distperp_harness"

TOP_LEVEL: dict[str, str] = {
    # the modules left at the top of the package, and the unit each belongs to
    "__init__": "base",
    "options": "base",
    "errors": "base",  # leaves every layer may use: constants, the
    # validated model_args, the input-error type
    "lm": "face",
    "docsplit": "face",
    "tokens": "face",
    "stages": "face",
    "groupcalls": "face",
    "runfacts": "face",  # the lm-eval face, the stages it wires and its mixins
    "__main__": "entry",
    "_hook": "entry",  # ``python -m distperp_harness`` and the .pth registration hook
}
LAYERS: dict[str, int] = {
    # unit (a folder, or a group of top-level modules) -> layer; an arrow between units only reaches a lower layer
    "base": 0,
    "planning": 1,
    "distributed": 1,
    "model": 1,
    "report": 1,  # independent of each other
    "run": 2,
    "face": 3,
    "commands": 4,  # above the face: ``sweep`` builds DistPerpLM itself
    "entry": 5,
}
FOLDERS = set(LAYERS) - set(TOP_LEVEL.values())


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _unit(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "base"
    return TOP_LEVEL.get(parts[1], parts[1]) if len(parts) == 2 else parts[1]


def _is_package(module: str) -> bool:
    return (PACKAGE.parent / module.replace(".", "/") / "__init__.py").exists()


def import_edges() -> list[tuple[str, str, bool]]:
    """``(importer, imported, at_module_level)`` for every import of a ``distperp_harness`` module."""
    edges = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = _module_name(path)
        tree = ast.parse(path.read_text(), filename=str(path))
        local = {
            id(n)
            for f in ast.walk(tree)
            if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
            for n in ast.walk(f)
            if n is not f
        }
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                for alias in node.names:  # `from pkg import module` names a module; `from module import x` does not
                    full = f"{base}.{alias.name}"
                    candidate = PACKAGE.parent / full.replace(".", "/")
                    targets.append(full if candidate.with_suffix(".py").exists() or candidate.is_dir() else base)
            for target in targets:
                if target == "distperp_harness" or target.startswith("distperp_harness."):
                    if _is_package(target) and target != "distperp_harness":
                        continue  # a subpackage's __init__ only documents it
                    edges.append((module, target, id(node) not in local))
    return edges


def test_every_module_has_a_layer():
    top = {p.stem for p in PACKAGE.glob("*.py")}
    folders = {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    assert top <= set(TOP_LEVEL), f"place {sorted(top - set(TOP_LEVEL))} in TOP_LEVEL (and docs/design.md's Layout)"
    assert folders == FOLDERS, f"folders {sorted(folders)} differ from LAYERS' {sorted(FOLDERS)}"


def test_arrows_between_folders_point_down():
    upward = [(a, b) for a, b, _ in import_edges() if _unit(a) != _unit(b) and LAYERS[_unit(b)] >= LAYERS[_unit(a)]]
    assert upward == []


def test_only_commands_reach_the_face():
    into_face = [(a, b) for a, b, _ in import_edges() if _unit(b) == "face" and LAYERS[_unit(a)] < LAYERS["face"]]
    assert into_face == []


def _cycles(edges: list[tuple[str, str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    graph: dict[str, set[str]] = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)
        graph.setdefault(b, set())
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_circle_at_import_time():
    assert _cycles([(a, b) for a, b, top in import_edges() if top and a != b]) == []


def test_circles_stay_inside_one_folder():
    crossing = [c for c in _cycles([(a, b) for a, b, _ in import_edges() if a != b]) if len({_unit(m) for m in c}) > 1]
    assert crossing == []


def test_no_circle_at_all():
    """Not even through a function-local import: the commands' figure data sits below compare, sweep and plots."""
    assert _cycles([(a, b) for a, b, _ in import_edges() if a != b]) == []


def test_the_check_sees_arrows():
    edges = {(a, b) for a, b, _ in import_edges()}
    assert ("distperp_harness.run.scoring.pipeline", "distperp_harness.planning.plan") in edges
    assert ("distperp_harness.commands.sweep", "distperp_harness.lm") in edges  # function-local
    assert ("distperp_harness.model.quantize", "distperp_harness.options") in edges
    assert _cycles([("a", "b"), ("b", "c"), ("c", "a"), ("c", "d")]) == [["a", "b", "c"]]


RUN_LAYERS: dict[str, int] = {
    # run's folders and top-level modules -> layer; an arrow between two of them only reaches a lower layer
    "rules": 0,  # the rules a call is planned by: imports nothing of run
    "scoring.engine": 1,  # one batch's forward, masks and shared-prefix cache
    "compiling": 2,
    "budget": 2,
    "runtime": 2,
    "fit": 2,  # compile=, and the policy that chooses the rules and checks the fit
    "execution": 3,  # the executor both stages share
    "scoring": 4,
    "generation": 4,  # the two plans (a scoring call, generate_until), each above its engine
}


def _run_unit(module: str) -> str | None:
    """The unit of RUN_LAYERS a module of ``run`` belongs to (scoring's engine is a unit of its own)."""
    parts = module.split(".")
    if len(parts) < 3 or parts[1] != "run":
        return None
    return "scoring.engine" if parts[2:4] == ["scoring", "engine"] else parts[2]


def test_run_folders_are_its_stages_and_import_downward():
    run = PACKAGE / "run"
    units = {p.stem for p in run.glob("*.py")} - {"__init__"} | {p.parent.name for p in run.glob("*/__init__.py")}
    units |= {"scoring.engine"} if (run / "scoring" / "engine" / "__init__.py").exists() else set()
    assert units == set(RUN_LAYERS), f"place {sorted(units ^ set(RUN_LAYERS))} in RUN_LAYERS (and the README's layout)"
    arrows = {(_run_unit(a), _run_unit(b)) for a, b, _ in import_edges() if _run_unit(a) and _run_unit(b)}
    assert [(a, b) for a, b in arrows if a != b and RUN_LAYERS[b] >= RUN_LAYERS[a]] == []
    assert ("generation", "execution") in arrows and ("execution", "scoring.engine") in arrows  # the check sees them
    assert ("scoring", "scoring.engine") in arrows and ("scoring", "execution") in arrows


ENGINE = [
    "sampling",
    "thinking",
    "stats",
    "transfer",
    "scheduler",
    "choose",
    "masks",
    "prefill",
    "kv_batch",
    "group_decode",
    "static_batch",
    "step",
    "cudagraphs",
    "loop",
    "engines",
    "batchgen",
]
"""``run/generation/engine``'s modules, lowest first: each imports only modules before it (the per-row rules, the
scheduler, token choice, the KV batches and the steps below the loop, the engine choice above it)."""
PLAN = ["lanes", "jobs", "setup", "prompts", "lane_texts", "group_lane", "generate"]
"""``run/generation``'s own modules (the distributed plan), lowest first, above the whole engine."""
GENERATION = [*[f"engine.{m}" for m in ENGINE], *PLAN]


def test_generation_roles_import_downward():
    """Plan above engine: the engine's modules import nothing of the plan, and within each the order holds."""
    prefix = "distperp_harness.run.generation."
    folder = PACKAGE / "run" / "generation"
    assert {p.stem for p in folder.glob("*.py")} - {"__init__"} == set(PLAN), "place new modules in PLAN"
    assert {p.stem for p in (folder / "engine").glob("*.py")} - {"__init__"} == set(ENGINE), "place them in ENGINE"
    rank = {name: i for i, name in enumerate(GENERATION)}
    inside = [
        (a.removeprefix(prefix), b.removeprefix(prefix))
        for a, b, _ in import_edges()
        if a.startswith(prefix) and b.startswith(prefix) and a != prefix + "engine" and b != prefix + "engine"
    ]
    assert [(a, b) for a, b in inside if rank[b] >= rank[a]] == []
    assert [(a, b) for a, b in inside if a.startswith("engine.") and not b.startswith("engine.")] == []
    assert ("engine.loop", "engine.scheduler") in inside  # the check sees them
    assert ("generate", "engine.engines") in inside or any(a in PLAN and b.startswith("engine.") for a, b in inside)


def test_rules_sit_below_the_orchestrators():
    """The batching, sharing and scoring rules (``run.rules``) and the policy that chooses them (``run.budget``,
    ``run.runtime``) import neither orchestrator (``run.scoring.pipeline``, ``run.generation.generate``); ``rules``
    imports nothing of ``run``."""
    orchestrators = {"distperp_harness.run.scoring.pipeline", "distperp_harness.run.generation.generate"}
    edges = {(a, b) for a, b, _ in import_edges()}
    policy = {"distperp_harness.run.rules", "distperp_harness.run.budget", "distperp_harness.run.runtime"}
    assert [(a, b) for a, b in edges if a in policy and b in orchestrators] == []
    assert [b for a, b in edges if a == "distperp_harness.run.rules" and b.startswith("distperp_harness.run.")] == []
    assert ("distperp_harness.run.scoring.pipeline", "distperp_harness.run.rules") in edges


def test_tests_share_helpers_only_through_helpers():
    """A test module imports nothing from another test module: what several share lives in ``tests/helpers.py``."""
    tests = Path(__file__).resolve().parent
    offenders = []
    for path in sorted(tests.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            names += [a.name for a in node.names] if isinstance(node, ast.Import) else []
            offenders += [
                f"{path.relative_to(tests)} imports {name}"
                for name in names
                if (name.startswith("tests.") and name != "tests.helpers") or name.startswith("test_")
            ]
    assert offenders == []


def test_benchmarks_import_no_private_names_and_edit_no_sys_path():
    """The package's contract: benchmarks use the public names of ``distperp_harness`` only, and none of them puts
    a folder on ``sys.path`` (they run as ``python -m benchmarks.<name>`` from the repository root)."""
    offenders = []
    for path in sorted((PACKAGE.parent / "benchmarks").glob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("distperp_harness"):
                names = [node.module, *(a.name for a in node.names)]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names if a.name.startswith("distperp_harness")]
            else:
                names = []
            if any(part.startswith("_") for n in names for part in n.split(".")):
                offenders.append(f"{path.name}:{node.lineno} imports {names}")
            if isinstance(node, ast.Attribute) and node.attr == "path" and getattr(node.value, "id", "") == "sys":
                offenders.append(f"{path.name}:{node.lineno} uses sys.path")
    assert not offenders, offenders
