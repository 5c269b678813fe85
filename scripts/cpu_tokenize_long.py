"""How long a long prompt's tokenization takes (the server tokenizes before the engine sees a request, so it is part of
the TTFT a client measures): the Llama 3 presets' tokenizer (spanllm.engine.tokenizer.Llama3Tokenizer: special-token
texts found by one regex pass, the rest quicktok's ordinary BPE) against quicktok's own encode_with_special, on
prompts of 36,402 and 111,352 tokens: random ids as `bench serve --dataset-name random` makes them (they include
special tokens' texts, which the server turns into their ids), and ShareGPT text (the committed sample's prompts,
concatenated). Both must give the same ids (checked).

    python scripts/cpu_tokenize_long.py OUTDIR

Writes OUTDIR/tokenize_long.json (machine, versions, the times of REPS runs each).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

LENGTHS = (36402, 111352)
REPS = 3
SAMPLES = "results/h200/inputs/sharegpt_llama3_seed0_n1000.json"


def timed(fn, text: str) -> tuple[list[float], list[int]]:
    times, ids = [], None
    for _ in range(REPS):
        t = time.perf_counter()
        ids = list(fn(text))
        times.append(time.perf_counter() - t)
    return times, ids


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("outdir")
    args = ap.parse_args()
    os.makedirs(args.outdir, exist_ok=True)
    from spanllm.bench.datasets import sample_random
    from spanllm.engine.tokenizer import get_tokenizer
    from spanllm.output_files import write_result

    tok = get_tokenizer("llama3.1-8b")
    enc = tok._enc  # quicktok's encoder, for its own encode_with_special
    sharegpt = "\n\n".join(r["prompt"] for r in json.load(open(SAMPLES))["requests"])
    while len(tok.encode(sharegpt)) < max(LENGTHS):
        sharegpt += "\n\n" + sharegpt
    sharegpt_ids = tok.encode(sharegpt, add_special_tokens=False)
    rows = []
    for n in LENGTHS:
        texts = {
            "random": sample_random(tok, 1, input_len=n, output_len=16, seed=n)[0].prompt,
            "sharegpt": tok.decode(sharegpt_ids[: n - 1]),
        }
        for kind, text in texts.items():
            ours, ours_ids = timed(lambda t: tok.encode(t, add_special_tokens=False), text)
            theirs, theirs_ids = timed(enc.encode_with_special, text)
            specials = sum(text.count(s) for s in enc.special_tokens_set)
            rows.append(
                {
                    "prompt": kind,
                    "target_tokens": n,
                    "tokens": len(ours_ids),
                    "chars": len(text),
                    "special_token_texts": specials,
                    "same_ids": ours_ids == theirs_ids,
                    "spanllm_s": [round(x, 4) for x in ours],
                    "quicktok_encode_with_special_s": [round(x, 4) for x in theirs],
                }
            )
            r = rows[-1]
            print(
                f"{kind} {n}: {r['tokens']} tokens, {specials} special texts, same ids {r['same_ids']}: "
                f"spanllm {statistics.median(ours):.3f} s, quicktok {statistics.median(theirs):.3f} s",
                flush=True,
            )
    path = os.path.join(args.outdir, "tokenize_long.json")
    write_result(path, "tokenize_long", {"reps": REPS}, rows)
    print(f"wrote {path}")
    return 0 if all(r["same_ids"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
