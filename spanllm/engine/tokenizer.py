"""Tokenizers: text <-> token ids for the engine, the server and the benchmarks, plus incremental
detokenization for streaming.

Sources:
- a checkpoint folder with a Hugging Face tokenizer (`tokenizer.json`, through transformers'
  AutoTokenizer: its chat template too, where the checkpoint has one);
- a GGUF file: the tokenizer and chat template in its metadata, through the same AutoTokenizer
  (`from_pretrained(folder, gguf_file=name)`, which converts llama.cpp's vocabulary and merges);
- the Llama 3 presets (random weights): the Llama 3 BPE that `quicktok-v1` ships, byte-exact with the
  Hugging Face tokenizer of Llama 3.1, so ShareGPT prompts have the token counts vLLM's benchmark sees.

`encode(text)` behaves like HF's `tokenizer(text).input_ids`: BOS prepended, special-token strings in
the text parsed as special tokens. `IncrementalDetokenizer` turns a growing list of ids into text
deltas that never split a UTF-8 character (a token may hold part of one: Llama 3's byte fallback).
"""

from __future__ import annotations

import codecs
import functools
import os
import re
from typing import Protocol

LLAMA3_BOS = 128000
LLAMA3_EOT = 128009
# Llama 3.1 Instruct's chat format (its chat template without the tool and date preamble).
_LLAMA3_HEADER = "<|start_header_id|>{role}<|end_header_id|>\n\n"


class TokenizerError(ValueError):
    """A tokenizer that cannot be loaded, or a chat request it cannot format."""


