"""The log: dependencies' lines nobody can act on are dropped at their loggers; everything else passes."""

import logging

import pytest

from distperp_harness.run.execution.progress import CUDA_ONLY, QUIET, setup_logging


def _record(name, message):
    return logging.getLogger(name).makeRecord(name, logging.WARNING, __file__, 1, message, (), None)


def test_quiet_lines_are_dropped_and_others_pass():
    """Each quiet line is dropped where all its texts are present (lm-eval's --metadata advice: for distperp's
    WikiText tasks only); other lines of the same loggers pass."""
    setup_logging()
    setup_logging()  # idempotent: one filter per (logger, text)
    for name, texts in QUIET.items():
        logger = logging.getLogger(name)
        assert sum(f.texts == texts for f in logger.filters) == 1
        assert not logger.filter(_record(name, " ... ".join(texts)))
        assert len(texts) == 1 or logger.filter(_record(name, f"hellaswag: {texts[-1]}"))  # another task's
        assert logger.filter(_record(name, "Config is deprecated; use IntxWeightOnlyConfig"))


@pytest.mark.parametrize("cuda", [False, True])
def test_torchao_kernel_libraries_that_cannot_load_are_dropped_only_without_cuda(monkeypatch, cuda):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    setup_logging()
    name, (text,) = CUDA_ONLY
    logger = logging.getLogger(name)
    failed = _record(name, f"{text}/site-packages/torchao/_C_mxfp8.so: Could not load this library")
    assert logger.filter(failed) is cuda  # with a GPU, a kernel library that fails to load is worth a line
    assert logger.filter(_record(name, "Loading /site-packages/torchao/_C.so"))
