"""scripts/make_hf_checkpoint.py's tokenizer (quicktok's Llama 3 BPE written as tokenizer.json, loaded back with
AutoTokenizer) gives exactly spanllm's ids: the committed ShareGPT prompts (the peer benchmark's requests), special
tokens in text, odd whitespace and scripts, the chat template; a mismatch fails the check with exit 1."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytest.importorskip("quicktok", reason="the Llama 3 tokenizer comes from quicktok-v1")
pytest.importorskip("tokenizers", reason="tokenizer.json is built with Hugging Face tokenizers")
pytest.importorskip("transformers", reason="the checkpoint's tokenizer loads through transformers' AutoTokenizer")

ROOT = Path(__file__).resolve().parents[2]
SAMPLES = ROOT / "results/h200/inputs/sharegpt_llama3_seed0_n1000.json"
N_PROMPTS = 40
EXTRA = [
    "<|begin_of_text|>hi<|eot_id|> x <|reserved_special_token_5|>",
    "<|endoftext|> <|im_start|>",
    " " * 50 + "\n" * 7 + "\t\t x",
    "don't can't I'll 'TWAS",
    "1234567890123 3.14159",
    "é\u0301 \ufeff \u200b",
    "Hello\r\n\r\nworld  \n ",
    "日本語のトークナイザー 한국어 emoji \U0001f680\U0001f525",
    "",
    "a" * 2000,
]


def _script():
    spec = importlib.util.spec_from_file_location("make_hf_checkpoint", ROOT / "scripts/make_hf_checkpoint.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    mod = _script()
    out = tmp_path_factory.mktemp("hf_tok")
    mod.build_tokenizer(131072).save_pretrained(str(out))
    return mod, out


@pytest.fixture(scope="module")
def spanllm_tok():
    from spanllm.engine.tokenizer import get_tokenizer

    return get_tokenizer("llama3.1-8b")


def _sample_file(tmp_path: Path) -> Path:
    data = json.loads(SAMPLES.read_text())
    path = tmp_path / "s.json"
    path.write_text(json.dumps({"info": data["info"], "requests": data["requests"][:N_PROMPTS]}))
    return path


def test_ids_equal_spanllm(written, spanllm_tok):
    from transformers import AutoTokenizer

    _, out = written
    hf = AutoTokenizer.from_pretrained(str(out))
    reqs = json.loads(SAMPLES.read_text())["requests"][:N_PROMPTS]
    for text in [r["prompt"] for r in reqs] + EXTRA:
        ids = list(hf(text)["input_ids"])
        assert ids == spanllm_tok.encode(text), text[:80]
        assert hf.decode(ids, skip_special_tokens=False) == spanllm_tok.decode(ids)
    assert [len(hf(r["prompt"])["input_ids"]) for r in reqs] == [r["prompt_len"] for r in reqs]
    assert hf.bos_token_id == 128000 and len(hf) == 128256
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " hi "}]
    ids = hf.apply_chat_template(chat, add_generation_prompt=True)
    assert list(ids["input_ids"] if hasattr(ids, "keys") else ids) == spanllm_tok.apply_chat_template(chat)


def test_check_samples_passes_and_fails_loudly(written, tmp_path, monkeypatch, capsys):
    mod, out = written
    path = _sample_file(tmp_path)
    res = mod.check_samples(str(out), str(path), "llama3.1-8b")
    assert res["prompts"] == N_PROMPTS and res["ids_equal"] and res["prompt_len_mismatches"] == 0
    assert f"tokenizer: {N_PROMPTS} prompts, byte-exact ids" in capsys.readouterr().out

    from spanllm.engine import tokenizer as sp

    real = sp.Llama3Tokenizer.encode
    monkeypatch.setattr(
        sp.Llama3Tokenizer, "encode", lambda self, text, add_special_tokens=True: real(self, text)[:-1] + [5]
    )
    with pytest.raises(SystemExit) as e:
        mod.check_samples(str(out), str(path), "llama3.1-8b")
    assert e.value.code == 1
    assert "tokenizer MISMATCH at prompt 0" in capsys.readouterr().err


def test_tiny_preset_refused_with_the_way_out():
    mod = _script()
    with pytest.raises(SystemExit) as e:
        mod.llama_config("tiny")
    assert "--layers 2 --hidden 256" in str(e.value)
