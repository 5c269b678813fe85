#!/usr/bin/env bash
# The open issues' H200 measurements in device calls of under 10 minutes each (one H200, the 8B preset). Each part
# packs what it wrote into $OUT/<part>.tgz (the device tool brings back at most 8 files). On a machine that is not
# an H200 the part refuses unless ANY_GPU=1: the issues' goals are stated for an H200.
#
#   bash scripts/gpu_acceptance.sh PART
#
#   long-prefix   issue 33: TTFT of the 36k and 111k prompts on an idle engine (cuDNN cascade on every chunk, chunk
#                 16,384, 3 fresh prompts each) and the inter-token latency of 64 decodes during a 111k prefill;
#                 then issue 29 offline: generated-shared-prefix (SGLang's defaults) caching on vs off, on with
#                 --scheduling-policy prefix and with an FP8 KV cache, and the ShareGPT sample on vs off (~530 s)
#   long-serve    issue 33 as its acceptance says: TTFT of 36k and 111k prompts through `spanllm serve`, one at a
#                 time on an idle server, 3 each, a new prompt each, the first the first ever, the server's own TTFT
#                 and queue time beside the client's (scripts/gpu_long_serve.sh; ~250 s)
#   serve         issue 29 through `spanllm serve`: GSP at SERVE_RATE req/s (1.25 x the offline off run's rate;
#                 default: the committed H200 run's, 13.8) on vs off, and multi-turn ShareGPT
#   fp8           issue 30: batch-1 decode and offline ShareGPT in FP8 (with an FP8 and a bf16 KV cache) and bf16,
#                 then the 8B's FP8 vs bf16 GEMM table (M = 1 ... 8192); PDL=1 adds --pdl off / on (with and
#                 without the weight prefetch) at batch 1
#   fp8-serve     issue 30: the `spanllm serve` rate sweep in FP8 beside bf16 on the same requests
#   validate      any Hopper GPU (no H200 needed): the GPU tests of PDL, FP8, the paged kernels and the engine
#                 (GPU_TESTS names others), with TMA=1 the FP8 decode GEMV with TMA loads and W as the MMA's A
#                 operand against production (scripts/gpu_fp8_tma.py), the fused quantization's crossover
#                 (scripts/gpu_fused_quant.py: what spanllm.layers.fp8.FUSED_QUANT_MIN_ROWS should say), its
#                 rows off torch's (scripts/gpu_fused_quant_check.py; FMA contraction was ruled out), and decode
#                 with PDL off / on / on without the prefetch, FP8 first (SKIP_PDL=1 leaves it out)
#   diagnose      any Hopper GPU: the cascade prefill's extra costs (scripts/gpu_cascade_probe.py: cuDNN's plan build
#                 at a new shape, GQA in cuDNN, the merge kernel against torch), its GPU tests, the fused FP8
#                 quantization's GPU test and mismatch check, and long-context TTFT (the long-prefix part's
#                 settings, with the profiled 111k prefill, no decodes beside it)
#   conversation  any Hopper GPU: a conversation's turns on an idle engine (each prompt the one before it plus new
#                 tokens, the conversation so far in the prefix cache; scripts/gpu_first_request.py --conversation):
#                 auto's cuDNN cascade with its cost model (the default) against it on every long-prefix chunk
#                 (--no-cascade-cost), twice each, and the paged kernel alone (--prefill-attention triton)
#   decode-launch any Hopper GPU: an FP8 cache widened to fp16 against bf16 (what paged_attention.FP8_DECODE_WIDEN
#                 should say), batch 1 at 256-1,024 keys by tile size and least tiles a split (MIN_TILES_PER_SPLIT),
#                 then the paged decode kernel's launch shapes by KV-cache dtype
#                 (scripts/gpu_decode_launch.py: what spanllm.kernels.paged_attention.DECODE_LAUNCH should say)
#   gemv          any Hopper GPU: the CUDA-core GEMV's launch configs against the skinny GEMM and F.linear at one row
#                 (scripts/gpu_gemv.py: what spanllm/kernels/gemv_configs.json should say), then batch-1 decode, FP8
#                 and bf16, with the committed tables and with the sweep's GEMV table (SPANLLM_GEMV_TABLE)
#   coverage      any Hopper GPU: code paths no GPU run had met: PDL on = off bit for bit over an FP8 KV cache and in
#                 fp16, the cascade prefill over an FP8 KV cache against the paged kernel (GPU tests), and an
#                 oversized --num-kv-blocks refused on the GPU (~5 min)
#   w8a8          any Hopper GPU: the Triton W8A8 GEMM's GPU tests, its sweep at decode batch sizes against
#                 torch._scaled_mm and W8A16 (scripts/gpu_w8a8_gemm.py: what spanllm/kernels/fp8_gemm_configs.json
#                 should say), then offline ShareGPT in FP8 with an FP8 KV cache, the committed table (empty: every W8A8
#                 GEMM on torch._scaled_mm, unless one is committed) against the sweep's (SPANLLM_FP8_GEMM_TABLE)
#   fp8-profile   any Hopper GPU: where an FP8 ShareGPT run's time goes (scripts/gpu_profile_steps.py: the step trace
#                 of the 1000 requests and kernel tables of decode at batch 1 / 256, prefill and mixed steps) with
#                 a bf16 (PROFILE_KV=auto) and an FP8 KV cache (fp8)
# Carry .whl (fastapi, uvicorn, pydantic, quicktok wheels for the GPU image).
set -u
cd "$(dirname "$0")/.."
PART=${1:?usage: bash scripts/gpu_acceptance.sh long-prefix|long-serve|serve|fp8|fp8-serve|validate|diagnose|fp8-profile|conversation|decode-launch|gemv|coverage|w8a8}
case "$PART" in  # an unknown part is refused before anything else is checked
  long-prefix | long-serve | serve | fp8 | fp8-serve | validate | diagnose | fp8-profile | conversation | \
  decode-launch | gemv | coverage | w8a8) ;;
  *) echo "unknown part $PART: one of long-prefix long-serve serve fp8 fp8-serve validate diagnose fp8-profile" \
    "conversation decode-launch gemv coverage w8a8"; exit 2 ;;
