"""Shared fixtures: small random Llama checkpoints written by transformers, and its reference outputs."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from engine_workers import NEW_TOKENS, PROMPTS, make_hf_model  # noqa: E402


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory):
    """(single-file dir, sharded dir, HF model): the same weights saved both ways."""
    model = make_hf_model()
    single = tmp_path_factory.mktemp("llama_single")
    sharded = tmp_path_factory.mktemp("llama_sharded")
    model.save_pretrained(single, safe_serialization=True)
    model.save_pretrained(sharded, safe_serialization=True, max_shard_size="100KB")
    return str(single), str(sharded), model


@pytest.fixture(scope="session")
def hf_reference(hf_checkpoint):
    """HF greedy continuations of PROMPTS and HF logits over prompt + continuation, per prompt."""
    _, _, model = hf_checkpoint
    tokens, logits = [], []
    with torch.no_grad():
        for p in PROMPTS:
            ids = torch.tensor([p])
            gen = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=NEW_TOKENS,
                eos_token_id=None,
                pad_token_id=0,
            )
            cont = gen[0, len(p) :].tolist()
            tokens.append(cont)
            full = model(gen).logits[0].float()  # [len + new, vocab]
            logits.append(full[len(p) - 1 : len(p) - 1 + NEW_TOKENS])  # the logits each new token came from
    return tokens, logits
