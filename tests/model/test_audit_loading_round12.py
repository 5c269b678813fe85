"""Hostile model inputs (round 12): what `--model` points at, refused with one line naming the value and the fix
before any rank starts, never accepted to run another model than the file's, never hanging.

Each test failed against the code before its fix:
- GGUF: a zero head count (ZeroDivisionError traceback); metadata of the wrong kind (a per-layer list, a string:
  traceback; a float context length: cut silently); a tensor's type or offset edited in the header (the wrong bytes
  dequantized without a word); a block count below the blocks present, or a bias tensor (loaded without them); a
  rope scaling factor llama.cpp applies, an expert count (ignored);
- a block count / num_hidden_layers of 2**31 / 10**9 (the checks built every layer's names: a hang);
- config.json: zero heads (traceback), 32.7 / true / "false" / null ids coerced, 0 KV heads or head_dim replaced
  by the default, a zero or negative context, rope_theta / rms_norm_eps / llama3 rope factors that make NaN, an odd
  head_dim (crashed in the rank), an EOS id outside the vocabulary (never stops);
- safetensors: a bias, a layer past num_hidden_layers, integer weights (all ignored or cast silently, the LLM API
  too); a header safetensors itself refuses (offsets that disagree with a tensor's shape and dtype, bytes past the
  last tensor: a rank's traceback after the launch). An lm_head.weight beside tied embeddings still loads (vLLM
  skips it: fine-tuning tools save one);
- serve: a tokenizer of another model (its BOS outside the vocabulary: a traceback at the warm-up).
"""

from __future__ import annotations

import json
import math
import signal

import numpy as np
import pytest
import torch

pytest.importorskip("gguf")
safetensors_torch = pytest.importorskip("safetensors.torch")
from cli_output import one_error_line  # noqa: E402
from gguf import GGUFReader, GGUFWriter  # noqa: E402
from gguf_files import write_tiny_llama  # noqa: E402

import spanllm.commands.generate  # noqa: E402
import spanllm.commands.serve  # noqa: E402
from spanllm.cli import main  # noqa: E402
from spanllm.model.config import ModelConfig, ModelConfigError, resolve_model  # noqa: E402
from spanllm.model.gguf import GGUFError  # noqa: E402
from spanllm.model.loader import CheckpointError, check_checkpoint, expected_tensors  # noqa: E402


