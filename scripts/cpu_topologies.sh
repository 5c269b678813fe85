#!/usr/bin/env bash
# CPU emulation of 4- and 8-GPU topologies (1, 2 and 4 nodes; more GPUs than the lab's GPU host) over
# local gloo ranks (virtual nodes).
#
# What it checks, not how fast: CPU timings say nothing about GPU speed. It shows that the
# hierarchical schedules run with exact results on every (nodes x ranks-per-node) split of 4 and 8
# ranks, and that the TP x PP layouts of the engine run and produce the same greedy tokens.
#
#   scripts/cpu_topologies.sh                       # all three parts
#   scripts/cpu_topologies.sh allreduce study       # a subset: allreduce | study | generate
#
# Environment: OUT_DIR (default results/cpu_emulation), ITERS / WARMUP (all-reduce timed samples and
# warm-up calls per size, default 5 / 2), DTYPE (all-reduce dtype, default bfloat16).
#
# Parts (JSON, PNG where the command has --plot, and one .log per command under OUT_DIR):
#   allreduce  `spanllm bench allreduce`, 1 KiB - 1 MiB x4, every CPU algorithm in one run, for
#              world 4 as 1x4, 2x2, 4x1 and world 8 as 1x8, 2x4, 4x2, 8x1. Fails unless every
#              row has wrong == 0 and every algorithm produced a row for every size.
#   study      `spanllm bench study --model tiny`, batch 4, prompt 16, decode 8, gloo and ref_hier:
#              world 4 as 2x2 (TP=4, TP=2xPP=2, PP=4), world 8 as 2x4 (TP=8, TP=4xPP=2, TP=2xPP=4;
#              PP=8 is skipped by the study: tiny has 4 layers).
#   generate   (a) `spanllm generate --model tiny ... --nprocs 8` (TP=8, random weights) with gloo on
#              1x8 and ref_hier on 2x4 / 8x1: same tokens required (the random weights of a preset
#              depend on the layout, so only runs of one layout are comparable).
#              (b) a small Llama checkpoint written by transformers (8 layers, 8 query / 4 KV heads,
#              vocab 500) so that every layout holds the same weights: greedy tokens of every 4- and
#              8-rank layout (TP, TP x PP with 1 and 2 micro-batches, PP) over ref_hier / gloo on
#              several virtual-node splits must equal transformers' own greedy generate.
set -uo pipefail

