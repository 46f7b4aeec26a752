#!/usr/bin/env bash
# Everything one machine can check of distperp's GPU paths, in one command and one table file.
#
#   bash benchmarks/gpu_all.sh                    # CUDA (one GPU or more); meant to stay within 8 minutes on one H200
#   bash benchmarks/gpu_all.sh --device cpu       # dry mode on tiny models (runs in `make test`)
# (from any folder: it runs every step as `python -m benchmarks.<step>` from the repository root)
#   bash benchmarks/gpu_all.sh --out FILE         # where the table goes (default: gpu_all.md in a temp folder)
#   bash benchmarks/gpu_all.sh --only a,b         # only these steps (names below)
#   DISTPERP_GPU_ALL_WORK=DIR bash benchmarks/gpu_all.sh ...   # keep the logs, models and per-step JSON in DIR
#
# Steps, each with its own table and wall time appended to FILE:
#   1. gpu_check: bf16 and int4 through the real DistPerpLM (load/scoring peaks, budgets, tokens/s, MFU or
#      speed-up, same bits twice, every Linear quantized, memory released; 1 vs 2 processes with 2+ GPUs; an
#      MMLU-Pro-shaped tree-row case, sdpa vs flex_attention: tokens/s, scoring peak, chosen answers equal);
#   2. shard_check: sharded vs unsharded weights on 2+ processes (2+ GPUs; 2 CPU processes dry);
#   3. shard_check_one: the mesh of one (shard_check --processes 1): FSDP2 on a one-process device mesh, int4
#      loaded with quantization while loading and a bf16 reference; same bits as unsharded, peaks vs estimate;
#   4. bench_mc: multiple-choice shapes (mmlu0, hellaswag, mmlupro5), hf vs distperp vs share_prefix=false, on a
#      random Llama-3.2-1B-shaped model in float32 (chosen answers must equal hf's: a float32 check);
#   5. bench_scoring: rolling perplexity, hf vs distperp vs the bare forward, same model in bfloat16, tokens/s
#      and the allocator's scoring peak of hf and distperp.
#   6. tp_traffic (2+ GPUs): 1 GPU vs shard_size=2 vs tp_size=2 on the 1B-shaped model in bf16: bytes counted from
#      the collectives (NCCL), formulas checked, generation wall time, texts vs one GPU (make test runs its CPU smoke).
#   7. invariance: batch_invariant=true gives every document the same bits at batch_size 1, 3, 8 and auto (the test
#      model; on CUDA also gpu_check's 1B-shaped model in bfloat16); the default mode shown beside it.
#   8. generate (CUDA): greedy gsm8k-cot 8-shot (lm-eval's YAML), 128 prompts x 256 new tokens at 64 slots on
#      gpu_check's 1B-shaped model in bf16: hf vs distperp (CUDA graphs) vs cuda_graphs=false; new tokens/s, the
#      decode step run, reads of the device per forward, ms per forward, fraction of the memory floor (4,800 GB/s),
#      texts equal (benchmarks.bench_generate; make test runs it on CPU on the tiny model).
#   9. cli: the lm_eval CLI end to end, hf vs distperp, on gpu_check's 1B-shaped model in bf16: lm-eval's
#      leaderboard MMLU-Pro 5-shot on 1,000 local questions, rolling over 1M tokens of WikiText-2 articles (none a
#      copy), and an int4 row (int4_prefill=auto vs kernel) over 262k tokens: wall, request phase, rate, answers
#      (benchmarks.bench_cli; ~6-9 minutes alone: run it with --only cli when time is short).
#  10. check (CUDA, first): the user's self-check, `distperp check --device cuda` (load, bf16 and int4 scoring through
#      lm-eval, same bits twice, memory released, 1 vs 2 processes with 2+ GPUs); make test runs it on CPU.
# The CPU dry mode runs every step but check on tiny models: bench_mc and bench_scoring use a random model of the test
# model's shape instead of the 1B shape (said in the table). Text: ../shared/data/wikitext-2 when present, else
# copies of the packaged sample. Exits non-zero when any check fails; the table says which.
set -uo pipefail
DEVICE=cuda
OUT=""
ONLY=""
while [ $# -gt 0 ]; do
  case "$1" in
    --device) DEVICE="$2"; shift 2 ;;
    --out) OUT="$2"; shift 2 ;;
    --only) ONLY="$2"; shift 2 ;;
    *) echo "unknown argument: $1 (use --device cuda|cpu, --out FILE," \
            "--only check,gpu_check,shard_check,shard_check_one,bench_mc,tp_traffic,bench_scoring,invariance,generate,cli)" >&2; exit 2 ;;
  esac