@pytest.fixture
def no_ranks(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a rank started for bad input")

    monkeypatch.setattr(spanllm.commands.generate, "launch", refuse)
    monkeypatch.setattr(spanllm.commands.serve, "_rank", refuse)


def _generate(model) -> list[str]:
    return ["generate", "--model", str(model), "--prompt-ids", "1,2"]


def _refused(capsys, argv) -> str:
    assert main(argv) == 2
    return one_error_line(capsys)


# --- GGUF ----------------------------------------------------------------------------------------------------
@pytest.fixture
def tiny_gguf(tmp_path) -> str:
    path = tmp_path / "tiny.gguf"
    write_tiny_llama(path)  # 2 blocks, hidden 64, 4 / 2 heads of 16, every tensor F32
    return str(path)


def _set_field(path: str, key: str, value) -> None:
    r = GGUFReader(path, "r+")
    f = r.fields[key]
    f.parts[f.data[0]][0] = value
    r.data.flush()


def _set_tensor_info(path: str, name: str, part: int, value) -> None:
    """parts of a tensor info: name length, name, n_dims, dims, type, offset."""
    r = GGUFReader(path, "r+")
    (t,) = [t for t in r.tensors if t.name == name]
    t.field.parts[part][0] = value
    r.data.flush()


def test_gguf_zero_head_count_is_one_line(tiny_gguf, no_ranks, capsys):
    _set_field(tiny_gguf, "llama.attention.head_count", 0)
    line = _refused(capsys, _generate(tiny_gguf))
    assert f"{tiny_gguf}: metadata llama.attention.head_count=0 must be a positive integer" in line


@pytest.mark.parametrize(
    "method, write, shown",
    [
        ("add_head_count_kv", lambda w, n: w.add_array("llama.attention.head_count_kv", [n, n]), "= [2, 2]"),
        ("add_head_count_kv", lambda w, n: w.add_string("llama.attention.head_count_kv", "two"), "= two"),
        ("add_context_length", lambda w, n: w.add_float32("llama.context_length", 256.5), "= 256.5"),
    ],
    ids=["per-layer list", "string", "float"],
)
def test_gguf_metadata_of_the_wrong_kind(tmp_path, no_ranks, capsys, monkeypatch, method, write, shown):
    path = tmp_path / "kind.gguf"
    monkeypatch.setattr(GGUFWriter, method, write)
    write_tiny_llama(path)
    monkeypatch.undo()
    line = _refused(capsys, _generate(path))
    key = "llama.context_length" if method == "add_context_length" else "llama.attention.head_count_kv"
    assert f"metadata key '{key}' {shown} must be one integer" in line
    assert ("(per-layer values are not supported)" in line) == shown.startswith("= [")


F16 = 1  # GGMLQuantizationType.F16


@pytest.mark.parametrize(
    "tensor, part, value, message",
    [
        (
            "blk.0.attn_q.weight",
            4,
            F16,
            "but the tensor before it, 'blk.0.attn_q.weight' (F16, shape (64, 64)), ends at",
        ),
        (
            "blk.1.ffn_down.weight",
            4,
            F16,
            "bytes follow the last tensor 'blk.1.ffn_down.weight' (F16, shape (64, 128)), more than its padding",
        ),
        ("blk.0.attn_q.weight", 5, 0, "tensor 'blk.0.attn_q.weight' starts at data offset 0, but the tensor before"),
    ],
    ids=["type of a tensor", "type of the last tensor", "offset"],
)
def test_gguf_header_edited_tensor_is_refused(tiny_gguf, no_ranks, capsys, tensor, part, value, message):
    """The reader would dequantize the bytes the edited header points at: half of one tensor, parts of two."""
    _set_tensor_info(tiny_gguf, tensor, part, value)
    line = _refused(capsys, _generate(tiny_gguf))
    assert message in line
    assert "a tensor's type or shape in the header does not match its data (the file is corrupted)" in line
    assert "copy or download it again" in line


def test_gguf_block_count_below_the_blocks_present(tiny_gguf, no_ranks, capsys):
    _set_field(tiny_gguf, "llama.block_count", 1)
    line = _refused(capsys, _generate(tiny_gguf))
    assert "holds tensor 'blk.1.attn_k.weight' (9 such tensor(s)), of a block past block_count=1" in line
    assert "it would be ignored and the model run without it" in line


def test_gguf_bias_tensor_is_refused(tmp_path, no_ranks, capsys, monkeypatch):
    real = GGUFWriter.add_tensor

    def add(self, name, tensor, *a, **k):
        real(self, name, tensor, *a, **k)
        if name == "blk.0.attn_q.weight":
            real(self, "blk.0.attn_q.bias", np.zeros(64, np.float32))

    monkeypatch.setattr(GGUFWriter, "add_tensor", add)
    path = tmp_path / "bias.gguf"
    write_tiny_llama(path)
    monkeypatch.undo()
    line = _refused(capsys, _generate(path))
    assert "holds tensor 'blk.0.attn_q.bias' (1 such tensor(s)), which a Llama model of this engine has no" in line


@pytest.mark.parametrize(
    "key, value, message",
    [
        (
            "llama.rope.scaling.factor",
            4.0,
            "llama.rope.scaling.factor=4.0 (rope positions scaled by 1/4.0, as llama.cpp runs it) is not supported",
        ),
        ("llama.rope.scale_linear", 2.0, "llama.rope.scale_linear=2.0 (rope positions scaled by 1/2.0"),
        ("llama.expert_count", 8, "llama.expert_count=8: a mixture-of-experts model (Mixtral-style); this engine"),
    ],
    ids=["rope scaling factor without a type", "old linear scale key", "experts"],
)
def test_gguf_metadata_the_engine_would_ignore(tmp_path, no_ranks, capsys, monkeypatch, key, value, message):
    real = GGUFWriter.add_eos_token_id

    def add(self, n):
        real(self, n)
        (self.add_uint32 if isinstance(value, int) else self.add_float32)(key, value)

    monkeypatch.setattr(GGUFWriter, "add_eos_token_id", add)
    path = tmp_path / "meta.gguf"
    write_tiny_llama(path)
    monkeypatch.undo()
    assert message in _refused(capsys, _generate(path))


@pytest.fixture
def deadline():
    """A check that builds a name per layer of a corrupted count runs for hours: fail it after 30 s instead."""

    def expire(signum, frame):
        raise TimeoutError("the checks did not finish in 30 s")

    old = signal.signal(signal.SIGALRM, expire)
    signal.alarm(30)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


def test_huge_gguf_block_count_is_refused_at_once(tiny_gguf, deadline):
    _set_field(tiny_gguf, "llama.block_count", 2**31)
    cfg = resolve_model(tiny_gguf)
    with pytest.raises(GGUFError) as e:
        check_checkpoint(cfg)
    assert "tensor 'blk.2.attn_norm.weight' (model.layers.2.input_layernorm.weight) is missing" in str(e.value)
    assert "(block_count=2147483648, blocks present: 2)" in str(e.value)


# --- HF checkpoint folders -----------------------------------------------------------------------------------
CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "eos_token_id": 2,
}


