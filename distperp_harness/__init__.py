"""distperp: an lm-evaluation-harness backend (``--model distperp``) for exact distributed log-likelihoods.

Importing this package is cheap: it imports neither torch nor lm-eval. The model class lives in
:mod:`distperp_harness.lm` and is registered lazily with lm-eval by :mod:`distperp_harness._hook`. The folders
below are the stages it wires (docs/design.md: Layout): ``planning``, ``run``, ``model``, ``distributed``,
``report``, and ``commands`` above the face.
"""

from distperp_harness.errors import InputError  # the exception for a value a user gave (stdlib only)

__version__ = "0.1.0"

MODEL_NAME = "distperp"
MODEL_TARGET = "distperp_harness.lm:DistPerpLM"
__all__ = ["InputError", "MODEL_NAME", "MODEL_TARGET"]