done
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PY="${PYTHON:-python}"
case "$PY" in */*) PY="$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")" ;; esac
WORK="${DISTPERP_GPU_ALL_WORK:-$(mktemp -d -t distperp-gpu-all-XXXXXX)}"  # the tests read its JSON files
mkdir -p "$WORK" && WORK="$(cd "$WORK" && pwd)"
OUT="${OUT:-$WORK/gpu_all.md}"
OUT="$(cd "$(dirname "$OUT")" && pwd)/$(basename "$OUT")" || exit 2
cd "$HERE/.." || exit 2  # the paths above are absolute: every step runs as `python -m benchmarks.<step>` from here
# USE_HUB_KERNELS=0: transformers would swap layers for Hub kernels when a model loads onto the GPU (lm-eval hf too),
# which fails offline; distperp itself always loads with use_kernels=False
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false USE_HUB_KERNELS=0
[ "$DEVICE" = cpu ] && export TORCHAO_FORCE_SKIP_LOADING_SO_FILES=1
status=0
START=$SECONDS
{
  echo "# distperp gpu_all ($DEVICE), $(date -u +%Y-%m-%dT%H:%MZ)"
  [ "$DEVICE" = cuda ] && "$PY" -c 'import torch; print(f"# {torch.cuda.device_count()} x {torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}")'
} > "$OUT"

want() { [ -z "$ONLY" ] || [[ ",$ONLY," == *",$1,"* ]]; }

run() {  # name, command...: its table (lines starting with |, "1 vs 2", "mesh of one", "- name:" notes, the
         # header line with "·") goes to OUT; a failure (exit status, or DIFFER in the table) is recorded
  local name="$1"; shift
  want "$name" || return 0
  echo "" >> "$OUT"; echo "## $name" >> "$OUT"
  local log="$WORK/$name.log" t0=$SECONDS
  "$@" > "$log" 2>&1
  local rc=$?
  grep -E '^(\||1 vs 2|mesh of one|- [A-Za-z0-9_.-]+: |[0-9]{4}-[0-9]{2}-[0-9]{2} · )' "$log" >> "$OUT"
  if [ $rc -eq 0 ] && grep -qE '\bDIFFER(ENT)?\b|NOT SHARDED' "$log"; then rc=99; fi
  if [ $rc -ne 0 ]; then
    echo "FAILED (exit $rc, $((SECONDS - t0)) s): $*; log: $log" >> "$OUT"; tail -n 20 "$log" >> "$OUT"; status=1
  else
    echo "passed ($((SECONDS - t0)) s)" >> "$OUT"
  fi
}

# Text for the benchmarks: the shared WikiText-2 when this checkout sits next to it, else copies of the sample.
WIKI="$HERE/../../shared/data/wikitext-2"
if [ -f "$WIKI/test.txt" ] && [ -f "$WIKI/valid.txt" ]; then
  TEST_TEXT="$WIKI/test.txt"; VALID_TEXT="$WIKI/valid.txt"
else  # copies retitled and marked so no two windows are equal (distperp computes an identical window once)
  TEST_TEXT="$WORK/sample_copies.txt"; VALID_TEXT="$TEST_TEXT"
  "$PY" -c 'import sys; from benchmarks.common import write_sample_copies; write_sample_copies(sys.argv[1])' \
    "$TEST_TEXT"
fi

if [ "$DEVICE" = cpu ]; then
  run gpu_check "$PY" -m benchmarks.gpu_check --device cpu --processes 2 --tokens 1500 --work "$WORK/models" \
    --json "$WORK/gpu_check.json"
  run shard_check "$PY" -m benchmarks.shard_check --device cpu --runs int4 --work "$WORK/shard" \
    --json "$WORK/shard_check.json"
  run shard_check_one "$PY" -m benchmarks.shard_check --device cpu --processes 1 --runs int4 --tokens 300 \
    --work "$WORK/shard_one" --json "$WORK/shard_check_one.json"
  if want bench_mc || want bench_scoring; then
    printf '\n(cpu dry mode: bench_mc and bench_scoring use a random model of the tiny test shape, %s)\n' \
      "not the Llama-3.2-1B shape" >> "$OUT"
  fi
  run bench_mc "$PY" -m benchmarks.bench_mc --random-shape tiny --workdir "$WORK/random" --text "$VALID_TEXT" \
    --shapes mmlu0,hellaswag --questions 2 --repeats 1 --max-length 256 --batch-size 4
  run bench_scoring "$PY" -m benchmarks.bench_scoring --random-shape tiny --workdir "$WORK/random" \
    --text "$TEST_TEXT" --scorers hf,distperp,bare --tokens 400 --repeats 1 --max-length 128 --batch-size 4 --no-memory
  run invariance "$PY" -m benchmarks.invariance_check --device cpu --work "$WORK/invariance"
  run cli "$PY" -m benchmarks.bench_cli --device cpu --model "$WORK/models/check-llama" --questions 4 --tokens 2000 \
    --int4-tokens 1000 --max-length 128 --batch-size 4 --work "$WORK/cli" --json "$WORK/cli.json"
else
  run check "$PY" -m distperp_harness check --device cuda --work "$WORK/check" --json "$WORK/check.json"
  run gpu_check "$PY" -m benchmarks.gpu_check --device cuda --work "$WORK/models"
  if [ "$("$PY" -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
    run shard_check "$PY" -m benchmarks.shard_check --device cuda --work "$WORK/shard"
  elif want shard_check; then
    printf '\n## shard_check\nskipped: one GPU (shard_check_one below is its one-process mode)\n' >> "$OUT"
  fi
  ONE_MODEL=()  # reuse gpu_check's random Llama-3.2-1B-shaped model when it was built
  [ -f "$WORK/models/gpu-check-llama-1b/config.json" ] && ONE_MODEL=(--model "$WORK/models/gpu-check-llama-1b")
  run shard_check_one "$PY" -m benchmarks.shard_check --device cuda --processes 1 --runs int4 --tokens 8192 \
    ${ONE_MODEL[@]+"${ONE_MODEL[@]}"} --work "$WORK/shard_one"
  run bench_mc "$PY" -m benchmarks.bench_mc --random-shape llama-1b --device cuda --dtype float32 \
    --workdir "$WORK/random" --text "$VALID_TEXT" --shapes mmlu0,hellaswag,mmlupro5 --questions 24 --repeats 1 \
    --max-length 2048 --batch-size 8
  if [ "$("$PY" -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then  # TP needs a GPU per rank
    run tp_traffic "$PY" -m benchmarks.tp_traffic --size 2 --dtype bfloat16 --prompts 8 --new 64 \
      ${ONE_MODEL[@]+"${ONE_MODEL[@]}"}
  elif want tp_traffic; then
    printf '\n## tp_traffic\nskipped: one GPU (tensor parallelism needs a GPU per rank)\n' >> "$OUT"
  fi
  run bench_scoring "$PY" -m benchmarks.bench_scoring --random-shape llama-1b --device cuda --dtype bfloat16 \
    --workdir "$WORK/random" --text "$TEST_TEXT" --scorers hf,distperp,bare --tokens 16384 --repeats 2 \
    --max-length 2048 --batch-size 8 --memory-scorers hf,distperp --memory-tokens 8192
  run invariance "$PY" -m benchmarks.invariance_check --device cuda --work "$WORK/invariance"
  if [ ${#ONE_MODEL[@]} -gt 0 ] && want invariance; then
    run invariance_1b "$PY" -m benchmarks.invariance_check --device cuda --dtype bfloat16 "${ONE_MODEL[@]}" \
      --work "$WORK/invariance"
  fi
  if [ ${#ONE_MODEL[@]} -gt 0 ]; then
    run generate "$PY" -m benchmarks.bench_generate --model "$WORK/models/gpu-check-llama-1b" --device cuda \
      --dtype bfloat16 --shapes gsm8k_cot --prompts 128 --task-new 256 --batch-size 64 --repeats 1 \
      --backends hf,distperp,distperp-nographs --bandwidth 4800
  elif want generate; then
    printf '\n## generate\nskipped: needs gpu_check'"'"'s 1B-shaped model (run gpu_check first)\n' >> "$OUT"
  fi
  if [ ${#ONE_MODEL[@]} -gt 0 ]; then
    run cli "$PY" -m benchmarks.bench_cli --device cuda "${ONE_MODEL[@]}" --work "$WORK/cli" --json "$WORK/cli.json"
  elif want cli; then
    printf '\n## cli\nskipped: needs gpu_check'"'"'s 1B-shaped model (run gpu_check first)\n' >> "$OUT"
  fi
fi
echo -e "\ntotal: $((SECONDS - START)) s" >> "$OUT"
cat "$OUT"
echo "table: $OUT"
exit $status
