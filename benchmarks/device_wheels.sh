#!/usr/bin/env bash
# Wheels for an offline GPU machine whose image has torch, transformers, accelerate and peft but not lm-eval, torchao
# or datasets (the project's device machines): the versions this checkout's .venv runs, for CPython 3.12 x86-64,
# into .whl/ (git-ignored). Then on the GPU machine: bash benchmarks/device_run.sh (carry .whl).
#
#   bash benchmarks/device_wheels.sh          # ~37 MB; needs the package registry (PyPI), run it here
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=.venv/bin/python
mkdir -p .whl
version() { "$PY" -c "import importlib.metadata as m; print(m.version('$1'))"; }
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
           --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
BINARY=(lm_eval datasets dill multiprocess evaluate pytablewriter DataProperty mbstrdecoder pathvalidate tabledata
        tcolorpy typepy chardet more-itertools pytz torchao transformers huggingface_hub accelerate kernels tokenizers
        httpx2 httpcore2 tomlkit defusedxml truststore click idna anyio nltk)
SOURCE_ONLY=(sqlitedict word2number rouge_score)  # no wheels on PyPI: built here (pure Python)
for pkg in "${BINARY[@]}"; do
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${PLATFORMS[@]}" -d .whl "$pkg==$(version "$pkg")"
done
for pkg in "${SOURCE_ONLY[@]}"; do
  "$PY" -m pip wheel -q --no-deps -w .whl "$pkg==$(version "$pkg")"
done
du -sh .whl
