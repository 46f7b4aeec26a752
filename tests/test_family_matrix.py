"""The family matrix (``python -m benchmarks.family_matrix``): every family at its published settings through
``--model distperp`` (``batch_size=auto``: tree rows, padded batches, cached prefixes; rows across its thresholds)
against a float64 forward of the same weights, each unit alone: every family ends *fast and exact* or a *fallback*
with its reason, never wrong and never a crash. ``make test-matrix`` runs every causal LM type transformers registers.
Each run is a process of its own (the benchmarks set their quiet environment when imported)."""

import json
import sys

import pytest
from helpers import PUBLISHED, REPO_ROOT, run_command

FALLBACKS = {
    "gpt_neo": "nats from the unshared rows",  # its local layers' window is a buffer sliced by column
    "mpt": "nats from the unshared rows",  # ALiBi reads the column distance
    "bloom": "failed (ValueError",  # its ALiBi is built from a 2D mask: a tree's 4D mask is refused
    "llama4-floor-40": "nats from the unshared rows",  # the temperature tuning reads the column index
}
"""The families the probe must refuse tree rows for, and why; every other family is fast and exact."""


def _matrix(*args: str, timeout: float) -> dict[str, dict]:
    proc = run_command(
        [sys.executable, "-m", "benchmarks.family_matrix", *args, "--json"], cwd=REPO_ROOT, timeout=timeout, check=False
    )
    verdicts = {v["name"]: v for v in json.loads(proc.stdout.strip().splitlines()[-1])}
    assert proc.returncode == (1 if any(v["kind"] in ("WRONG", "CRASH") for v in verdicts.values()) else 0)
    return verdicts


@pytest.fixture(scope="module")
def published():
    return _matrix("--published", timeout=900)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_each_published_family_is_exact_fast_or_a_fallback_with_its_reason(published, name):
    verdict = published[name]
    assert verdict["kind"] in ("fast and exact", "fallback"), verdict
    expected = FALLBACKS.get(name)
    if expected is None:
        assert verdict["kind"] == "fast and exact", verdict
    else:
        assert verdict["kind"] == "fallback" and expected in verdict["why"], verdict


@pytest.mark.matrix
def test_every_registered_type_is_never_wrong_and_never_a_crash():
    verdicts = _matrix(timeout=3600)
    assert not [v for v in verdicts.values() if v["kind"] in ("WRONG", "CRASH")]
    assert sum(v["kind"] == "fast and exact" for v in verdicts.values()) >= 100
