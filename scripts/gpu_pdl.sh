#!/usr/bin/env bash
# Programmatic dependent launch (spanllm.kernels.pdl) on one Hopper GPU: the 8B preset's decode with --pdl off vs on,
# bf16 and FP8, same call; then the GPU test that PDL changes no token or logit; then offline ShareGPT off vs on.
#
#   bash scripts/gpu_pdl.sh OUTDIR [stages...]     stages: decode tests fused throughput (default: all four)
#
# decode: `bench throughput` with one random 128-token prompt and 256 output tokens (the decode1 stage of
# scripts/gpu_fp8.sh) for {bf16, fp8} x {off, on, on_nopf (PDL without the weight prefetch)}, and with 16 of them
# (batch 16) in FP8: decode_b{1,16}_{bf16,fp8}_pdl_{off,on,on_nopf}.json (PDL_BATCHES, PDL_QUANTS and PDL_MODES choose
# fewer: e.g. PDL_BATCHES=1 PDL_QUANTS=bf16 PDL_MODES=on_nopf).
# tests: pytest_pdl.txt (with the fused FP8 activation quantization's GPU test). fused: scripts/gpu_fused_quant.py
# (fused_quant.json: the W8A8 input quantized by its producer vs a separate pass, PDL off / on). throughput: the committed 1000-request ShareGPT sample, FP8, off vs on:
# throughput_fp8_pdl_{off,on,on_nopf}.json (PDL_MODES too). Everything under BUDGET_S (540 s): a run that would not fit is skipped, said in run.log.
set -u
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUTDIR=${1:?usage: bash scripts/gpu_pdl.sh OUTDIR [stages...]}; shift
STAGES=("$@"); [ ${#STAGES[@]} -eq 0 ] && STAGES=(decode tests fused throughput)
BUDGET_S=${BUDGET_S:-540}
SAMPLES=${SAMPLES:-results/h200/inputs/sharegpt_llama3_seed0_n1000.json}
TR="torchrun --standalone --nproc-per-node 1"
mkdir -p "$OUTDIR"
LOG="$OUTDIR/run.log"
T0=$(date +%s)
log() { echo "=== +$(( $(date +%s) - T0 ))s $*" | tee -a "$LOG"; }
if ! python3 -c 'import quicktok' 2>/dev/null; then  # the Llama 3 presets' tokenizer, carried as a wheel in .whl/
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/quicktok_v1-*.whl >>"$LOG" 2>&1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv >>"$LOG" 2>&1
git rev-parse HEAD >>"$LOG" 2>/dev/null
step() {  # step NAME LIMIT CMD...: under timeout, never past the budget
  local name=$1 limit=$2; shift 2
  local left=$(( BUDGET_S - ($(date +%s) - T0) ))
  if [ "$left" -lt "$limit" ]; then log "$name SKIPPED: ${left}s of the ${BUDGET_S}s budget left, it needs up to ${limit}s"; return; fi
  log "$name: $*"
  timeout "$limit" "$@" >>"$LOG" 2>&1 || log "$name FAILED (rc $?)"
}
prefetch_bytes() { [ "$1" = on_nopf ] && echo 0 || echo $((16 << 20)); }  # on_nopf: PDL without the prefetch
for stage in "${STAGES[@]}"; do
  case $stage in
    decode)
      for batch in ${PDL_BATCHES:-1 16}; do
        for q in ${PDL_QUANTS:-fp8 bf16}; do  # FP8 first: batch-1 FP8 decode is what PDL is for (issue 30)
          [ $batch = 16 ] && [ $q = bf16 ] && continue  # batch 16: FP8 only (the time budget)
          qf=""; [ $q = fp8 ] && qf="--quantization fp8"
          for mode in ${PDL_MODES:-off on on_nopf}; do  # on_nopf: PDL without the skinny GEMM's weight prefetch
            step "decode b$batch $q pdl $mode" 90 env SPANLLM_SKINNY_PREFETCH_BYTES=$(prefetch_bytes $mode) \
              $TR -m spanllm.cli bench throughput --model llama3.1-8b $qf --pdl ${mode%_nopf} --dataset-name random --input-len 128 --output-len 256 --num-prompts $batch \
              --max-num-seqs 16 --max-num-batched-tokens 2048 --json "$OUTDIR/decode_b${batch}_${q}_pdl_$mode.json"
          done
        done
      done ;;
    tests)
      step "pytest pdl + fused quantization" 170 python3 -m pytest -q -p no:cacheprovider tests/engine/test_gpu_pdl.py \
        tests/engine/test_gpu_engine.py tests/engine/test_fp8.py -k "pdl or gpu_fused or gpu_quantize or gpu_fp8_linear"
      grep -E "passed|failed|error" "$LOG" | tail -2 >"$OUTDIR/pytest_pdl.txt" ;;
    fused)
      step "fused activation quantization" 120 python3 scripts/gpu_fused_quant.py "$OUTDIR" ;;
    throughput)
      for mode in ${PDL_MODES:-off on on_nopf}; do
        step "ShareGPT fp8 pdl $mode" 110 env SPANLLM_SKINNY_PREFETCH_BYTES=$(prefetch_bytes $mode) \
          $TR -m spanllm.cli bench throughput --model llama3.1-8b --quantization fp8 \
          --pdl ${mode%_nopf} --num-prompts 1000 --samples-file "$SAMPLES" --json "$OUTDIR/throughput_fp8_pdl_$mode.json"
      done ;;
  esac
done
python3 - "$OUTDIR" <<'PY' | tee -a "$LOG"
import glob, json, os, sys
for p in sorted(glob.glob(os.path.join(sys.argv[1], "*.json"))):
    d = json.load(open(p))
    print(f"{os.path.basename(p)}: median ITL {d.get('median_itl_ms', 0):.3f} ms, output {d.get('output_tokens_per_second', 0):.0f} tok/s")
PY