class Tokenizer(Protocol):
    name: str
    vocab_size: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def apply_chat_template(self, messages: list[dict]) -> list[int]: ...

    def detokenizer(self, prompt_ids: list[int]) -> IncrementalDetokenizer: ...

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (a partial character's bytes too, where decode gives U+FFFD)."""
        ...

    @property
    def max_token_chars(self) -> int:
        """An upper bound on the characters of text one token covers: a text of more than L x this many characters
        is more than L tokens, known without tokenizing it."""
        ...


class IncrementalDetokenizer(Protocol):
    def push(self, token_id: int) -> str:
        """Add one generated token; return the text it completes (may be '' mid-character)."""


class Llama3Tokenizer:
    """The Llama 3 BPE from quicktok-v1 (`quicktok.encoding_for_model("meta-llama/Llama-3.1-8B")`)."""

    def __init__(self) -> None:
        try:
            import quicktok
        except ImportError:
            raise TokenizerError(
                "the Llama 3 presets tokenize with quicktok-v1, which is not installed: "
                "pip install quicktok-v1 (or serve a checkpoint folder with its tokenizer.json)"
            ) from None
        self._enc = quicktok.encoding_for_model("meta-llama/Llama-3.1-8B")
        # The 256 special tokens' texts (<|begin_of_text|>, <|reserved_special_token_N|>, ...), longest first
        self._specials = re.compile("|".join(map(re.escape, sorted(self._enc.special_tokens_set, key=len)[::-1])))
        self.name = "llama3 (quicktok-v1)"
        self.vocab_size = self._enc.n_vocab
        self.bos_token_id = LLAMA3_BOS
        self.eos_token_ids = (128001, 128008, LLAMA3_EOT)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self._encode_with_special(text)
        return [LLAMA3_BOS, *ids] if add_special_tokens else ids

    def _encode_with_special(self, text: str) -> list[int]:
        """quicktok's encode_with_special (a special token's text becomes its id, the text between them ordinary
        BPE), with the special texts found by one regex pass: quicktok's own search slows down with their number
        (a 111k-token random prompt holding 252 of them: 2.6-4.4 s against 0.035 s here, the same ids), and a
        prompt is tokenized before the engine sees it."""
        enc, out, pos = self._enc, [], 0
        for m in self._specials.finditer(text):
            if m.start() > pos:
                out.extend(enc.encode_ordinary(text[pos : m.start()]))
            out.append(enc.encode_single_token(m.group(0)))
            pos = m.end()
        if pos < len(text):
            out.extend(enc.encode_ordinary(text[pos:]))
        return out

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: list[int]) -> str:
        return self._enc.decode(list(ids))

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        text = "<|begin_of_text|>"
        for m in _check_messages(messages):
            text += _LLAMA3_HEADER.format(role=m["role"]) + m["content"].strip() + "<|eot_id|>"
        text += _LLAMA3_HEADER.format(role="assistant")
        return self._encode_with_special(text)

    def detokenizer(self, prompt_ids: list[int]) -> ByteDetokenizer:
        """Streamed text leaves special tokens out (vLLM's skip_special_tokens default)."""
        enc = self._enc
        return ByteDetokenizer(lambda i: b"" if i >= LLAMA3_BOS else enc.decode_single_token_bytes(i))

    def token_bytes(self, token_id: int) -> bytes:
        return self._enc.decode_single_token_bytes(token_id)

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The longest token's bytes (a character is at least one byte), special tokens' text included."""
        longest = 1
        for i in range(self._enc.n_vocab):
            try:
                longest = max(longest, len(self._enc.decode_single_token_bytes(i)))
            except Exception:  # noqa: BLE001 - an id the vocabulary leaves unassigned covers no text
                continue
        return longest


class HFTokenizer:
    """A checkpoint folder's (or GGUF file's) tokenizer through transformers' AutoTokenizer (fast tokenizer)."""

    def __init__(self, directory: str, gguf_file: str | None = None) -> None:
        try:
            from transformers import AutoTokenizer
        except ImportError:
            raise TokenizerError(
                "text prompts for a checkpoint folder need transformers: pip install transformers"
            ) from None
        try:
            if gguf_file is None:
                self._tok = AutoTokenizer.from_pretrained(directory)
            else:
                self._tok = AutoTokenizer.from_pretrained(directory, gguf_file=gguf_file)
        except Exception as e:  # noqa: BLE001 - any load failure is reported with the folder
            if gguf_file is not None:
                raise TokenizerError(
                    f"could not load the tokenizer of {os.path.join(directory, gguf_file)!r} ({type(e).__name__}: "
                    f"{' '.join(str(e).split())[:200]}); transformers reads GGUF tokenizers with the gguf package "
                    "(pip install gguf)"
                ) from None
            raise TokenizerError(
                f"could not load the tokenizer in {directory!r} ({type(e).__name__}: {e}); the folder "
                "needs tokenizer.json (and tokenizer_config.json)"
            ) from None
        self.name = gguf_file or os.path.basename(os.path.abspath(directory))
        self.vocab_size = len(self._tok)
        self.bos_token_id = self._tok.bos_token_id
        eos = self._tok.eos_token_id
        self.eos_token_ids = () if eos is None else (int(eos),)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok(text, add_special_tokens=add_special_tokens)["input_ids"])

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        if not getattr(self._tok, "chat_template", None):
            raise TokenizerError(
                f"the tokenizer of {self.name!r} has no chat template; use /v1/completions with a "
                "prompt instead of /v1/chat/completions"
            )
        try:
            ids = self._tok.apply_chat_template(_check_messages(messages), add_generation_prompt=True, tokenize=True)
        except Exception as e:  # the checkpoint's Jinja template refused these messages (its raise_exception) or broke
            if not type(e).__module__.startswith("jinja2"):
                raise
            raise TokenizerError(f"the chat template of {self.name!r} refused the messages: {e}") from None
        if isinstance(ids, dict) or hasattr(ids, "keys"):  # transformers >= 5 returns a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)

    def detokenizer(self, prompt_ids: list[int]) -> OffsetDetokenizer:
        """Streamed text leaves special tokens out (vLLM's skip_special_tokens default)."""
        return OffsetDetokenizer(lambda ids: self._tok.decode(list(ids), skip_special_tokens=True), prompt_ids)

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The longest vocabulary string (added tokens' content included). Byte-level and SentencePiece pieces are
        at least as long as the text they decode to (a byte is one stand-in character, `<0xNN>` six, `▁` one)."""
        pieces = self._tok.convert_ids_to_tokens(list(range(len(self._tok))))
        return max([1, *(len(p) for p in pieces if isinstance(p, str))])

    def token_bytes(self, token_id: int) -> bytes:
        """A whole-character token: its decoded text's UTF-8. A partial character (decode gives U+FFFD): the bytes
        the token's vocabulary string stands for, in either byte encoding transformers' fast tokenizers use:
        SentencePiece's byte fallback (`<0xE2>`) or byte-level BPE (GPT-2's printable stand-ins for the 256 bytes)."""
        text = self._tok.decode([token_id], skip_special_tokens=False)
        if "\ufffd" not in text:
            return text.encode("utf-8")
        piece = self._tok.convert_ids_to_tokens(token_id)
        if isinstance(piece, str):
            if m := _BYTE_FALLBACK.fullmatch(piece):
                return bytes([int(m.group(1), 16)])
            byte_of = _byte_level_decoder()
            if piece and all(c in byte_of for c in piece):
                return bytes(byte_of[c] for c in piece)
        return text.encode("utf-8")


class ByteTokenizer:
    """The `tiny` preset's tokenizer (CPU tests, demos): UTF-8 bytes b as ids b + 3, BOS 1, EOS 2."""

    OFFSET = 3

    def __init__(self, vocab_size: int = 512, bos: int = 1, eos: int = 2) -> None:
        if vocab_size < 256 + self.OFFSET:
            raise TokenizerError(
                f"a byte tokenizer needs a vocabulary of at least {256 + self.OFFSET}; got {vocab_size}"
            )
        self.name = "bytes"
        self.vocab_size = vocab_size
        self.bos_token_id = bos
        self.eos_token_ids = (eos,)

    def _bytes(self, i: int) -> bytes:
        return bytes([i - self.OFFSET]) if self.OFFSET <= i < 256 + self.OFFSET else b""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [b + self.OFFSET for b in text.encode("utf-8")]
        return [self.bos_token_id, *ids] if add_special_tokens else ids

    def decode(self, ids: list[int]) -> str:
        return b"".join(self._bytes(i) for i in ids).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        text = "".join(f"{m['role']}: {m['content']}\n" for m in _check_messages(messages)) + "assistant:"
        return self.encode(text)

    def detokenizer(self, prompt_ids: list[int]) -> ByteDetokenizer:
        return ByteDetokenizer(self._bytes)

    def token_bytes(self, token_id: int) -> bytes:
        return self._bytes(token_id)

    max_token_chars = 1  # a token is one byte of UTF-8: at most one character


