"""The project's benchmarks and device checks: run each from the repository root as ``python -m benchmarks.<name>``
(``benchmarks/README.md`` lists them). Modules whose names start with ``_`` and :mod:`benchmarks.common` are parts
the benchmarks import, not commands.

Importing the package sets the offline environment (:func:`benchmarks.common.use_offline_env`) before a benchmark
imports torch, transformers, lm-eval or tqdm, which read it when they are imported.
"""

from benchmarks.common import use_offline_env

use_offline_env()