def _checkpoint(d, config=None, change=None) -> str:
    """A small checkpoint folder: config.json (CONFIG, or `config`) and model.safetensors of CONFIG's tensors,
    `change(tensors)` applied."""
    d.mkdir(exist_ok=True)
    g = torch.Generator().manual_seed(0)
    shapes = expected_tensors(ModelConfig.from_hf_config(dict(CONFIG)))
    tensors = {n: torch.randn(s, generator=g) * 0.05 for n, s in shapes.items()}
    if change is not None:
        change(tensors)
    safetensors_torch.save_file(tensors, str(d / "model.safetensors"))
    (d / "config.json").write_text(json.dumps(config or CONFIG))
    return str(d)


FP8_REGEX_IGNORE = {
    "quant_method": "compressed-tensors",
    "format": "float-quantized",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "dynamic": False, "symmetric": True},
            "input_activations": {
                "num_bits": 8,
                "type": "float",
                "strategy": "token",
                "dynamic": True,
                "symmetric": True,
            },
        }
    },
    "ignore": ["re:.*lm_head"],
}


@pytest.mark.parametrize("extra", [{}, {"quantization_config": FP8_REGEX_IGNORE}], ids=["bf16", "fp8 regex ignore"])
def test_huge_num_hidden_layers_is_refused_at_once(tmp_path, deadline, extra):
    d = _checkpoint(tmp_path / "ckpt", {**CONFIG, "num_hidden_layers": 10**9, **extra})
    with pytest.raises(CheckpointError) as e:
        check_checkpoint(ModelConfig.from_hf_config(d))
    assert "tensor 'model.layers.2.input_layernorm.weight' is missing from the checkpoint" in str(e.value)
    assert "(config.json: num_hidden_layers=1000000000; layers present: 2)" in str(e.value)


def test_zero_attention_heads_is_one_line(tmp_path, no_ranks, capsys):
    d = _checkpoint(tmp_path / "ckpt", {**CONFIG, "num_attention_heads": 0})
    line = _refused(capsys, _generate(d))
    assert f"--model: {d}/config.json: num_attention_heads=0 must be a positive integer" in line


NAN = float("nan")
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}


CONFIG_CASES = [
    # values of the wrong type, once coerced into another model
    ({"hidden_size": 32.7}, "a value has the wrong type (hidden_size=32.7 is not a whole number)"),
    ({"hidden_size": True}, "a value has the wrong type (hidden_size=True is not a whole number)"),
    ({"tie_word_embeddings": "false"}, "(tie_word_embeddings='false' is not true or false)"),
    ({"eos_token_id": [2, None]}, "(eos_token_id holds None, which is not a token id (an integer))"),
    # zeros once replaced by the defaults
    ({"num_key_value_heads": 0}, "num_kv_heads=0 must be a positive integer"),
    ({"head_dim": 0}, "head_dim=0 must be a positive integer"),
    # sizes once accepted
    ({"max_position_embeddings": 0}, "max_position_embeddings=0 must be a positive integer"),
    ({"max_position_embeddings": -5}, "max_position_embeddings=-5 must be a positive integer"),
    ({"hidden_size": 28}, "head_dim=7 must be even: rotary embeddings turn pairs of dimensions"),
    # values that make NaN
    ({"rope_theta": 0}, "rope_theta=0.0 must be a finite number > 0"),
    ({"rope_theta": -1.0}, "rope_theta=-1.0 must be a finite number > 0"),
    ({"rope_theta": NAN}, "rope_theta=nan must be a finite number > 0"),
    ({"rms_norm_eps": -1e-5}, "rms_norm_eps=-1e-05 must be a finite number >= 0"),
    (
        {"rope_scaling": {**LLAMA3, "factor": 0.0, "original_max_position_embeddings": 64}},
        "rope scaling factor=0.0, low_freq_factor=1.0, high_freq_factor=4.0: the llama3 rope type needs finite "
        "values with factor > 0 and 0 < low_freq_factor < high_freq_factor",
    ),
    (
        {"rope_scaling": {**LLAMA3, "high_freq_factor": 1.0, "original_max_position_embeddings": 64}},
        "high_freq_factor=1.0: the llama3 rope type needs",
    ),
    (
        {"rope_scaling": {**LLAMA3, "original_max_position_embeddings": 0}},
        "rope scaling original_max_position_embeddings=0 must be a positive integer",
    ),
    # an EOS the model can never produce
    ({"eos_token_id": 1000}, "eos_token_id 1000 is not a token id of the vocabulary [0, 64) (vocab_size)"),
]


