"""What a quantization costs in quality: one fixed text scored by the model in its dtype and quantized (its weights,
`quantization`, or its KV cache, `kv_cache_dtype`).

Measures, on the engine's own runner: the text's mean negative log-likelihood per token (NLL; its exp is the
perplexity) in both, the relative change of the log-likelihood, and how often the quantized model's top-1 next
token equals the unquantized one's over every position. Two prefill shapes, because FP8 runs two GEMMs
(spanllm.layers.fp8): the whole text in one step (W8A8: activations quantized per token, as a prompt's prefill
runs) and chunks of 16 tokens (W8A16: the decode GEMM, x unquantized).

The text is fixed (written for this check: plain English prose, no dataset download), so a run is
reproducible and the test's thresholds (tests/model/test_fp8_quality.py) hold exact meaning.
"""

from __future__ import annotations

import torch

from spanllm.engine.config import EngineConfig
from spanllm.engine.scoring import prompt_logits, token_logprobs
from spanllm.kernels.skinny_gemm import FP8_ALWAYS_WEIGHT_ONLY_M

FIXED_TEXT = (
    "The village sat at the bottom of a wide valley, where two rivers met before running together to the sea. "
    "Every morning the baker opened his shop before sunrise, and the smell of warm bread drifted down the main "
    "street long before the first carts arrived from the farms. In spring the fields on the hillsides turned "
    "green, then yellow with flowers, and the children walked to school along the narrow path beside the water. "
    "The old bridge had been built from grey stone more than two hundred years ago. It had survived floods, "
    "storms and one very cold winter when the river froze solid for six weeks. People still told stories about "
    "that winter: how the miller skated to the next town to buy flour, how the school closed for a month, and how "
    "the whole village gathered every evening in the church hall to keep warm and share what food they had. "
    "Today the valley is quieter. Many young people have moved to the cities to study or to work, and some of the "
    "farms have been sold. But every summer they come back for the festival, when the main street is closed to "
    "traffic, long tables are set up outside the houses, and families eat together until late at night. The "
    "musicians play the same songs their grandparents played, and the oldest residents sit in the shade and "
    "watch the dancing. Visitors often ask why the festival is held on the last Saturday of July. Nobody is "
    "completely sure. The most common answer is that it marks the end of the first harvest, when the hay has "
    "been cut and stored and there is finally time to rest. Another story says that it began as a celebration "
    "of the new bridge, although the dates do not quite match. Whatever its origin, the festival has become the "
    "one day of the year when the whole valley feels full again, and when the lights in every window stay on."
)
W8A16_CHUNK = FP8_ALWAYS_WEIGHT_ONLY_M  # chunks of this many tokens run every linear W8A16 (the decode GEMM)


def _score(llm, ids: list[int], chunk: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    logits = prompt_logits(llm, ids, chunk=chunk)
    return token_logprobs(logits, ids), logits[:-1].argmax(dim=-1)


def compare(
    model: str,
    quantization: str | None,
    dtype: torch.dtype = torch.bfloat16,
    text: str = FIXED_TEXT,
    base_dtype: torch.dtype | None = None,
    kv_cache_dtype: str = "auto",
) -> dict:
    """Score `text` with `model` in `base_dtype` (default: `dtype`) unquantized and in `dtype` with
    `quantization`; the numbers of the module docstring, per shape. quantization=None with base_dtype=float32
    measures what bf16 itself changes (the yardstick for a quantization's numbers)."""
    from spanllm.engine.llm import LLM
    from spanllm.model.config import resolve_model

    cfg = resolve_model(model)
    llms = {}
    try:
        for key, dt, q, kv in (
            ("base", base_dtype or dtype, None, "auto"),
            ("quantized", dtype, quantization, kv_cache_dtype),
        ):
            engine = EngineConfig(dtype=dt, quantization=q, kv_cache_dtype=kv, max_num_seqs=8, max_model_len=2048)
            llms[key] = LLM(cfg, engine, device=torch.device("cpu"))
        ids = llms["base"].get_tokenizer().encode(text)
        rows = {}
        for shape, chunk in (("one_step_w8a8", None), (f"chunks_of_{W8A16_CHUNK}_w8a16", W8A16_CHUNK)):
            base_lp, base_top = _score(llms["base"], ids, chunk)
            q_lp, q_top = _score(llms["quantized"], ids, chunk)
            base_ll, q_ll = float(base_lp.sum()), float(q_lp.sum())
            rows[shape] = {
                "positions": len(ids) - 1,
                "nll_per_token": {"base": -base_ll / (len(ids) - 1), "quantized": -q_ll / (len(ids) - 1)},
                "log_likelihood": {"base": base_ll, "quantized": q_ll},
                "log_likelihood_rel_change": (q_ll - base_ll) / abs(base_ll),
                "top1_agreement": float((base_top == q_top).double().mean()),
                "top1_disagreements": int((base_top != q_top).sum()),
            }
        return {
            "model": cfg.label,
            "base": {"dtype": str(base_dtype or dtype).removeprefix("torch."), "quantization": None},
            "quantized": {
                "dtype": str(dtype).removeprefix("torch."),
                "quantization": quantization,
                "kv_cache_dtype": kv_cache_dtype,
            },
            "text_tokens": len(ids),
            "shapes": rows,
        }
    finally:
        for llm in llms.values():
            llm.close()
