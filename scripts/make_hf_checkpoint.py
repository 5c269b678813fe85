"""Write a Hugging Face checkpoint folder for a spanllm Llama 3 preset: random weights and a tokenizer built from
quicktok's Llama 3 BPE, so that peers that load models by folder (`transformers serve DIR --continuous-batching`,
`AutoModelForCausalLM.from_pretrained(DIR)`, `AutoTokenizer.from_pretrained(DIR)`) run the same shape on the same
token ids as spanllm's random-weight preset.

    python scripts/make_hf_checkpoint.py --model llama3.1-8b --out /tmp/hf_ckpt --device cuda \\
        --check-samples results/h200/inputs/sharegpt_llama3_seed0_n1000.json
    python scripts/make_hf_checkpoint.py --model llama3.1-8b --layers 2 --hidden 256 --dtype fp32 --device cpu \\
        --out /tmp/hf_small     # CPU-sized: the Llama 3 vocabulary (128256), 2 small layers
    python scripts/make_hf_checkpoint.py --out /tmp/tok --tokenizer-only --check-samples S.json

The folder:
- config.json: the LlamaConfig of scripts/hf_continuous_batching_peer.py's hf_model (llama3 rope scaling,
  pad 0), eos_token_id None: generation runs to max_tokens, as the benchmark's fixed output lengths need;
- generation_config.json: do_sample, temperature 1.0, top_p 1.0, top_k 0 (off), no eos;
- model*.safetensors: normal(0, 0.02) weights, norms 1.0 (skipped with --tokenizer-only);
- tokenizer.json / tokenizer_config.json: quicktok's ranks through transformers' TikTokenConverter (byte-level
  BPE, the Llama 3 split regex, ignore_merges as in Meta's tokenizer.json), the 256 special tokens, BOS
  <|begin_of_text|> prepended as Llama 3.1's tokenizer.json does (spanllm's Llama3Tokenizer.encode too), a
  Llama 3 chat template;
- spanllm_checkpoint.json: what this is (random weights, the tokenizer's source, the --check-samples result).

--check-samples FILE encodes every prompt of a saved sample with the written tokenizer (loaded back with
AutoTokenizer) and with spanllm's, and exits 1 at the first prompt whose ids or decoded text differ.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

# Llama 3's pre-tokenizer split (Meta's tokenizer.json and tiktoken's llama3 pattern; quicktok's LLAMA3_PAT).
LLAMA3_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
# Llama 3 Instruct's format without the tool and date preamble (spanllm's Llama3Tokenizer.apply_chat_template).
CHAT_TEMPLATE = (
    "{{- bos_token }}{%- for message in messages %}{{- '<|start_header_id|>' + message['role'] + "
    "'<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- endif %}"
)
DTYPES = {
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp16": "float16",
    "float16": "float16",
    "fp32": "float32",
    "float32": "float32",
}


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama3.1-8b", help="a spanllm Llama 3 preset (spanllm.model.config)")
    ap.add_argument("--out", required=True, help="the folder to write (created; files in it are overwritten)")
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    ap.add_argument("--device", default="cuda", help="where the weights are made (cuda: fast; cpu for small ones)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layers", type=int, default=None, help="override the preset's layer count")
    ap.add_argument(
        "--hidden",
        type=int,
        default=None,
        help="override the hidden size (heads of 64 dims, FFN 3.5x, KV heads gcd(heads, preset's))",
    )
    ap.add_argument("--tokenizer-only", action="store_true", help="no weights: configs and tokenizer only")
    ap.add_argument(
        "--check-samples",
        default=None,
        metavar="FILE",
        help="a saved sample (bench throughput --save-samples): ids must equal spanllm's",
    )
    return ap.parse_args()


def llama_config(model: str, layers: int | None = None, hidden: int | None = None, **extra):
    """The transformers LlamaConfig of a spanllm Llama 3.1 preset (this script's checkpoints, and the model of
    scripts/hf_continuous_batching_peer.py, which passes attn_implementation in `extra`); eos None, pad 0.
    `layers` / `hidden` shrink it (--layers / --hidden)."""
    from transformers import LlamaConfig

    from spanllm.model.config import ModelConfigError, preset

    if model.split(":", 1)[0] == "tiny":
        sys.exit(
            "--model tiny: spanllm's tiny preset tokenizes with its byte tokenizer (vocabulary 512), which has "
            "no Hugging Face tokenizer here; for a CPU-sized checkpoint with the Llama 3 tokenizer use "
            "--model llama3.1-8b --layers 2 --hidden 256 --dtype fp32 --device cpu"
        )
    try:
        c = preset(model)
    except ModelConfigError as e:
        sys.exit(f"--model: {e}")
    if c.vocab_size != 128256 or c.rope_scaling is None:
        sys.exit(
            f"--model {model}: vocabulary {c.vocab_size}; only the Llama 3.1 presets (vocabulary 128256, "
            "llama3 rope scaling) have the quicktok Llama 3 tokenizer"
        )
    size, heads, kv, head_dim, ffn = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size
    if hidden is not None:
        if hidden < 64 or hidden % 64:
            sys.exit(f"--hidden {hidden}: use a multiple of 64 (heads of 64 dims), e.g. 256")
        size, head_dim = hidden, 64
        heads = size // 64
        kv, ffn = math.gcd(heads, c.num_kv_heads), int(3.5 * size)
    layers = c.num_layers if layers is None else layers
    if layers < 1:
        sys.exit(f"--layers {layers}: must be >= 1")
    r = c.rope_scaling
    return LlamaConfig(
        vocab_size=c.vocab_size,
        hidden_size=size,
        intermediate_size=ffn,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=head_dim,
        rms_norm_eps=c.rms_norm_eps,
        max_position_embeddings=c.max_position_embeddings,
        rope_theta=c.rope_theta,
        tie_word_embeddings=False,
        rope_scaling={
            "rope_type": "llama3",
            "factor": r.factor,
            "low_freq_factor": r.low_freq_factor,
            "high_freq_factor": r.high_freq_factor,
            "original_max_position_embeddings": r.original_max_position_embeddings,
        },
        bos_token_id=c.bos_token_id,
        eos_token_id=None,
        pad_token_id=0,
        architectures=["LlamaForCausalLM"],
        **extra,
    )


def generation_config(cfg):
    from transformers import GenerationConfig

    return GenerationConfig(
        do_sample=True,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        bos_token_id=cfg.bos_token_id,
        eos_token_id=None,
        pad_token_id=cfg.pad_token_id,
    )


def _converter(ranks: dict[bytes, int], specials: list[str]):
    """transformers' TikTokenConverter fed quicktok's ranks instead of a tiktoken file (no tiktoken needed)."""
    from transformers.convert_slow_tokenizer import TikTokenConverter

    class QuicktokConverter(TikTokenConverter):
        load_tiktoken_bpe = staticmethod(lambda _url: ranks)

    return QuicktokConverter(vocab_file="quicktok llama3", pattern=LLAMA3_PATTERN, extra_special_tokens=specials)


def build_tokenizer(model_max_length: int):
    import quicktok
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    enc = quicktok.encoding_for_model("meta-llama/Llama-3.1-8B")
    specials = sorted(enc.special_tokens_set, key=enc.encode_single_token)
    n_regular = enc.n_vocab - len(specials)
    special_ids = [enc.encode_single_token(s) for s in specials]
    if special_ids != list(range(n_regular, enc.n_vocab)):
        sys.exit(
            f"quicktok's special tokens are not ids {n_regular}..{enc.n_vocab - 1} (got {special_ids[:3]}...): "
            "this script assumes Llama 3's layout; check the quicktok-v1 version"
        )
    ranks = {enc.decode_single_token_bytes(i): i for i in range(n_regular)}
    if len(ranks) != n_regular:
        sys.exit(f"quicktok's {n_regular} regular tokens hold {n_regular - len(ranks)} duplicate byte strings")
    tk = _converter(ranks, specials).converted()
    bos_id = enc.encode_single_token(BOS)
    tk.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
            ),
        ]
    )
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk,
        bos_token=BOS,
        eos_token=EOS,
        chat_template=CHAT_TEMPLATE,
        model_input_names=["input_ids", "attention_mask"],
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )  # decode must give quicktok's bytes back
    wrong = [s for s, i in zip(specials, special_ids) if tok.convert_tokens_to_ids(s) != i]
    if wrong or len(tok) != enc.n_vocab:
        sys.exit(f"built tokenizer: {len(tok)} ids (quicktok {enc.n_vocab}); special tokens at other ids: {wrong[:5]}")
    return tok


def init_random_(model, seed: int, device) -> None:
    """Random weights in place: normal(0, 0.02) from one seeded generator in parameter order, norms 1.0."""
    import torch

    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)


def write_weights(cfg, out: str, dtype_name: str, device: str, seed: int) -> dict:
    import torch
    from transformers import LlamaForCausalLM

    dtype = getattr(torch, DTYPES[dtype_name])
    t0 = time.perf_counter()
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    model = model.to(dtype).to_empty(device=device)
    init_random_(model, seed, device)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    t_init = time.perf_counter() - t0
    model.generation_config = generation_config(cfg)
    model.save_pretrained(out, max_shard_size="5GB")  # safetensors (the only format transformers 5 writes)
    files = [f for f in os.listdir(out) if f.endswith(".safetensors")]
    if not files:
        sys.exit(f"save_pretrained wrote no .safetensors into {out}")
    size = sum(os.path.getsize(os.path.join(out, f)) for f in files)
    n_params = sum(p.numel() for p in model.parameters())
    elapsed = time.perf_counter() - t0
    print(
        f"weights: {n_params / 1e9:.3f} B params {dtype_name} on {device} (seed {seed}) in {t_init:.1f} s, saved "
        f"{len(files)} safetensors file(s), {size / 2**30:.2f} GiB, in {elapsed:.1f} s total",
        flush=True,
    )
    return {"params": n_params, "safetensors_bytes": size, "safetensors_files": len(files), "seconds": elapsed}


def check_samples(out: str, path: str, model: str) -> dict:
    """The written tokenizer (loaded back) against spanllm's on every prompt of the file: ids and decode."""
    from transformers import AutoTokenizer

    from spanllm.bench.sample_file import load_samples
    from spanllm.engine.tokenizer import get_tokenizer

    try:
        samples = load_samples(path)
    except ValueError as e:
        sys.exit(str(e))
    hf = AutoTokenizer.from_pretrained(out)
    sp = get_tokenizer(model)
    prompts = [r.prompt for r in samples]
    t0 = time.perf_counter()
    hf_ids = hf(prompts, add_special_tokens=True)["input_ids"]
    tokens = len_mismatch = 0
    for i, (req, ids) in enumerate(zip(samples, hf_ids)):
        text = req.prompt
        ref = sp.encode(text)
        if list(ids) != ref:
            k = next((j for j, (a, b) in enumerate(zip(ids, ref)) if a != b), min(len(ids), len(ref)))
            print(
                f"tokenizer MISMATCH at prompt {i} of {path} ({len(ids)} HF ids vs {len(ref)} spanllm ids; first "
                f"difference at position {k}: HF {list(ids[k : k + 5])} vs spanllm {ref[k : k + 5]}); prompt "
                f"{text[:300]!r}",
                file=sys.stderr,
            )
            sys.exit(1)
        hf_text = hf.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        if hf_text != sp.decode(ref):
            print(
                f"tokenizer DECODE MISMATCH at prompt {i} of {path}: HF {hf_text[:200]!r} vs spanllm "
                f"{sp.decode(ref)[:200]!r}",
                file=sys.stderr,
            )
            sys.exit(1)
        tokens += len(ref)
        len_mismatch += len(ref) != req.prompt_len
    dt = time.perf_counter() - t0
    other = f"; {len_mismatch} prompt_len values in the file differ (counted with another tokenizer)"
    print(
        f"tokenizer: {len(prompts)} prompts, byte-exact ids ({tokens} tokens, BOS included; decode equal) vs "
        f"spanllm's {sp.name} in {dt:.1f} s" + (other if len_mismatch else ""),
        flush=True,
    )
    return {
        "samples_file": path,
        "prompts": len(prompts),
        "tokens": tokens,
        "ids_equal": True,
        "decode_equal": True,
        "prompt_len_mismatches": len_mismatch,
        "reference": sp.name,
    }


