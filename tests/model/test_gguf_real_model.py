"""SmolLM2-135M-Instruct from its GGUF file (Q8_0 embeddings, Q4_1 layers) against transformers reading the same
file: greedy chat continuations token for token at TP=1 and TP=3 over gloo (9 query / 3 KV heads: 3 each, 1 each),
and the log-likelihood of a fixed text, float32."""

from __future__ import annotations

import pytest
import torch
from gguf_workers import greedy, greedy_rank, make_llm, prompt_logits

from spanllm.launch import launch

REAL_MODEL = "smollm2-135m-instruct"
TEXT = (
    "The history of the bicycle begins in the early nineteenth century. In 1817 Karl Drais, a German civil "
    "servant, built a two-wheeled running machine that the rider pushed along with his feet. It had no pedals, "
    "but it showed that a person could balance on two wheels in a line. Over the following decades inventors in "
    "France and Britain added cranks and pedals to the front wheel, and the velocipede became a fashion in Paris. "
    "Because the pedals drove the front wheel directly, a larger wheel meant a higher speed, and so the penny-"
    "farthing appeared, with a front wheel as tall as a man. It was fast but dangerous: a rider who hit a stone "
    "could be thrown over the handlebars. The safety bicycle of the 1880s solved this with a chain that drove the "
    "rear wheel, two wheels of equal size and, soon after, air-filled rubber tyres. Its shape has changed little "
    "since. The bicycle gave ordinary people a cheap way to travel far from home, and it played a part in the "
    "movement for women's rights, since it required practical clothes and gave women independent mobility."
)


@pytest.fixture(scope="module")
def llm(real_model_path):
    llm = make_llm(REAL_MODEL)
    llm.get_tokenizer()
    yield llm
    llm.close()


def test_config_from_the_gguf_metadata(llm):
    cfg = llm.config
    shape = (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size)
    assert shape == (30, 576, 9, 3, 64, 49152)
    assert (cfg.intermediate_size, cfg.rope_theta, cfg.max_position_embeddings) == (1536, 100000.0, 8192)
    assert cfg.tie_word_embeddings and cfg.bos_token_id == 1 and cfg.eos_token_ids == (2,)


def test_chat_template_from_the_gguf_equals_transformers(llm, chat_prompts):
    from gguf_workers import CHAT_QUESTIONS

    tok = llm.get_tokenizer()
    assert [tok.apply_chat_template([{"role": "user", "content": q}]) for q in CHAT_QUESTIONS] == chat_prompts


def test_greedy_chat_tp1_equals_transformers(llm, chat_prompts, hf_greedy):
    assert len(chat_prompts) >= 8
    assert greedy(llm, chat_prompts) == hf_greedy
    tok = llm.get_tokenizer()
    assert tok.decode(hf_greedy[0]).startswith("The capital of France is Paris.")


def test_greedy_chat_tp3_gloo_equals_transformers(real_model_path, chat_prompts, hf_greedy):
    results = launch(greedy_rank, REAL_MODEL, chat_prompts, nprocs=3)
    assert results[0] == hf_greedy
    assert results[1:] == [None, None]


def test_log_likelihood_equals_transformers(llm, hf_model):
    model, tok = hf_model
    ids = tok(TEXT)["input_ids"]
    ids = [tok.bos_token_id, *ids] if ids[0] != tok.bos_token_id else ids
    assert 200 <= len(ids) <= 400
    target = torch.tensor(ids[1:])

    def loglik(logits: torch.Tensor) -> float:
        lp = torch.log_softmax(logits[:-1].double(), dim=-1)
        return float(lp.gather(1, target[:, None]).sum())

    ours = loglik(prompt_logits(llm, ids))
    with torch.no_grad():
        ref = loglik(model(torch.tensor([ids])).logits[0].float())
    assert ours == pytest.approx(ref, rel=1e-4)
    assert ref < 0


def test_generate_command_takes_a_text_prompt(llm, capfd):
    """`spanllm generate --prompt TEXT` tokenizes with the model's tokenizer and prints the greedy continuation
    the serving engine gives for the same ids."""
    from spanllm import cli

    assert (
        cli.main(["generate", "--model", REAL_MODEL, "--prompt", "The capital of France is", "--max-new-tokens", "4"])
        == 0
    )
    lines = capfd.readouterr().out.splitlines()
    ids = {
        k: [int(t) for t in line.split(": ", 1)[1].split(",")]
        for line in lines
        for k in ("prompt", "generated")
        if line.startswith(f"[0] {k} ids: ")
    }
    assert ids["prompt"] == llm.get_tokenizer().encode("The capital of France is", add_special_tokens=False)
    assert ids["generated"] == greedy(llm, [ids["prompt"]], 4)[0]