@pytest.mark.parametrize("change, message", CONFIG_CASES, ids=[json.dumps(c)[:60] for c, _ in CONFIG_CASES])
def test_config_values_refused(change, message):
    with pytest.raises(ModelConfigError) as e:
        ModelConfig.from_hf_config({**CONFIG, **change})
    assert message in str(e.value)


def test_config_values_transformers_reads_as_defaults_still_load():
    """A whole float, null KV heads / head_dim / tie (transformers: the defaults, untied)."""
    c = ModelConfig.from_hf_config(
        {**CONFIG, "hidden_size": 32.0, "num_key_value_heads": None, "head_dim": None, "tie_word_embeddings": None}
    )
    assert (c.hidden_size, c.num_kv_heads, c.head_dim, c.tie_word_embeddings) == (32, 4, 8, False)
    assert math.isclose(c.rope_theta, 10000.0)


def test_generation_config_eos_outside_the_vocabulary(tmp_path):
    d = _checkpoint(tmp_path / "ckpt")
    (tmp_path / "ckpt" / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 64]}))
    with pytest.raises(ModelConfigError) as e:
        ModelConfig.from_hf_config(d)
    assert f"{d}/generation_config.json: ckpt: eos_token_id 64 is not a token id of the vocabulary [0, 64)" in str(
        e.value
    )


def _add(name, value):
    return lambda t: t.__setitem__(name, value)


@pytest.mark.parametrize(
    "config, change, message",
    [
        (
            None,
            _add("model.layers.0.self_attn.q_proj.bias", torch.zeros(32)),
            "holds tensor 'model.layers.0.self_attn.q_proj.bias' (1 tensor(s) the model would not load), which the "
            "model config.json describes has no place for (this engine builds bias-free Llama models",
        ),
        (
            None,
            _add("model.layers.2.input_layernorm.weight", torch.ones(32)),
            "holds tensor 'model.layers.2.input_layernorm.weight' (1 tensor(s) the model would not load), of a layer "
            "past config.json's num_hidden_layers=2",
        ),
        (
            None,
            _add("model.layers.0.mlp.up_proj.weight", torch.ones(64, 32, dtype=torch.int8)),
            "tensor 'model.layers.0.mlp.up_proj.weight' is I8; the engine loads floating-point weights (BF16, F16, "
            "F32, F64)",
        ),
        (
            None,
            _add("model.norm.weight", torch.ones(32, dtype=torch.int32)),
            "tensor 'model.norm.weight' is I32; the engine loads floating-point weights",
        ),
    ],
    ids=["bias", "layer past the count", "int8 weight", "int32 norm"],
)
def test_checkpoint_tensors_the_model_would_not_load(tmp_path, no_ranks, capsys, config, change, message):
    d = _checkpoint(tmp_path / "ckpt", config, change)
    line = _refused(capsys, _generate(d))
    assert f"{d}/model.safetensors: " in line and message in line


def _edit_header(path: str, change) -> tuple[int, int]:
    """change(header) on model.safetensors' JSON header (kept at its length); model.norm.weight's data_offsets."""
    b = open(path, "rb").read()
    n = int.from_bytes(b[:8], "little")
    header = json.loads(b[8 : 8 + n])
    change(header)
    text = json.dumps(header, separators=(",", ":")).encode()
    assert len(text) <= n
    open(path, "wb").write(b[:8] + text.ljust(n) + b[8 + n :])
    return tuple(header["model.norm.weight"]["data_offsets"])


