"""What rank 0 prints: distperp's log format, and one progress bar counting scored tokens (tokens/s and ETA)."""

from __future__ import annotations

import logging
from typing import Callable


def token_progress(desc: str, is_main: bool) -> Callable[[int], Callable[[int], None]]:
    """Factory for :func:`distperp_harness.run.scoring.pipeline.score_requests`' ``progress`` argument.

    Rank 0's share of a balanced plan tracks the whole plan, so its bar's rate and ETA are the run's.
    """

    def start(total_tokens: int) -> Callable[[int], None]:
        if not is_main:
            return lambda n: None
        from accelerate.utils import tqdm

        bar = tqdm(
            total=total_tokens,
            desc=desc,
            unit="tok",
            unit_scale=True,
            main_process_only=True,
            dynamic_ncols=True,
            leave=False,
        )

        def update(n: int) -> None:
            bar.update(n)
            if bar.n >= total_tokens:
                bar.close()

        return update

    return start


QUIET: dict[str, tuple[str, ...]] = {  # logger -> the texts a dropped line holds, all of them
    "torch.utils._pytree": ("is an Enum subclass and is now natively supported",),
    "torchao": ("Skipping import of cpp extensions due to TORCHAO_FORCE_SKIP_LOADING_SO_FILES=1",),
    "lm_eval.api.task": ("distperp_wikitext", "Custom kwargs can be passed to `--metadata`"),
}
"""Dependencies' lines that nobody can act on, by logger: torch's deprecation note on the Enum types torchao
registers (twice per rank as torchao loads), torchao's echo of a variable the user (or the Makefile) set, and
lm-eval's advice to pass ``--metadata`` that it gives for every task with a data-loading function, here for
distperp's WikiText tasks (whose data options are documented). Every other line of these loggers passes."""


CUDA_ONLY = ("torchao", ("Failed to load ",))
"""torchao's warning for each of its CUDA kernel libraries that cannot load, dropped where no CUDA device exists
(on a CPU-only machine they cannot load, and nothing uses them); with a GPU the warning stays."""


class _Drop(logging.Filter):
    def __init__(self, texts: tuple[str, ...], unless_cuda: bool = False) -> None:
        super().__init__()
        self.texts, self.unless_cuda = texts, unless_cuda

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if not all(text in message for text in self.texts):
            return True
        if self.unless_cuda:
            import torch

            return torch.cuda.is_available()
        return False


def setup_logging() -> None:
    """INFO lines from distperp, formatted like lm-eval's; accelerate's logger keeps them on rank 0. The
    :data:`QUIET` lines of dependencies are dropped at their loggers, and :data:`CUDA_ONLY` where no CUDA device
    exists."""
    for name, texts, unless_cuda in [*((n, t, False) for n, t in QUIET.items()), (*CUDA_ONLY, True)]:
        target = logging.getLogger(name)
        if not any(isinstance(f, _Drop) and f.texts == texts for f in target.filters):
            target.addFilter(_Drop(texts, unless_cuda))
    logger = logging.getLogger("distperp_harness")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(
            logging.Formatter("%(asctime)s %(levelname)-8s [distperp] %(message)s", datefmt="%Y-%m-%d:%H:%M:%S")
        )
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False


def generation_progress(desc: str, is_main: bool) -> Callable[[int], Callable[[int, int], None]]:
    """Factory for :class:`~distperp_harness.run.generation.setup.GenerationSetup`'s ``progress``: rank 0's bar
    counts the prompts of its planned lanes as they finish, with generated tokens/s beside it (and tqdm's ETA)."""

    def start(total_prompts: int) -> Callable[[int, int], None]:
        if not is_main:
            return lambda prompts, tokens: None
        import time

        from accelerate.utils import tqdm

        bar = tqdm(
            total=total_prompts, desc=desc, unit="prompt", main_process_only=True, dynamic_ncols=True, leave=False
        )
        began, generated = time.perf_counter(), [0]

        def update(prompts: int, tokens: int) -> None:
            generated[0] += tokens
            bar.set_postfix_str(f"{generated[0] / max(1e-9, time.perf_counter() - began):.1f} tok/s", refresh=False)
            bar.update(prompts)
            if bar.n >= total_prompts:
                bar.close()

        return update

    return start