def main() -> int:
    args = parse()
    import tokenizers
    import transformers

    cfg = llama_config(args.model, args.layers, args.hidden)
    if not args.tokenizer_only and args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            sys.exit(
                f"--device {args.device}: no CUDA GPU here; pass --device cpu (slow for the 8B: use --layers and "
                "--hidden) or --tokenizer-only"
            )
    os.makedirs(args.out, exist_ok=True)
    t0 = time.perf_counter()
    tok = build_tokenizer(cfg.max_position_embeddings)
    tok.save_pretrained(args.out)
    print(
        f"tokenizer: {len(tok)} ids (quicktok-v1 Llama 3 BPE via TikTokenConverter) written in "
        f"{time.perf_counter() - t0:.1f} s",
        flush=True,
    )
    check = check_samples(args.out, args.check_samples, args.model) if args.check_samples else None  # before weights
    shape = {
        k: getattr(cfg, k)
        for k in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
        )
    }
    if args.tokenizer_only:
        import torch

        cfg.dtype = getattr(torch, DTYPES[args.dtype])
        cfg.save_pretrained(args.out)
        generation_config(cfg).save_pretrained(args.out)
        weights = None
        print("weights: skipped (--tokenizer-only)")
    else:
        weights = write_weights(cfg, args.out, args.dtype, args.device, args.seed)
    note = {
        "preset": args.model,
        "shape": shape,
        "layers_override": args.layers,
        "hidden_override": args.hidden,
        "weights": None
        if weights is None
        else {**weights, "init": "normal(0, 0.02), norms 1.0", "seed": args.seed, "dtype": DTYPES[args.dtype]},
        "note": "random weights; tokenizer built from quicktok-v1's Llama 3 BPE (TikTokenConverter), BOS "
        "prepended; no eos in config/generation_config (generation runs to max_tokens)",
        "tokenizer_check": check,
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
    }
    with open(os.path.join(args.out, "spanllm_checkpoint.json"), "w") as f:
        json.dump(note, f, indent=1)
    print(f"wrote {args.out} ({', '.join(sorted(os.listdir(args.out)))})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