def test_safetensors_header_safetensors_would_refuse_in_the_rank(tmp_path, no_ranks, capsys):
    """A header whose offsets disagree with a tensor's shape and dtype passed the checks, and the rank's safe_open
    failed with a SafetensorError traceback (exit 1) after the launch."""
    d = _checkpoint(tmp_path / "ckpt")
    path = f"{d}/model.safetensors"

    def one_float_short(h):
        start, stop = h["model.norm.weight"]["data_offsets"]
        h["model.norm.weight"]["data_offsets"] = [start, stop - 4]

    start, stop = _edit_header(path, one_float_short)
    line = _refused(capsys, _generate(d))
    assert (
        f"{path}: the safetensors header is damaged: tensor 'model.norm.weight' (F32, shape (32,): 128 bytes) takes "
        f"bytes [{start}, {stop}) of the data, and the tensors before it end at {start}; copy or download the file "
        "again" in line
    )
    d = _checkpoint(tmp_path / "tail")
    path = f"{d}/model.safetensors"
    b = open(path, "rb").read()
    data = len(b) - 8 - int.from_bytes(b[:8], "little")
    with open(path, "ab") as f:
        f.write(bytes(8))
    line = _refused(capsys, _generate(d))
    assert (
        f"{path}: the safetensors header is damaged: its tensors cover {data} bytes of data, and the file holds "
        f"{data + 8} (safetensors refuses bytes no tensor covers); copy or download the file again" in line
    )


def test_rotary_inv_freq_buffers_of_older_checkpoints_still_load(tmp_path):
    d = _checkpoint(tmp_path / "ckpt", change=_add("model.layers.0.self_attn.rotary_emb.inv_freq", torch.ones(4)))
    check_checkpoint(ModelConfig.from_hf_config(d))


def test_lm_head_beside_tied_embeddings_loads_as_the_embedding(tmp_path):
    """Fine-tuned checkpoints with tie_word_embeddings=true may hold lm_head.weight too; vLLM skips it
    (vllm-project/vllm#6758), and so does this engine: the head is the embedding, not the file's lm_head."""
    from spanllm.engine.config import EngineConfig
    from spanllm.engine.llm import LLM

    d = _checkpoint(tmp_path / "ckpt", {**CONFIG, "tie_word_embeddings": True})
    assert "lm_head.weight" in safetensors_torch.load_file(f"{d}/model.safetensors")
    check_checkpoint(ModelConfig.from_hf_config(d))
    llm = LLM(d, EngineConfig(dtype=torch.float32, max_num_seqs=2, max_num_batched_tokens=16), device="cpu")
    embed = safetensors_torch.load_file(f"{d}/model.safetensors")["model.embed_tokens.weight"]
    assert llm.model.lm_head.weight is llm.model.model.embed_tokens.weight
    assert torch.equal(llm.model.lm_head.weight[: CONFIG["vocab_size"]], embed)
    llm.close()


def test_llm_api_takes_a_pathlib_path(tmp_path):
    """LLM(Path(folder)) was refused as 'not a model' (it named the checkpoint folder it was given as the fix)."""
    from spanllm.engine.config import EngineConfig
    from spanllm.engine.llm import LLM

    d = _checkpoint(tmp_path / "ckpt")
    llm = LLM(tmp_path / "ckpt", EngineConfig(dtype=torch.float32, max_num_seqs=2, max_num_batched_tokens=16))
    assert llm.config.checkpoint_dir == d and llm.config.num_layers == CONFIG["num_hidden_layers"]
    llm.close()


def test_llm_api_refuses_integer_weights(tmp_path):
    """LLM(dir) loads without check_checkpoint: the loader itself refuses a cast of integer values."""
    from spanllm.engine.config import EngineConfig
    from spanllm.engine.llm import LLM

    d = _checkpoint(
        tmp_path / "ckpt", change=_add("model.layers.1.mlp.down_proj.weight", torch.ones(32, 64, dtype=torch.int8))
    )
    with pytest.raises(CheckpointError) as e:
        LLM(d, EngineConfig(dtype=torch.float32, max_num_seqs=2, max_num_batched_tokens=16), device=torch.device("cpu"))
    assert "tensor 'model.layers.1.mlp.down_proj.weight' is torch.int8 in the checkpoint; the engine loads " in str(
        e.value
    )


def test_serve_refuses_the_tokenizer_of_another_model(tmp_path, no_ranks, capsys):
    """A tokenizer whose BOS (150) is past the model's 64 ids: the warm-up's prompt failed in the engine loop
    (a RuntimeError traceback), after the weights loaded."""
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers

    d = _checkpoint(tmp_path / "ckpt")
    words = [f"w{i}" for i in range(200)]
    words[150], words[2] = "<s>", "</s>"
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(f"{d}/tokenizer.json")
    (tmp_path / "ckpt" / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>"})
    )
    line = _refused(capsys, ["serve", "--model", d, "--port", "0"])
    assert (
        f"--model {d}: its tokenizer's BOS token is id 150 (200 tokens), outside the model's vocabulary [0, 64) "
        "(vocab_size); the tokenizer files belong to another model: copy the checkpoint's own tokenizer.json" in line
    )
