#!/usr/bin/env bash
# The one entry point for GPU work: tests and benchmarks end to end on a machine with >= 2 GPUs.
#
#   scripts/gpu_check.sh                 # every stage
#   scripts/gpu_check.sh env conformance # chosen stages
#
# Stages: env conformance timeout pytest bench tune engine study. Results go to $OUT (the device
# tool's folder) or results/gpu_run. Every launch is wrapped in `timeout`, and results are written
# as each stage ends, so a stage that overruns still leaves the earlier ones behind.
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# Never use NVLink multicast on the shared GPU hosts.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# NVSHMEM's symmetric heap defaults to 1 GiB per GPU; the conformance run holds several nvrar workspaces
# (each nvrar.describe()['workspace_MiB']), so give it room.
export NVSHMEM_SYMMETRIC_SIZE="${NVSHMEM_SYMMETRIC_SIZE:-8G}"
OUTDIR="${OUT:-results/gpu_run}"
mkdir -p "$OUTDIR"
NGPU=$(python3 -c 'import torch; print(torch.cuda.device_count())')
STAGES=("$@")
[ ${#STAGES[@]} -eq 0 ] && STAGES=(env conformance timeout pytest bench tune engine study)
TR="torchrun --standalone --nproc-per-node $NGPU"
log() { echo "=== $(date +%H:%M:%S) $*"; }
rc=0
for stage in "${STAGES[@]}"; do
  case "$stage" in
    env)
      log env
      nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUTDIR/env.txt"
      nvidia-smi topo -m | tee -a "$OUTDIR/env.txt"
      python3 -c 'from spanllm.bench.report import versions; import json; print(json.dumps(versions()))' | tee -a "$OUTDIR/env.txt"
      ;;
    conformance)
      for rpn in "$NGPU" 1; do
        log "conformance ranks_per_node=$rpn"
        timeout "${CONF_TIMEOUT:-400}" $TR scripts/gpu_allreduce_conformance.py --ranks-per-node "$rpn" --calls "${CALLS:-10000}" \
          --out "$OUTDIR/conformance_rpn$rpn.json" || { rc=1; log "conformance rpn=$rpn FAILED"; }
      done
      ;;
    timeout)
      for rpn in 1 "$NGPU"; do
        log "timeout ranks_per_node=$rpn"
        timeout 120 $TR scripts/gpu_nvrar_timeout.py --ranks-per-node "$rpn" --out "$OUTDIR/timeout_rpn$rpn.json" || true
      done
      ;;
    pytest)
      log "pytest -m gpu (reads the conformance and timeout results)"
      SPANLLM_GPU_RESULTS="$OUTDIR" timeout 300 python3 -m pytest -q -m gpu tests 2>&1 | tee "$OUTDIR/pytest_gpu.txt" || rc=1
      ;;
    bench)
      for rpn in "$NGPU" 1; do
        log "bench allreduce ranks_per_node=$rpn"
        timeout 500 $TR -m spanllm.cli bench allreduce -b 1K -e 16M -f "${FACTOR:-2}" -n "${ITERS:-20}" --dtype bfloat16 --graph \
          --ranks-per-node "$rpn" --algos "${ALGOS:-nccl,torch_one_shot,torch_two_shot,nvrar,auto}" \
          ${TUNING:+--tuning $TUNING} --buffer-bytes 16M --json "$OUTDIR/allreduce_rpn$rpn.json" || rc=1
      done
      ;;
    tune)
      for rpn in "$NGPU" 1; do
        log "tune ranks_per_node=$rpn"
        timeout 500 $TR -m spanllm.cli tune -b 1K -e 16M -f 2 --dtype bfloat16 --ranks-per-node "$rpn" --protocols ll8,simple \
          --out "$OUTDIR/tuning_rpn$rpn.json" || rc=1
      done
      ;;
    engine)
      log "bench batch"
      timeout 580 $TR -m spanllm.cli bench batch ${ENGINE_ARGS:---model llama3.1-8b --allreduce nccl,nvrar} \
        --json "$OUTDIR/batch.json" --plot "$OUTDIR/batch.png" || rc=1
      ;;
    study)
      log "bench study"
      timeout 580 $TR -m spanllm.cli bench study ${STUDY_ARGS:---model llama3.1-8b} \
        --json "$OUTDIR/study.json" --plot "$OUTDIR/study.png" || rc=1
      ;;
    *) echo "unknown stage $stage"; rc=2 ;;
  esac
done
log "done rc=$rc"
exit $rc