esac
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
echo "=== $PART on ${GPU:-no GPU}"
[ -n "$GPU" ] || { echo "no GPU here (nvidia-smi lists none): run it on the device machine"; exit 3; }
case "$GPU:$PART" in
  *H200*:*) ;;
  *H100*:validate | *H100*:diagnose | *H100*:fp8-profile | *H100*:decode-launch | *H100*:conversation | *H100*:gemv | \
  *H100*:coverage | *H100*:w8a8) ;;  # any Hopper
  *) [ "${ANY_GPU:-0}" = 1 ] || { echo "not an H200 ($GPU): the goals are an H200's; ANY_GPU=1 runs anyway"; exit 3; } ;;
esac
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
R=/tmp/acceptance_$PART
mkdir -p "$R"
pack() { [ -n "${OUT:-}" ] && tar czf "$OUT/$PART.tgz" -C "$R" . ; return 0; }
trap pack EXIT
# A run cut by `timeout` can leave its engine process behind, holding the GPU's memory (seen: 71 GiB, and the next
# run out of memory): before each part, and between a part's engine runs, wait for the GPU's processes to end and
# kill what is left after 20 s.
gpu_idle() {
  local i pids
  for i in $(seq 20); do
    pids=$(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null | tr -d ' ')
    [ -z "$pids" ] && return 0
    sleep 1
  done
  echo "killing leftover GPU processes: $pids"
  echo "$pids" | xargs -r kill -9
  sleep 2
}
gpu_idle
case "$PART" in
  long-prefix)
    timeout 215 python3 scripts/gpu_long_context.py "$R/long_context" \
      --prefill-config results/h100/long_context/best_prefill_config.json --prefill-attention cudnn-cascade \
      --cascade-min-prefix 0 --chunks 16384 --ttft-reps 3 --no-profile --budget-s 190 >"$R/long_context.log" 2>&1
    pack
    gpu_idle
    SKIP_SERVE=1 SHARED_PREFIX_ABLATION=0 KV8=1 BUDGET_S=330 bash scripts/gpu_prefix_cache.sh "$R/prefix_cache" \
      >"$R/prefix_cache.log" 2>&1
    grep -h "TTFT\|p99" "$R/long_context.log" | tail -6; tail -8 "$R/prefix_cache.log" ;;
  long-serve)
    timeout 420 bash scripts/gpu_long_serve.sh "$R/long_serve" >"$R/long_serve.log" 2>&1
    grep -h "TTFT" "$R/long_serve.log" ;;
  serve)
    # default: 1.25 x the committed H200 offline caching-off run's request rate (a fresh long-prefix run's
    # gsp_offline_off.json may say otherwise: pass SERVE_RATE then)
    OFF=results/h200/prefix_cache/gsp_offline_off.json
    SERVE_RATE=${SERVE_RATE:-$(python3 -c "import json; print(round(1.25 * json.load(open('$OFF'))['requests_per_second'], 2))")}
    echo "serve rate $SERVE_RATE req/s"
    SKIP_OFFLINE=1 SERVE_RATE=$SERVE_RATE BUDGET_S=540 \
      bash scripts/gpu_prefix_cache.sh "$R/prefix_cache" >"$R/prefix_cache.log" 2>&1
    tail -12 "$R/prefix_cache.log" ;;
  fp8)
    # the goals' runs first (a cut call keeps them), then the bf16 baselines, FP8 with a bf16 cache, the 8B's GEMM
    # table (FP8_STAGES names others: scripts/gpu_fp8.sh's stages); PDL=1 adds --pdl off / on at batch 1
    # (scripts/gpu_pdl.sh, ~120 s)
    # the device-to-device copy bandwidth that prices the batch-1 goal's weight-copy bound, measured in this call
    timeout 60 python3 -c "import json, sys, torch; from spanllm.commands.bench_gemm import copy_bandwidth
