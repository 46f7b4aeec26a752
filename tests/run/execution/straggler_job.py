"""A scoring call under ``accelerate launch`` for tests/run/execution/test_claims.py: rolling log-likelihoods of many
windows.

    python straggler_job.py MODEL_DIR OUT_JSON [EXTRA_MODEL_ARGS]

Rank 0 writes the call's record (``config.distperp.calls``), the fingerprint and every response to ``OUT_JSON``.
"""

import json
import sys

import torch

from distperp_harness.commands.tiny import sample_text
from tests.helpers import make_lm, score_rolling

torch.set_num_threads(1)
model_dir, out = sys.argv[1], sys.argv[2]
lm = make_lm(model_dir, ",max_length=128,batch_size=1" + (sys.argv[3] if len(sys.argv) > 3 else ""))
paragraphs = [p for p in sample_text().split("\n") if len(p) > 200]
texts = [paragraphs[k % len(paragraphs)][k % 7 :] * 2 for k in range(48)]
scores = score_rolling(lm, texts)
info = lm.get_model_info()["distperp"]
if lm.rank == 0:
    with open(out, "w") as f:
        json.dump(
            {"call": info["calls"][-1], "fingerprint": info["fingerprint"], "scores": [float(s) for s in scores]}, f
        )
