"""What rank 0 prints: distperp's log format, and one progress bar counting padded tokens (tokens/s and ETA)."""

from __future__ import annotations

import logging
from typing import Callable


def token_progress(desc: str, is_main: bool) -> Callable[[int], Callable[[int], None]]:
    """Factory for :func:`distperp_harness.run.pipeline.score_requests`' ``progress`` argument.

    Rank 0's share of a balanced plan tracks the whole plan, so its bar's rate and ETA are the run's.
    """

    def start(total_tokens: int) -> Callable[[int], None]:
        if not is_main:
            return lambda n: None
        from accelerate.utils import tqdm

        bar = tqdm(total=total_tokens, desc=desc, unit="tok", unit_scale=True, main_process_only=True,
                   dynamic_ncols=True, leave=False)

        def update(n: int) -> None:
            bar.update(n)
            if bar.n >= total_tokens:
                bar.close()

        return update

    return start


def setup_logging() -> None:
    """INFO lines from distperp, formatted like lm-eval's; accelerate's logger keeps them on rank 0."""
    logger = logging.getLogger("distperp_harness")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)-8s [distperp] %(message)s",
                                               datefmt="%Y-%m-%d:%H:%M:%S"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
