"""A tiny Llama GGUF written by gguf.GGUFWriter (no package to install): spanllm's greedy tokens and logits equal
transformers' reading the same file, F32 and Q8_0, at TP=1 and TP=2 over gloo (4 query / 2 KV heads): the q/k
row permutation of llama.cpp's layout is undone, and the TP shards follow the safetensors loader's plan."""

from __future__ import annotations

import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")
from gguf import GGMLQuantizationType  # noqa: E402
from gguf_files import write_tiny_llama  # noqa: E402
from gguf_workers import make_llm, prompt_logits, tokens_rank  # noqa: E402

from spanllm.engine.sampler import SamplingParams  # noqa: E402
from spanllm.launch import launch  # noqa: E402

PROMPTS = [[1, 5, 17, 42, 8, 90, 3, 61], [1, 7, 7, 20], [1, 11, 23, 5, 6, 77, 30]]
NEW = 8


@pytest.fixture(scope="module", params=["F32", "Q8_0"])
def tiny(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_gguf") / f"tiny-{request.param}.gguf"
    write_tiny_llama(path, qtype=GGMLQuantizationType[request.param], seed=5)
    folder, name = os.path.split(str(path))
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = [
            hf.generate(torch.tensor([p]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)[
                0, len(p) :
            ].tolist()
            for p in PROMPTS
        ]
        ref_logits = hf(torch.tensor([PROMPTS[0]])).logits[0]
    return str(path), ref, ref_logits


def test_tp1_tokens_and_logits_equal_transformers(tiny):
    path, ref, ref_logits = tiny
    llm = make_llm(path)
    try:
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True))
        assert [list(o.output_ids) for o in outs] == ref
        torch.testing.assert_close(prompt_logits(llm, PROMPTS[0]), ref_logits, atol=1e-4, rtol=1e-4)
    finally:
        llm.close()


def test_tp2_gloo_tokens_equal_transformers(tiny):
    path, ref, _ = tiny
    got = launch(tokens_rank, path, PROMPTS, NEW, nprocs=2)[0]
    assert got == ref
