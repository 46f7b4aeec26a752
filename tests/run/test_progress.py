"""The log: dependencies' lines nobody can act on are dropped at their loggers; everything else passes."""

import logging

from distperp_harness.run.progress import QUIET, setup_logging


def test_quiet_lines_are_dropped_and_others_pass():
    setup_logging()
    setup_logging()  # idempotent: one filter per logger
    for name, text in QUIET.items():
        logger = logging.getLogger(name)
        assert len(logger.filters) == 1
        drop = logger.makeRecord(name, logging.WARNING, __file__, 1, f"<enum 'X'> {text} ...", (), None)
        keep = logger.makeRecord(name, logging.WARNING, __file__, 1, "Failed to load kernel.so", (), None)
        assert not logger.filter(drop) and logger.filter(keep)