cd "$(dirname "$0")/.."
OUT_DIR=${OUT_DIR:-results/cpu_emulation}
ITERS=${ITERS:-5}
WARMUP=${WARMUP:-2}
DTYPE=${DTYPE:-bfloat16}
ALGOS=ref_ring,ref_rd,ref_hier,gloo,auto # every registered algorithm whose capability includes cpu
PARTS=("$@")
[ ${#PARTS[@]} -eq 0 ] && PARTS=(allreduce study generate)
mkdir -p "$OUT_DIR"

FAILED=()
TIMINGS="$OUT_DIR/timings.tsv"
# A run of all parts starts the timing table afresh; a subset appends to it.
if [ $# -eq 0 ] || [ ! -f "$TIMINGS" ]; then printf 'step\tseconds\texit\n' >"$TIMINGS"; fi
T_ALL=$SECONDS

want() { local p; for p in "${PARTS[@]}"; do [ "$p" = "$1" ] && return 0; done; return 1; }

# step NAME CMD...: run CMD, output to NAME.log (and the terminal), time it, remember a failure.
step() {
    local name=$1; shift
    local t0=$SECONDS rc
    echo "=== $name: $*" | tee "$OUT_DIR/$name.log"
    "$@" 2>&1 | tee -a "$OUT_DIR/$name.log"
    rc=${PIPESTATUS[0]}
    printf '%s\t%d\t%d\n' "$name" $((SECONDS - t0)) "$rc" >>"$TIMINGS"
    echo "=== $name: exit $rc after $((SECONDS - t0)) s" | tee -a "$OUT_DIR/$name.log"
    [ "$rc" -eq 0 ] || FAILED+=("$name (exit $rc)")
    return "$rc"
}

# ---------------------------------------------------------------------------------------------- all-reduce
if want allreduce; then
    for spec in 4:4 4:2 4:1 8:8 8:4 8:2 8:1; do
        n=${spec%:*}; g=${spec#*:}
        name="allreduce_$((n / g))x${g}_${DTYPE}"
        step "$name" spanllm bench allreduce --nprocs "$n" --ranks-per-node "$g" -b 1K -e 1M -f 4 \
            --dtype "$DTYPE" --algos "$ALGOS" -n "$ITERS" -w "$WARMUP" \
            --json "$OUT_DIR/$name.json" --plot "$OUT_DIR/$name.png"
        # Independent check of the JSON: every row wrong == 0, every algorithm x size present.
        if ! (python - "$OUT_DIR/$name.json" "$ALGOS" "$n" "$g" <<'EOF'
import json, sys
path, algos, n, g = sys.argv[1], sys.argv[2].split(","), int(sys.argv[3]), int(sys.argv[4])
rows = json.load(open(path))["rows"]
sizes = [1024 * 4 ** i for i in range(6)]  # 1K .. 1M, factor 4
bad = [r for r in rows if r["wrong"] != 0]
have = {(r["algo"], r["size"]) for r in rows}
missing = [(a, s) for a in algos for s in sizes if (a, s) not in have]
topo = {(r["world_size"], r["ranks_per_node"]) for r in rows}
for r in bad:
    print(f"WRONG: {r['algo']} ({r['ran']}) size {r['size']}: {r['wrong']} wrong elements")
if missing:
    print(f"MISSING rows (algo, bytes): {missing}")
if topo != {(n, g)}:
    print(f"TOPOLOGY mismatch: rows say {topo}, asked for {(n, g)}")
print(f"check {path}: {len(rows)} rows, {len(bad)} with wrong != 0, {len(missing)} missing")
sys.exit(1 if bad or missing or topo != {(n, g)} or not rows else 0)
EOF
        ) 2>&1 | tee -a "$OUT_DIR/$name.log"; then FAILED+=("$name: JSON check"); fi
    done
fi

# ---------------------------------------------------------------------------------------------- study
if want study; then
    for spec in 4:2 8:4; do
        n=${spec%:*}; g=${spec#*:}
        name="study_tiny_w${n}_$((n / g))x${g}"
        step "$name" spanllm bench study --model tiny --nprocs "$n" --ranks-per-node "$g" --batch-sizes 4 \
            --prompt-len 16 --decode-len 8 --allreduce gloo,ref_hier --warmup 1 --iters 2 --breakdown-steps 4 \
            --json "$OUT_DIR/$name.json" --plot "$OUT_DIR/$name.png"
    done
fi

# ---------------------------------------------------------------------------------------------- generate
GEN_TSV="$OUT_DIR/.generate_runs.tsv"
# gen NAME MODEL_KEY NPROCS ARGS...: run `spanllm generate`, record its generated ids per prompt.
gen() {
    local name=$1 key=$2 n=$3; shift 3
    step "$name" spanllm generate --nprocs "$n" "$@"
    local ids
    ids=$(grep -E '^\[[0-9]+\] generated ids:' "$OUT_DIR/$name.log" | sed 's/^\[[0-9]*\] generated ids: //' | paste -sd';')
    printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$key" "$n" "$*" "$ids" >>"$GEN_TSV"
}

if want generate; then
    : >"$GEN_TSV"
    # (a) the tiny preset (random weights) at TP=8: the command of the brief, then other all-reduce / splits.
    gen generate_tiny_tp8_1x8_gloo tiny 8 --model tiny --prompt-ids 1,2,3 --max-new-tokens 8
    gen generate_tiny_tp8_2x4_ref_hier tiny 8 --model tiny --prompt-ids 1,2,3 --max-new-tokens 8 \
        --ranks-per-node 4 --allreduce ref_hier
    gen generate_tiny_tp8_8x1_ref_hier tiny 8 --model tiny --prompt-ids 1,2,3 --max-new-tokens 8 \
        --ranks-per-node 1 --allreduce ref_hier

    # (b) one checkpoint for every layout.
    CKPT=$(mktemp -d)
    export CKPT
    trap 'rm -rf "$CKPT"' EXIT
    t0=$SECONDS
    if ! python - "$CKPT" "$OUT_DIR/.hf_reference.json" <<'EOF' >"$OUT_DIR/checkpoint.log" 2>&1
import json, sys, torch, transformers
out, ref_path = sys.argv[1], sys.argv[2]
kw = dict(vocab_size=500, hidden_size=128, intermediate_size=256, num_hidden_layers=8, num_attention_heads=8,
          num_key_value_heads=4, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-5, initializer_range=0.08,
          rope_theta=500000.0, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
          rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                        "original_max_position_embeddings": 32})
torch.manual_seed(1234)
m = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kw)).eval()
m.save_pretrained(out, safe_serialization=True)
ref = []
with torch.no_grad():
    for p in ([1, 2, 3], [5, 17, 42, 8, 99]):
        ids = torch.tensor([p])
        g = m.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=8,
                       eos_token_id=None, pad_token_id=0)
        ref.append(g[0, len(p):].tolist())
json.dump({"config": kw, "transformers": transformers.__version__, "prompts": [[1, 2, 3], [5, 17, 42, 8, 99]],
           "tokens": ref}, open(ref_path, "w"))
print("hf greedy:", ref)
EOF
    then
        FAILED+=("checkpoint (see $OUT_DIR/checkpoint.log)")
    fi
    printf '%s\t%d\t%d\n' checkpoint $((SECONDS - t0)) 0 >>"$TIMINGS"
    P=(--model "$CKPT" --prompt-ids 1,2,3 --prompt-ids 5,17,42,8,99 --max-new-tokens 8 --ignore-eos)
    gen generate_ckpt_w1 ckpt 1 "${P[@]}"
    # world 4 (TP group topology in brackets)
    gen generate_ckpt_w4_1x4_tp4_ref_hier ckpt 4 "${P[@]}" --ranks-per-node 4 --tp 4 --allreduce ref_hier
    gen generate_ckpt_w4_2x2_tp4_ref_hier ckpt 4 "${P[@]}" --ranks-per-node 2 --tp 4 --allreduce ref_hier
    gen generate_ckpt_w4_2x2_tp4_gloo ckpt 4 "${P[@]}" --ranks-per-node 2 --tp 4 --allreduce gloo
    gen generate_ckpt_w4_4x1_tp4_ref_hier ckpt 4 "${P[@]}" --ranks-per-node 1 --tp 4 --allreduce ref_hier
    gen generate_ckpt_w4_2x2_tp2pp2_mb2_ref_hier ckpt 4 "${P[@]}" --ranks-per-node 2 --tp 2 --pp 2 \
        --micro-batches 2 --allreduce ref_hier
    gen generate_ckpt_w4_2x2_pp4 ckpt 4 "${P[@]}" --ranks-per-node 2 --tp 1 --pp 4
    # world 8
    gen generate_ckpt_w8_1x8_tp8_ref_hier ckpt 8 "${P[@]}" --ranks-per-node 8 --tp 8 --allreduce ref_hier
    gen generate_ckpt_w8_2x4_tp8_ref_hier ckpt 8 "${P[@]}" --ranks-per-node 4 --tp 8 --allreduce ref_hier
    gen generate_ckpt_w8_2x4_tp8_gloo ckpt 8 "${P[@]}" --ranks-per-node 4 --tp 8 --allreduce gloo
    gen generate_ckpt_w8_4x2_tp8_ref_hier ckpt 8 "${P[@]}" --ranks-per-node 2 --tp 8 --allreduce ref_hier
    gen generate_ckpt_w8_8x1_tp8_ref_hier ckpt 8 "${P[@]}" --ranks-per-node 1 --tp 8 --allreduce ref_hier
    gen generate_ckpt_w8_2x4_tp4pp2_ref_hier ckpt 8 "${P[@]}" --ranks-per-node 4 --tp 4 --pp 2 --allreduce ref_hier
    gen generate_ckpt_w8_4x2_tp4pp2_mb2_ref_hier ckpt 8 "${P[@]}" --ranks-per-node 2 --tp 4 --pp 2 \
        --micro-batches 2 --allreduce ref_hier
    gen generate_ckpt_w8_2x4_tp2pp4_mb2_ref_hier ckpt 8 "${P[@]}" --ranks-per-node 4 --tp 2 --pp 4 \
        --micro-batches 2 --allreduce ref_hier
    gen generate_ckpt_w8_2x4_pp8 ckpt 8 "${P[@]}" --ranks-per-node 4 --tp 1 --pp 8

    # Agreement: checkpoint runs == transformers' greedy tokens; tiny runs == each other.
    if ! python - "$GEN_TSV" "$OUT_DIR/.hf_reference.json" "$OUT_DIR/generate_agreement.json" <<'EOF'
import json, os, sys
tsv, ref_path, out = sys.argv[1:4]
ref = json.load(open(ref_path)) if os.path.exists(ref_path) else None
runs = []
for line in open(tsv):
    name, key, n, args, ids = line.rstrip("\n").split("\t")
    toks = [[int(t) for t in s.split(",")] for s in ids.split(";")] if ids else []
    runs.append({"name": name, "model": key, "nprocs": int(n), "args": args, "tokens": toks})
tiny = [r for r in runs if r["model"] == "tiny"]
for r in runs:
    expect = ref["tokens"] if r["model"] == "ckpt" and ref else (tiny[0]["tokens"] if tiny else None)
    r["matches"] = bool(r["tokens"]) and r["tokens"] == expect
    print(f"{'ok  ' if r['matches'] else 'DIFF'} {r['name']}: {r['tokens']}")
res = {"reference": {"ckpt": "transformers greedy generate on the same checkpoint", "tiny": tiny[0]["name"] if tiny else None},
       "hf": ref, "runs": [dict(r, args=r["args"].replace(os.environ.get("CKPT", "\0"), "<ckpt>")) for r in runs],
       "all_match": all(r["matches"] for r in runs)}
json.dump(res, open(out, "w"), indent=1)
print(f"generate agreement: {sum(r['matches'] for r in runs)}/{len(runs)} runs match; wrote {out}")
sys.exit(0 if res["all_match"] else 1)
EOF
    then FAILED+=("generate agreement (see $OUT_DIR/generate_agreement.json)"); fi
    rm -f "$GEN_TSV" "$OUT_DIR/.hf_reference.json"
fi

printf '%s\t%d\t%d\n' total $((SECONDS - T_ALL)) "${#FAILED[@]}" >>"$TIMINGS"
echo "=== cpu_topologies: ${PARTS[*]} in $((SECONDS - T_ALL)) s"
if [ ${#FAILED[@]} -ne 0 ]; then
    printf '=== FAILED: %s\n' "${FAILED[@]}"
    exit 1
fi
echo "=== all OK"