_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@functools.cache
def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet (transformers' bytes_to_unicode), inverted: stand-in character -> byte."""
    try:
        from transformers.convert_slow_tokenizer import bytes_to_unicode
    except ImportError:  # transformers 4.x keeps it beside GPT-2's tokenizer
        from transformers.models.gpt2.tokenization_gpt2 import bytes_to_unicode

    return {c: b for b, c in bytes_to_unicode().items()}


def _check_messages(messages: list[dict]) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise TokenizerError("messages must be a non-empty list of {role, content} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise TokenizerError(f"messages[{i}] must be an object with string 'role' and 'content'; got {m!r}")
        if m["role"] not in ("system", "user", "assistant"):
            raise TokenizerError(f"messages[{i}].role={m['role']!r}: expected system, user or assistant")
    return messages


class ByteDetokenizer:  # noqa: E302
    """For tokenizers whose tokens are byte strings: bytes go through an incremental UTF-8 decoder, so a
    character split across tokens comes out whole once its last byte arrives. O(1) per token."""

    def __init__(self, token_bytes) -> None:
        self._token_bytes = token_bytes
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        return self._utf8.decode(self._token_bytes(token_id))


class OffsetDetokenizer:
    """For any tokenizer with decode(): decode a short window of recent ids and emit what it adds past
    the previous window, holding back text that ends in an incomplete character (U+FFFD), as vLLM and
    TGI do. Context from the prompt keeps merge-sensitive decoders (leading spaces) right."""

    WINDOW = 5  # ids of context before the unread ones

    def __init__(self, decode, prompt_ids: list[int]) -> None:
        self._decode = decode
        self._ids = list(prompt_ids[-self.WINDOW :])
        self._prefix = len(self._ids)  # ids before `_read` already emitted; [_prefix_start, _read) is context
        self._prefix_start = 0
        self._read = len(self._ids)

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        before = self._decode(self._ids[self._prefix_start : self._read])
        after = self._decode(self._ids[self._prefix_start :])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            delta = after[len(before) :]
            self._prefix_start, self._read = self._read, len(self._ids)
            return delta
        return ""


def get_tokenizer(model: str, checkpoint_dir: str | None = None) -> Tokenizer:
    """The tokenizer for a model spec: a checkpoint folder's or GGUF file's own (`checkpoint_dir` is the
    ModelConfig's), or Llama 3's for the llama3* presets."""
    from spanllm.model.gguf import GGUF_SUFFIX, is_gguf

    if checkpoint_dir is None and (model.lower().endswith(GGUF_SUFFIX) or _is_gguf_preset(model)):
        from spanllm.model.config import resolve_model

        checkpoint_dir = resolve_model(model).checkpoint_dir
    if is_gguf(checkpoint_dir):
        return HFTokenizer(os.path.dirname(checkpoint_dir), gguf_file=os.path.basename(checkpoint_dir))
    directory = checkpoint_dir or (model if os.path.isdir(model) else None)
    if directory is not None:
        return HFTokenizer(directory)
    if model.lower().startswith(("llama3", "llama-3", "meta-llama/llama-3")):
        return Llama3Tokenizer()
    if model == "tiny":
        return ByteTokenizer()
    if os.sep in model or model.startswith("."):  # a path (a missing .gguf is refused above, by resolve_model)
        raise TokenizerError(
            f"no tokenizer at {model!r}: no such folder or file; give a checkpoint folder that holds tokenizer.json, "
            "a .gguf file, or a Llama 3 preset name"
        )
    raise TokenizerError(
        f"no tokenizer for {model!r}: presets other than the Llama 3 family have none; serve a "
        "checkpoint folder that holds tokenizer.json or a .gguf file, or send token ids"
    )


def _is_gguf_preset(model: str) -> bool:
    from spanllm.model.config import GGUF_PRESETS

    return model in GGUF_PRESETS
