#!/usr/bin/env bash
# FP8 on one GPU (issue 30): the W8A16 config sweep, the GEMM table, the FP8 GPU tests, and the 8B preset end to end
# in FP8 beside bf16 (same machine, same call).
#
#   scripts/gpu_fp8.sh OUTDIR [stages...]
#   stages: sweep gemm tests decode1 decode1_bf16 throughput throughput_bf16 throughput_kv8 batch1 (default: all but
#   the bf16 and kv8 ones; throughput_kv8: FP8 weights and an FP8 KV cache, --kv-cache-dtype fp8)
#
# sweep writes OUTDIR/skinny_gemm_configs.json (the committed table plus this GPU's FP8 entries); every later stage
# of the run uses it (SPANLLM_SKINNY_GEMM_TABLE, named in the engine's description line). FP8_TABLE=path uses
# another table without sweeping. Writes under OUTDIR: fp8_sweep.json, skinny_gemm_configs.json, fp8_gemm.json
# (scripts/gpu_fp8_gemm.py), pytest_fp8.txt, decode_b1_llama3.1-8b[_fp8].json, throughput_llama3.1-8b[_fp8].json
# (the committed ShareGPT sample), batch_llama3.1-8b_decode-heavy_tp1_fp8.json.
# Engine commands run under torchrun (one rank on the GPU: a local spawn would run the ranks on CPU over gloo).
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUTDIR="$1"; shift
mkdir -p "$OUTDIR"
STAGES=("$@")
[ ${#STAGES[@]} -eq 0 ] && STAGES=(sweep gemm tests decode1 throughput batch1)
SAMPLES="${SAMPLES:-results/h200/inputs/sharegpt_llama3_seed0_n1000.json}"
TR="torchrun --standalone --nproc-per-node 1"
# The Llama 3 presets tokenize with quicktok-v1; the GPU image lacks it: its wheel (carried in .whl/) goes to /tmp/site.
if ! python3 -c 'import quicktok' 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/quicktok_v1-*.whl && export PYTHONPATH="/tmp/site:$PYTHONPATH"
fi
log() { echo "=== $(date +%H:%M:%S) $*"; }
use_table() {
  local t="${FP8_TABLE:-$OUTDIR/skinny_gemm_configs.json}"
  if [ -f "$t" ]; then export SPANLLM_SKINNY_GEMM_TABLE="$t"; log "GEMM table: $t"; fi
}
use_table
rc=0
for stage in "${STAGES[@]}"; do
  case "$stage" in
    sweep)
      log "W8A16 launch configs at the 8B shapes (rows ${SWEEP_MS:-1,128,64,32,16})"
      timeout "${SWEEP_TIMEOUT:-330}" python3 scripts/gpu_fp8_gemm.py "$OUTDIR" --sweep --models "${SWEEP_MODELS:-8b}" \
        --sweep-ms "${SWEEP_MS:-1,128,64,32,16}" --deadline-s "${SWEEP_DEADLINE:-270}" || rc=1
      use_table ;;
    gemm)
      log "FP8 vs bf16 GEMMs, M = 1 ... 8192"
      timeout "${GEMM_TIMEOUT:-300}" python3 scripts/gpu_fp8_gemm.py "$OUTDIR" --models "${GEMM_MODELS:-8b,70b-tp2}" \
        --deadline-s "${GEMM_DEADLINE:-200}" || rc=1 ;;
    tests)
      log "FP8 GPU tests"
      timeout 300 python3 -m pytest -q -p no:cacheprovider tests/engine/test_fp8.py tests/engine/test_skinny_gemm.py \
        -k "gpu" 2>&1 | tail -30 | tee "$OUTDIR/pytest_fp8.txt" ;;
    decode1|decode1_bf16)
      q="--quantization fp8"; suf="_fp8"; [ "$stage" = decode1_bf16 ] && q="" && suf=""
      log "batch-1 decode $q"
      timeout 240 $TR -m spanllm.cli bench throughput --model llama3.1-8b $q --dataset-name random --input-len 128 \
        --output-len 256 --num-prompts 1 --json "$OUTDIR/decode_b1_llama3.1-8b$suf.json" || rc=1 ;;
    throughput|throughput_bf16|throughput_kv8)
      q="--quantization fp8"; suf="_fp8"; [ "$stage" = throughput_bf16 ] && q="" && suf=""
      [ "$stage" = throughput_kv8 ] && q="--quantization fp8 --kv-cache-dtype fp8" && suf="_fp8_kv8"
      log "ShareGPT offline $q ${SERVE_OPTS:-}"
      timeout "${THROUGHPUT_TIMEOUT:-300}" $TR -m spanllm.cli bench throughput --model llama3.1-8b $q --num-prompts 1000 \
        --samples-file "$SAMPLES" ${SERVE_OPTS:-} --json "$OUTDIR/throughput_llama3.1-8b$suf.json" || rc=1 ;;
    batch1)
      log "bench batch decode-heavy fp8 (TPOT and the decode breakdown)"
      timeout "${BATCH_TIMEOUT:-300}" $TR -m spanllm.cli bench batch --model llama3.1-8b --quantization fp8 \
        --workload decode-heavy --batch-sizes "${B1_BATCHES:-1,8,32,64}" --iters 3 --breakdown-steps 8 \
        --json "$OUTDIR/batch_llama3.1-8b_decode-heavy_tp1_fp8.json" || rc=1 ;;
    *) log "unknown stage $stage"; rc=1 ;;
  esac
done
exit $rc
