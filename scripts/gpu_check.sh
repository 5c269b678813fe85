#!/usr/bin/env bash
# The one entry point for GPU work: tests and benchmarks end to end on the GPUs of this host (its GPU count
# comes from torch; results go to results/gpu_run or $SPANLLM_GPU_OUT).
#
#   scripts/gpu_check.sh                 # every stage
#   scripts/gpu_check.sh env conformance # chosen stages
#
# Stages: env conformance timeout phases pytest tune bench gemm smoke engine engine70b study
# (the all-reduce and the TP / TP x PP study; 2 GPUs), and the serving engine's (one GPU is enough): paged
# (its GPU tests), gemm1 (decode GEMMs of the 8B at TP=1: cuBLAS vs skinny, and a config sweep), attention
# (bench attention), batch1 (bench batch, 8B at TP=1: decode-heavy rows on one GPU), throughput (bench throughput, ShareGPT), decode1 (batch-1 step), profile
# (scripts/gpu_profile_steps.py: kernel tables and a step trace), hfpeer (transformers' continuous batching on
# the same requests). Serving knobs: NUM_PROMPTS,
# TP_MODELS, SERVE_TP, SERVE_OPTS (extra engine flags), ATTN_BATCHES, ATTN_CTX, SAMPLES (requests saved by
# `bench throughput --save-samples`: the GPU machine cannot hold the 125 MB ShareGPT package;
# results/h200/inputs/sharegpt_llama3_seed0_n1000.json is vLLM's sampling of its recovered records).
# Knobs (environment): RPNS="2 1" topologies (ranks per node) for the comm stages; CONF_TIMEOUT, CALLS;
# ITERS / ROUNDS (bench: samples per row, interleaved over ROUNDS rounds); PROTOCOLS (tune); DECODE_GEMM (engine stages: torch or skinny,
# EngineConfig.decode_gemm; skinny files get a _skinny suffix); GEMM_SWEEP, GEMM_SWEEP_M (gemm stage);
# HF_DEADLINE (hfpeer: seconds before the peer's partial result, default 200; it finished 934 of 1000 in 200 s),
# STUDY_MODELS, STUDY_WORKLOADS, STUDY_BATCHES, STUDY_TIMEOUT, STUDY_PP / STUDY_MB (only these pipeline degrees /
# micro-batch counts: top up a cut study); B70_BATCHES, B70_DECODE_ONLY, BATCH_TIMEOUT;
# PROFILE_OPTS (profile: extra flags of scripts/gpu_profile_steps.py); BREAKDOWN_STEPS (eager GPU-time breakdown steps per row, default 8; each step waits behind a device spin);
# TUNING (default: this run's tables, else results/h200x2/tuning_*.json). Results go to
# results/gpu_run (or $SPANLLM_GPU_OUT); when the device tool's $OUT is set, everything is also packed
# into $OUT/gpu_results.tgz after each stage (the tool brings back only a few files). Every launch is
# wrapped in `timeout`, so a stage that overruns still leaves the earlier ones behind.
# Stage times measured on the GPU machines: results/h200x2/README.md (2 GPUs) and results/h200/README.md.
# A host with fewer GPUs than a stage needs skips that stage and says so (the multi-GPU stages need 2).
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# Never use NVLink multicast on the shared GPU hosts.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# NVSHMEM's symmetric heap defaults to 1 GiB per GPU; the conformance run holds several nvrar workspaces
# (each nvrar.describe()['workspace_MiB']), so give it room.
export NVSHMEM_SYMMETRIC_SIZE="${NVSHMEM_SYMMETRIC_SIZE:-8G}"
OUTDIR="${SPANLLM_GPU_OUT:-results/gpu_run}"
mkdir -p "$OUTDIR"
NGPU=$(python3 -c 'import torch; print(torch.cuda.device_count())')
STAGES=("$@")
[ ${#STAGES[@]} -eq 0 ] && STAGES=(env conformance timeout phases pytest tune bench gemm smoke engine engine70b study
                                   paged attention decode1 throughput)
# Stages that need 2 GPUs (two ranks: TP=2, or 2 virtual nodes); on a one-GPU host they are skipped, named.
MULTI_GPU_STAGES=" conformance timeout phases tune bench smoke engine engine70b study "
# Tuning tables: $TUNING if given, else this run's (the tune stage's) tables once they exist, else the
# committed ones. Decided at every use, so stages after `tune` use what it just measured.
USER_TUNING="${TUNING:-}"
pick_tuning() {
  TUNING="$USER_TUNING"
  if [ -z "$TUNING" ]; then
    if [ -f "$OUTDIR/tuning_rpn$NGPU.json" ] && [ -f "$OUTDIR/tuning_rpn1.json" ]; then
      TUNING="$OUTDIR/tuning_rpn$NGPU.json,$OUTDIR/tuning_rpn1.json"
    else
      TUNING="results/h200x2/tuning_1x2_bf16.json,results/h200x2/tuning_2x1_bf16.json"
    fi
  fi
}
pack() { [ -n "${OUT:-}" ] && tar -czf "$OUT/gpu_results.tgz" -C "$OUTDIR" . ; return 0; }
batch() {  # model workload batch-sizes iters
  pick_tuning
  timeout "${BATCH_TIMEOUT:-580}" $TR -m spanllm.cli bench batch --model "$1" --workload "$2" --batch-sizes "$3" --iters "$4" --breakdown-steps "${BREAKDOWN_STEPS:-8}" \
    --allreduce nccl,nvrar --tuning "$TUNING" --decode-gemm "$DGEMM" --json "$OUTDIR/batch_${1}_$2$GSUF.json" --plot "$OUTDIR/batch_${1}_$2$GSUF.png" || rc=1
}
TR="torchrun --standalone --nproc-per-node $NGPU"
DGEMM="${DECODE_GEMM:-torch}"
GSUF=""; [ "$DGEMM" = torch ] || GSUF="_$DGEMM"
log() { echo "=== $(date +%H:%M:%S) $*"; }
rc=0
SKIPPED=()
for stage in "${STAGES[@]}"; do
  if [ "$NGPU" -lt 2 ] && [[ "$MULTI_GPU_STAGES" == *" $stage "* ]]; then
    log "skip $stage: it needs 2 GPUs and this host has $NGPU"; SKIPPED+=("$stage"); continue
  fi
  case "$stage" in
    env)
      log env
      nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUTDIR/env.txt"
      nvidia-smi topo -m | tee -a "$OUTDIR/env.txt"
      python3 -c 'from spanllm.measure.report import versions; import json; print(json.dumps(versions()))' | tee -a "$OUTDIR/env.txt"
      ;;
    conformance)
      for rpn in ${RPNS:-$NGPU 1}; do
        log "conformance ranks_per_node=$rpn"
        timeout "${CONF_TIMEOUT:-400}" $TR scripts/gpu_allreduce_conformance.py --ranks-per-node "$rpn" --calls "${CALLS:-10000}" \
          --out "$OUTDIR/conformance_rpn$rpn.json" || { rc=1; log "conformance rpn=$rpn FAILED"; }
      done
      ;;
    timeout)
      for rpn in ${RPNS:-1 $NGPU}; do
        log "timeout ranks_per_node=$rpn"
        timeout 120 $TR scripts/gpu_nvrar_timeout.py --ranks-per-node "$rpn" --out "$OUTDIR/timeout_rpn$rpn.json" || true
      done
      ;;
    phases)
      pick_tuning
      for rpn in ${RPNS:-$NGPU 1}; do
        log "nvrar phase trace ranks_per_node=$rpn"
        timeout 200 $TR scripts/gpu_nvrar_phases.py --ranks-per-node "$rpn" --tuning "$TUNING" \
          --out "$OUTDIR/phases_rpn$rpn.json" || rc=1
      done
      ;;
    pytest)
      log "pytest -m gpu (every GPU test; multi-GPU cases skip on a smaller host)"
      # The GPU tests launch their own multi-process runs (tests/test_gpu.py: torchrun per case, over the GPUs
      # present; cases needing more GPUs skip with the reason); their JSON lands in $OUTDIR/pytest_runs.
      SPANLLM_GPU_OUT="$OUTDIR/pytest_runs" timeout "${PYTEST_TIMEOUT:-1500}" python3 -m pytest -q -rs -m gpu tests 2>&1 | tee "$OUTDIR/pytest_gpu.txt"; [ "${PIPESTATUS[0]}" = 0 ] || rc=1  # pytest's status, not tee's
      ;;
    bench)
      pick_tuning
      for rpn in ${RPNS:-$NGPU 1}; do
        log "bench allreduce ranks_per_node=$rpn"
        timeout 500 $TR -m spanllm.cli bench allreduce -b 1K -e 16M -f "${FACTOR:-2}" -n "${ITERS:-20}" --rounds "${ROUNDS:-4}" --dtype bfloat16 --graph \
          --ranks-per-node "$rpn" --algos "${ALGOS:-nccl,torch_one_shot,torch_two_shot,nvrar,auto}" \
          --tuning "$TUNING" --buffer-bytes 16M --json "$OUTDIR/allreduce_rpn$rpn.json" \
          --plot "$OUTDIR/allreduce_rpn$rpn.png" || rc=1
      done
      ;;
    tune)
      for rpn in ${RPNS:-$NGPU 1}; do
        log "tune ranks_per_node=$rpn"
        timeout 500 $TR -m spanllm.cli tune -b 1K -e 16M -f 2 --dtype bfloat16 --ranks-per-node "$rpn" --protocols "${PROTOCOLS:-ll8}" \
          --out "$OUTDIR/tuning_rpn$rpn.json" || rc=1
      done
      ;;
    gemm)
      # The decode weight GEMMs on one GPU: F.linear (cuBLAS) vs spanllm's skinny Triton kernel, 8B and
      # 70B shapes at TP=2, M = 1, 8, 16 (heuristic configs); then a config sweep for GEMM_SWEEP_M rows.
      log "gemm bench (heuristic configs)"
      timeout 200 python3 -m spanllm.cli bench gemm --models llama3.1-8b,llama3.1-70b --tp 2 --m 1,8,16 \
        --sweep none --json "$OUTDIR/gemm_decode_tp2.json" || rc=1
      if [ "${GEMM_SWEEP:-small}" != none ]; then
        log "gemm bench sweep (${GEMM_SWEEP:-small}, M=${GEMM_SWEEP_M:-1,8})"
        timeout "${GEMM_SWEEP_TIMEOUT:-240}" python3 -m spanllm.cli bench gemm --models "${GEMM_SWEEP_MODELS:-llama3.1-70b,llama3.1-8b}" --tp 2 \
          --m "${GEMM_SWEEP_M:-1,8}" --sweep "${GEMM_SWEEP:-small}" --copy-gib 0 --json "$OUTDIR/gemm_sweep_tp2.json" || rc=1
      fi
      ;;
    gemm1)
      # The serving engine's decode GEMMs (Llama 3.1 8B at TP=1, one GPU): F.linear vs the skinny kernel's
      # heuristic at M = 1..16, then a config sweep at GEMM_SWEEP_M rows (the rows of CONFIG_OVERRIDES).
      log "gemm bench, 8B TP=1 shapes (heuristic configs, then the ${GEMM_SWEEP:-small} sweep at M=${GEMM_SWEEP_M:-1,8})"
      timeout 200 python3 -m spanllm.cli bench gemm --models llama3.1-8b --tp 1 --m 1,2,4,8,16 \
        --sweep none --json "$OUTDIR/gemm_decode_tp1.json" || rc=1
      if [ "${GEMM_SWEEP:-small}" != none ]; then
        timeout "${GEMM_SWEEP_TIMEOUT:-240}" python3 -m spanllm.cli bench gemm --models llama3.1-8b --tp 1 \
          --m "${GEMM_SWEEP_M:-1,8}" --sweep "${GEMM_SWEEP:-small}" --copy-gib 0 --json "$OUTDIR/gemm_sweep_tp1.json" || rc=1
      fi
      ;;
    smoke)
      # A short engine run over both all-reduces (4 layers of 8B): checks the nvrar path inside the
      # engine (graph capture, tuning table) before the long stages.
      log "engine smoke"
      pick_tuning
      timeout 300 $TR -m spanllm.cli bench batch --model llama3.1-8b:layers=4 --batch-sizes 1,8 --decode-len 32 \
        --iters 1 --allreduce nccl,nvrar --tuning "$TUNING" --decode-gemm "$DGEMM" --json "$OUTDIR/smoke_8b_layers4$GSUF.json" || rc=1
      ;;
    engine)
      log "bench batch 8B"
      BATCH_TIMEOUT="${BATCH_TIMEOUT:-290}" batch llama3.1-8b decode-heavy "${B8_BATCHES:-1,8,32,64}" 3
      BATCH_TIMEOUT="${BATCH_TIMEOUT:-290}" batch llama3.1-8b prefill-heavy "${B8_BATCHES:-1,8,32,64}" 2
      ;;
    engine70b)
      log "bench batch 70B"
      batch llama3.1-70b decode-heavy "${B70_BATCHES:-1,8,32,64}" 1
      [ -n "${B70_DECODE_ONLY:-}" ] || batch llama3.1-70b prefill-heavy 1,8 1
      ;;
    study)
      pick_tuning
      for model in ${STUDY_MODELS:-llama3.1-8b llama3.1-70b}; do
        for wl in ${STUDY_WORKLOADS:-decode-heavy prefill-heavy}; do
          log "bench study $model $wl"
          timeout "${STUDY_TIMEOUT:-580}" $TR -m spanllm.cli bench study --model "$model" --workload "$wl" --batch-sizes "${STUDY_BATCHES:-1,8,64}" \
            --iters 1 --breakdown-steps "${BREAKDOWN_STEPS:-8}" --allreduce nccl,nvrar --tuning "$TUNING" --decode-gemm "$DGEMM" \
            ${STUDY_PP:+--pp "$STUDY_PP"} --micro-batches "${STUDY_MB:-1,pp}" \
            --json "$OUTDIR/study_${model}_$wl${STUDY_PP:+_pp$STUDY_PP}$GSUF.json" --plot "$OUTDIR/study_${model}_$wl${STUDY_PP:+_pp$STUDY_PP}$GSUF.png" || rc=1
        done
      done
      ;;
    paged)
      log "pytest: the engine's GPU tests (paged attention kernels, graphs, fixed batch vs serving engine)"
      timeout "${PAGED_TIMEOUT:-400}" python3 -m pytest -q -m gpu tests/engine/test_gpu_paged.py tests/engine/test_gpu_engine.py tests/engine/test_skinny_gemm.py 2>&1 | tee "$OUTDIR/pytest_gpu_paged.txt"; [ "${PIPESTATUS[0]}" = 0 ] || rc=1  # pytest's status, not tee's
      ;;
    batch1)
      log "bench batch 8B TP=1 decode-heavy (the fixed batch on the serving engine's worker)"
      timeout "${BATCH_TIMEOUT:-400}" torchrun --standalone --nproc-per-node 1 -m spanllm.cli bench batch --model llama3.1-8b \
        --workload decode-heavy --batch-sizes "${B1_BATCHES:-1,8,32,64}" --iters 3 --breakdown-steps "${BREAKDOWN_STEPS:-8}" \
        --decode-gemm "${DECODE_GEMM:-auto}" --json "$OUTDIR/batch_llama3.1-8b_decode-heavy_tp1.json" || rc=1
      ;;
    attention)
      log "bench attention (paged decode kernel vs reference vs contiguous SDPA)"
      timeout 300 torchrun --standalone --nproc-per-node 1 -m spanllm.cli bench attention \
        --batch-sizes "${ATTN_BATCHES:-1,4,16,64,256}" --context-lens "${ATTN_CTX:-128,512,2048,8192}" \
        --json "$OUTDIR/paged_attention.json" || rc=1
      ;;
    throughput)
      for model in ${TP_MODELS:-llama3.1-8b}; do
        log "bench throughput $model ShareGPT ${NUM_PROMPTS:-1000} prompts ${SERVE_OPTS:-}"
        timeout "${THROUGHPUT_TIMEOUT:-500}" torchrun --standalone --nproc-per-node "${SERVE_TP:-1}" -m spanllm.cli bench throughput \
          --model "$model" --num-prompts "${NUM_PROMPTS:-1000}" ${SAMPLES:+--samples-file "$SAMPLES"} ${SERVE_OPTS:-} --json "$OUTDIR/throughput_${model}${TP_SUFFIX:-}.json" || rc=1
      done
      ;;
    decode1)
      log "serving engine, batch-1 decode step (random 128-token prompt, 256 tokens, default settings)"
      timeout 300 torchrun --standalone --nproc-per-node 1 -m spanllm.cli bench throughput --model llama3.1-8b \
        --dataset-name random --input-len 128 --output-len 256 --num-prompts 1 ${SERVE_OPTS:-} --json "$OUTDIR/decode_b1_llama3.1-8b${TP_SUFFIX:-}.json" || rc=1
      ;;
    profile)
      log "where a serving step's time goes: kernel tables of decode and prefill steps, the ShareGPT step trace ${SERVE_OPTS:-}"
      timeout "${PROFILE_TIMEOUT:-300}" python3 scripts/gpu_profile_steps.py --model llama3.1-8b ${SAMPLES:+--samples-file "$SAMPLES"} \
        ${SERVE_OPTS:-} ${PROFILE_OPTS:-} --out "$OUTDIR/profile${TP_SUFFIX:-}" || rc=1
      ;;
    hfpeer)
      log "peer: transformers continuous batching on the same ShareGPT requests"
      timeout "${HF_TIMEOUT:-560}" python3 scripts/hf_continuous_batching_peer.py --model llama3.1-8b \
        --num-prompts "${NUM_PROMPTS:-1000}" ${SAMPLES:+--samples-file "$SAMPLES"} --deadline-s "${HF_DEADLINE:-200}" \
        --json "$OUTDIR/hf_continuous_batching_llama3.1-8b.json" || rc=1
      ;;
    *) echo "unknown stage $stage"; rc=2 ;;
  esac
  pack
done
[ ${#SKIPPED[@]} -gt 0 ] && log "skipped (need 2 GPUs): ${SKIPPED[*]}"
log "done rc=$rc"
exit $rc
