#!/bin/bash
# On an offline GPU machine (the project's device machine), from the repository root with .whl/ carried
# (benchmarks/device_wheels.sh): install the wheels under /tmp/site, register --model distperp through
# sitecustomize (no pip install of the project), then run gpu_all.sh with its table and logs under $OUT.
#
#   GPU_ALL_S=480 GPU_ALL_ONLY=gpu_check,invariance bash benchmarks/device_run.sh
set -u
OUT="${OUT:-/tmp/distperp-device-out}"; mkdir -p "$OUT"
T0=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > $OUT/pip.log 2>&1 || { tail -20 $OUT/pip.log; exit 3; }
echo "try:
    import distperp_harness._hook  # registers --model distperp
except Exception:
    pass" > /tmp/site/sitecustomize.py
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
echo "install: $((SECONDS - T0)) s"
python3 -c "import torch, transformers, accelerate, lm_eval, torchao, datasets; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(), '| transformers', transformers.__version__, '| accelerate', accelerate.__version__, '| torchao', torchao.__version__, '| datasets', datasets.__version__)" 2>&1 | tail -3
python3 -c "import lm_eval.api.registry as r; print('distperp registered:', 'distperp' in r.model_registry)" 2>&1 | tail -2
mkdir -p /tmp/w
DISTPERP_GPU_ALL_WORK=/tmp/w PYTHON=python3 timeout ${GPU_ALL_S:-480} bash benchmarks/gpu_all.sh --out $OUT/gpu_all.md ${GPU_ALL_ONLY:+--only $GPU_ALL_ONLY}
echo "gpu_all rc=$? total $((SECONDS - T0)) s"
cp /tmp/w/gpu_check.json /tmp/w/invariance.log /tmp/w/gpu_check.log $OUT/ 2>/dev/null
tar czf $OUT/logs.tgz -C /tmp/w $(cd /tmp/w && ls *.log 2>/dev/null) 2>/dev/null