d = copy_bandwidth(1.0); d.update(gpu=torch.cuda.get_device_name(), torch=torch.__version__)
json.dump(d, open(sys.argv[1], 'w'), indent=1); print('device copy', round(d['TBps_read_plus_write'], 3), 'TB/s')" \
      "$R/copy_bandwidth.json" >"$R/copy.log" 2>&1
    # one stage at a time, packed after each (a call cut by its device time keeps what ran); no stage starts after
    # FP8_BUDGET_S seconds
    T0=$SECONDS
    for stage in ${FP8_STAGES:-decode1 throughput_kv8 throughput_bf16 decode1_bf16 throughput gemm}; do
      if [ $((SECONDS - T0)) -gt "${FP8_BUDGET_S:-420}" ]; then
        echo "=== $stage skipped: past FP8_BUDGET_S" >>"$R/fp8.log"; continue
      fi
      gpu_idle
      THROUGHPUT_TIMEOUT=110 GEMM_MODELS=8b GEMM_TIMEOUT=100 GEMM_DEADLINE=80 timeout 240 bash scripts/gpu_fp8.sh \
        "$R/fp8" "$stage" >>"$R/fp8.log" 2>&1
      pack
    done
    if [ "${PDL:-0}" = 1 ]; then
      gpu_idle
      BUDGET_S=120 bash scripts/gpu_pdl.sh "$R/pdl" decode >"$R/pdl.log" 2>&1
      tail -8 "$R/pdl/run.log"
    fi
    cat "$R/copy.log"; tail -20 "$R/fp8.log" ;;
  fp8-serve)
    ENGINE_FLAGS="--min-admit 32 --quantization fp8" RATES=16,32,inf NUM_PROMPTS=500 OVERHEAD=0 SWEEP_TIMEOUT=230 \
      SPANLLM_GPU_OUT="$R/fp8" bash scripts/gpu_serve_sweep.sh >"$R/fp8_serve.log" 2>&1
    ENGINE_FLAGS="--min-admit 32" RATES=16,32,inf NUM_PROMPTS=500 OVERHEAD=0 SWEEP_TIMEOUT=230 \
      SPANLLM_GPU_OUT="$R/bf16" bash scripts/gpu_serve_sweep.sh >"$R/bf16_serve.log" 2>&1
    tail -n 5 "$R/fp8_serve.log" "$R/bf16_serve.log" ;;
  validate)
    timeout ${PYTEST_TIMEOUT:-240} python3 -m pytest -q -p no:cacheprovider ${GPU_TESTS:-tests/engine/test_gpu_pdl.py \
      tests/engine/test_fp8.py tests/engine/test_gpu_paged.py tests/engine/test_gpu_engine.py} >"$R/pytest.txt" 2>&1
    TESTS_RC=$?
    pack
    gpu_idle
    if [ "${TMA:-0}" = 1 ]; then
      timeout 110 python3 scripts/gpu_fp8_tma.py "$R/tma" --budget-s 95 >"$R/tma.log" 2>&1
      pack
    fi
    timeout 110 python3 scripts/gpu_fused_quant.py "$R/fused" >"$R/fused.log" 2>&1
    pack
    gpu_idle
    # the fused quantization's rare rows off torch's, each chain against torch (results/h100/fp8/fused_quant/)
    timeout 60 python3 scripts/gpu_fused_quant_check.py "$R/fused_check" >"$R/fused_check.log" 2>&1
    pack
    gpu_idle
    [ "${SKIP_PDL:-0}" = 1 ] || BUDGET_S=${PDL_BUDGET_S:-200} bash scripts/gpu_pdl.sh "$R/pdl" decode >"$R/pdl.log" 2>&1
    grep -E "^E .*differ|passed|failed" "$R/pytest.txt" | tail -12; tail -16 "$R/fused.log"
    grep -h "bytes differ in rows \[[0-9]" "$R/fused_check.log" | head -12
    [ "${SKIP_PDL:-0}" = 1 ] || tail -12 "$R/pdl/run.log"
    [ "$TESTS_RC" = 0 ] || { echo "validate: the GPU tests FAILED (pytest rc $TESTS_RC, $R/pytest.txt)"; exit 1; } ;;
  diagnose)
    timeout 100 python3 scripts/gpu_cascade_probe.py "$R/cascade_probe" >"$R/cascade_probe.log" 2>&1
    pack
    gpu_idle
    timeout 120 python3 -m pytest -q -p no:cacheprovider tests/engine/test_gpu_cascade.py \
      "tests/engine/test_fp8.py::test_gpu_fused_activation_quantization_equals_the_unfused_chain" >"$R/pytest.txt" 2>&1
    timeout 60 python3 scripts/gpu_fused_quant_check.py "$R/fused_check" >"$R/fused_check.log" 2>&1
    pack
    gpu_idle
    timeout 260 python3 scripts/gpu_long_context.py "$R/long_context" \
      --prefill-config results/h100/long_context/best_prefill_config.json --prefill-attention cudnn-cascade \
      --cascade-min-prefix 0 --chunks 16384 --ttft-reps 3 --no-itl --budget-s 230 >"$R/long_context.log" 2>&1
    tail -5 "$R/cascade_probe.log"; grep -E "passed|failed" "$R/pytest.txt" | tail -3
    grep -h "differ" "$R/fused_check.log" | head -6; grep -i "ttft" "$R/long_context.log" | tail -6 ;;
  conversation)
    L=${CONV_LENGTHS:-50000,50300,50600,51600,53600,55600,57600,61600,61900}
    for run in a b; do
      for rule in cost always; do
        flag=""; [ $rule = always ] && flag=--no-cascade-cost
        timeout 150 python3 scripts/gpu_first_request.py "$R/${rule}_$run.json" --conversation --lengths $L \
          --probe '' $flag -- --model llama3.1-8b >"$R/${rule}_$run.log" 2>&1
        pack
      done
    done
    timeout 150 python3 scripts/gpu_first_request.py "$R/paged.json" --conversation --lengths $L --probe '' \
      -- --model llama3.1-8b --prefill-attention triton >"$R/paged.log" 2>&1
    for f in "$R"/*.log; do echo "== $(basename $f)"; grep -o "^[0-9]* tokens[^:]*: TTFT [0-9.]* s" "$f" | tr '\n' ';'; echo; done ;;
  coverage)
    timeout ${PYTEST_TIMEOUT:-330} python3 -m pytest -q -p no:cacheprovider -rfE --tb=short \
      "tests/engine/test_gpu_engine.py::test_pdl_on_equals_off_bit_for_bit" \
      "tests/engine/test_gpu_cascade.py::test_engine_short_prompt_after_a_long_cached_prefix" >"$R/pytest.txt" 2>&1
    TESTS_RC=$?
    pack
    gpu_idle
    # a pool far past the GPU's memory: refused with the numbers before any weight is loaded, no traceback
    timeout 150 torchrun --standalone --nproc-per-node 1 -m spanllm.cli bench throughput --model llama3.1-8b \
      --num-kv-blocks 100000000 --dataset-name random --input-len 16 --output-len 4 --num-prompts 1 \
      >"$R/num_kv_blocks.log" 2>&1
    echo "exit code $?" >>"$R/num_kv_blocks.log"
    grep -E "passed|failed|^FAILED|^ERROR" "$R/pytest.txt" | tail -12; grep -v "^W[0-9]" "$R/num_kv_blocks.log" | tail -4
    [ "$TESTS_RC" = 0 ] || { echo "coverage: the GPU tests FAILED (pytest rc $TESTS_RC, $R/pytest.txt)"; exit 1; } ;;
  decode-launch)
    # first the FP8 cache's two widenings at the launches the H100 sweep ranked first (what FP8_DECODE_WIDEN should
    # say), then the whole launch sweep
    timeout 90 python3 scripts/gpu_decode_launch.py "$R/decode_widen" --dtypes fp8 --widen fp16,bf16 \
      --launches 128x4x2,128x4x3,64x4x3,128x8x2 --budget-s 70 >"$R/decode_widen.log" 2>&1
    tail -4 "$R/decode_widen.log"
    pack
    gpu_idle
    # batch 1 at short contexts: latency, not bytes; how many key tiles a split takes (one each and a merge, or
    # all in one program) against the tile size
    timeout 60 python3 scripts/gpu_decode_launch.py "$R/decode_b1" --shapes 1x256,1x512,1x1024 --min-tiles 1,2,4 \
      --dtypes bf16 --launches 32x4x2,64x4x3,128x4x2 --budget-s 45 >"$R/decode_b1.log" 2>&1
    tail -8 "$R/decode_b1.log"
    pack
    gpu_idle
    timeout 200 python3 scripts/gpu_decode_launch.py "$R/decode_launch" --budget-s ${LAUNCH_BUDGET_S:-170} \
      >"$R/decode_launch.log" 2>&1
    tail -16 "$R/decode_launch.log" ;;
  fp8-profile)
    S=results/h200/inputs/sharegpt_llama3_seed0_n1000.json
    for kv in ${PROFILE_KV:-auto fp8}; do
      timeout ${PROFILE_TIMEOUT:-250} python3 scripts/gpu_profile_steps.py --model llama3.1-8b --quantization fp8 \
        --kv-cache-dtype $kv --samples-file $S --out "$R/profile_fp8_kv_$kv" >"$R/profile_fp8_kv_$kv.log" 2>&1
      pack
    done
    tail -4 "$R"/profile_fp8_kv_*.log ;;
  w8a8)
    timeout 100 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_fp8_gemm.py >"$R/pytest.txt" 2>&1
    tail -2 "$R/pytest.txt"
    timeout ${W8A8_TIMEOUT:-270} python3 scripts/gpu_w8a8_gemm.py "$R/w8a8" --ms ${W8A8_MS:-64,32,128,256} \
      --budget-s ${W8A8_BUDGET_S:-240} >"$R/w8a8.log" 2>&1
    pack
    grep -E "^8b" "$R/w8a8.log"
    T="$R/w8a8/fp8_gemm_configs.json"
    S=results/h200/inputs/sharegpt_llama3_seed0_n1000.json
    for t in ${W8A8_RUNS-committed sweep}; do  # W8A8_RUNS= (empty): no ShareGPT runs
      gpu_idle
      table=""; [ $t = sweep ] && table="$T"
      SPANLLM_FP8_GEMM_TABLE="$table" timeout 110 torchrun --standalone --nproc-per-node 1 -m spanllm.cli bench throughput \
        --model llama3.1-8b --quantization fp8 --kv-cache-dtype fp8 --num-prompts 1000 --samples-file $S \
        --json "$R/sharegpt_fp8_kv8_table_$t.json" >"$R/sharegpt_$t.log" 2>&1
      pack
      python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[1].split('/')[-1], round(d['output_tokens_per_second']), 'output tok/s')" \
        "$R/sharegpt_fp8_kv8_table_$t.json" 2>/dev/null || tail -3 "$R/sharegpt_$t.log"
    done ;;
  gemv)
    timeout ${GEMV_TIMEOUT:-230} python3 scripts/gpu_gemv.py "$R/gemv" --budget-s ${GEMV_BUDGET_S:-200} >"$R/gemv.log" 2>&1
    pack
    gpu_idle
    T="$R/gemv/gemv_configs.json"
    for q in ${GEMV_QUANTS:-fp8 bf16}; do
      qf=""; [ $q = fp8 ] && qf="--quantization fp8"
      for t in off on; do  # off: the committed tables; on: the sweep's GEMV table beside them
        [ $t = on ] && ! grep -q '"config"' "$T" 2>/dev/null && { echo "no GEMV table entries: decode $q with it skipped"; continue; }
        table=""; [ $t = on ] && table="$T"
        SPANLLM_GEMV_TABLE="$table" timeout 75 torchrun --standalone --nproc-per-node 1 -m spanllm.cli bench throughput \
          --model llama3.1-8b $qf --dataset-name random --input-len 128 --output-len 256 --num-prompts 1 \
          --max-num-seqs 16 --max-num-batched-tokens 2048 --json "$R/decode_b1_${q}_gemv_$t.json" >>"$R/decode.log" 2>&1
        pack
      done
    done
    grep -E "best gemv|skinny again" "$R/gemv.log" | head -24
    for f in "$R"/decode_b1_*.json; do
      [ -e "$f" ] || continue
      python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[1].split('/')[-1], round(d['median_itl_ms'], 3), 'ms')" "$f"
    done ;;
  *) echo "unknown part $PART"; exit 2 ;;
esac
