"""Bad input to every command: one line `spanllm: error: ...` naming the value, the limit and the fix, exit
code 2 (usage) or 1 (a failed run), and no rank started. In-process through `spanllm.cli.main`."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from cli_output import one_error_line

import spanllm.commands.bench_allreduce
import spanllm.commands.bench_batch
import spanllm.commands.bench_study
import spanllm.commands.demo
import spanllm.commands.generate
import spanllm.commands.tune
from spanllm.cli import main
from spanllm.errors import RankError

COMMAND_MODULES = (
    spanllm.commands.bench_allreduce,
    spanllm.commands.bench_batch,
    spanllm.commands.bench_study,
    spanllm.commands.tune,
    spanllm.commands.demo,
    spanllm.commands.generate,
)


@pytest.fixture
def no_ranks(monkeypatch):
    """Every check runs in the launching process: starting a rank is a failure of the test."""

    def refuse(*args, **kwargs):
        raise AssertionError("ranks started for bad input")

    for mod in COMMAND_MODULES:
        monkeypatch.setattr(mod, "launch", refuse)


GEN = ["generate", "--model", "tiny", "--prompt-ids", "1,2,3"]
BATCH = ["bench", "batch", "--model", "tiny"]
THROUGHPUT = ["bench", "throughput", "--model", "tiny", "--dataset-name", "random", "--num-prompts", "4"]
STUDY = ["bench", "study", "--model", "tiny", "--nprocs", "2"]
AR = ["bench", "allreduce", "--nprocs", "2"]
TUNE = ["tune", "--out", os.path.join(os.path.dirname(__file__), "never-written.json")]

MISSING_TILING = os.path.join(os.path.dirname(__file__), "no-such-tiling.json")

CASES = [
    # engine flags read from files: before any rank starts
    (
        ["bench", "throughput", "--model", "tiny", "--prefill-tiling", MISSING_TILING],
        f"--prefill-tiling {MISSING_TILING}: {MISSING_TILING}: [Errno 2] No such file or directory",
    ),
    (["bench", "throughput", "--model", "tiny", "--long-prefill-attention-budget", "-1"], "must be >= 0 (0: no limit)"),
    # generate: token ids, lengths, sampling
    (
        ["generate", "--model", "tiny", "--prompt-ids", "1,2,600"],
        "--prompt-ids #0 ('1,2,600'): prompt token 2 is 600, outside the vocabulary [0, 512); use ids from 0 to 511",
    ),
    (
        ["generate", "--model", "tiny", "--prompt-ids", "1", "--prompt-ids=-1,4"],
        "--prompt-ids #1 ('-1,4'): prompt token 0 is -1, outside the vocabulary [0, 512)",
    ),
    (["generate", "--model", "tiny", "--prompt-ids", "1,x"], "--prompt-ids '1,x': expected comma-separated integers"),
    (
        ["generate", "--model", "tiny", "--prompt-ids", ""],
        "--prompt-ids #0 (''): the prompt is empty: give at least one token",
    ),
    (["generate", "--model", "tiny"], "give at least one --prompt-ids or --prompt"),
    (["generate", "--model", "tiny", "--prompt", "hello"], "--prompt needs a checkpoint directory with a tokenizer"),
    (
        GEN + ["--max-new-tokens", "5000"],
        "maximum context length is 4096 tokens. However, you requested 5003 tokens (3 in the prompt, 5000 for the "
        "completion). Reduce the prompt or max_tokens (the limit: max_position_embeddings of tiny)",
    ),
    (
        GEN + ["--max-new-tokens", "10", "--max-model-len", "12"],
        "maximum context length is 12 tokens. However, you requested 13 tokens (3 in the prompt, 10 for the "
        "completion). Reduce the prompt or max_tokens (the limit: --max-model-len)",
    ),
    (GEN + ["--max-model-len", "8192"], "--max-model-len 8192 exceeds the 4096 positions tiny was trained for"),
    (GEN + ["--max-new-tokens", "0"], "--max-new-tokens 0: must be >= 1"),
    (GEN + ["--top-p", "0"], "--top-p 0.0: must be in (0, 1]"),
    (GEN + ["--temperature", "-1"], "--temperature -1: must be in [0, 100] (0 = greedy)"),
    # layout and topology
    (GEN + ["--tp", "0"], "--tp 0: must be >= 1"),
    (GEN + ["--pp", "0"], "--pp 0: must be >= 1 (pipeline stages)"),
    (GEN + ["--pp", "3", "--nprocs", "2"], "--pp 3 does not divide the 2 ranks"),
    (GEN + ["--tp", "3", "--nprocs", "3"], "--tp/--pp: tp=3 does not divide num_heads=8 of tiny"),
    (GEN + ["--tp", "1", "--nprocs", "2"], "--tp/--pp: tp=1 x pp=1 = 1 ranks, but the world has 2"),
    (GEN + ["--pp", "8", "--nprocs", "8"], "pp=8 exceeds the 4 layers of tiny"),
    (GEN + ["--nprocs", "0"], "--nprocs 0: must be >= 1 (local gloo ranks)"),
    (
        GEN + ["--nprocs", "4", "--ranks-per-node", "3"],
        "--ranks-per-node 3: world_size=4 is not divisible by ranks_per_node=3",
    ),
    (
        GEN + ["--nprocs", "2", "--ranks-per-node", "0"],
        "--ranks-per-node 0: ranks_per_node=0 must be a positive integer",
    ),
    (GEN + ["--micro-batches", "0"], "--micro-batches 0: must be >= 1"),
    (GEN + ["--nprocs", "100000"], "--nprocs 100000: more local ranks than this machine runs usefully (at most "),
    # names: dtype, all-reduce, GEMM, removed flags, model
    (GEN + ["--dtype", "fp8"], "--dtype 'fp8' is not supported; choose one of auto, float32"),
    (
        GEN + ["--nprocs", "2", "--allreduce", "ring"],
        "--allreduce 'ring': no such all-reduce algorithm; registered: ref_ring",
    ),
    (GEN + ["--nprocs", "2", "--allreduce", "nvrar"], "--allreduce nvrar: runs on cuda only"),
    # bench host's bounds (a run's block lists and queue live in host memory)
    (["bench", "host", "--prompt-len", "100000000"], "--prompt-len 100000000 + --output-len 150: more than 131072"),
    (["bench", "host", "--max-num-seqs", "100000", "--prompt-len", "4000"], "more than 4194304; give fewer"),
    (["bench", "host", "--requests", "100000000"], "--requests 100000000: at most 100000"),
    # one rank runs no all-reduce: a name given there would be accepted and never used
    (GEN + ["--allreduce", "ref_ring"], "--allreduce ref_ring: this run has one rank, where no all-reduce runs"),
    (BATCH + ["--allreduce", "gloo"], "--allreduce gloo: this run has one rank, where no all-reduce runs"),
    # bench throughput and serve check the name before any rank starts, as generate and bench batch do
    (THROUGHPUT + ["--nprocs", "2", "--allreduce", "nosuch"], "--allreduce 'nosuch': no such all-reduce algorithm"),
    (THROUGHPUT + ["--allreduce", "gloo"], "--allreduce gloo: this run has one rank"),
    (["serve", "--model", "tiny", "--nprocs", "2", "--allreduce", "nvrar"], "--allreduce nvrar: runs on cuda only"),
    (GEN + ["--decode-gemm", "skinny"], "--decode-gemm skinny: a Triton kernel for CUDA GPUs"),
    (GEN + ["--pdl", "on"], "--pdl on: programmatic dependent launch of Triton kernels on a GPU, and these ranks"),
    (BATCH + ["--pdl", "on"], "--pdl on: programmatic dependent launch of Triton kernels on a GPU"),
    (
        ["generate", "--model", "/no/such/folder", "--prompt-ids", "1"],
        "--model: no such checkpoint folder '/no/such/folder'",
    ),
    (["generate", "--model", "./llama-8b", "--prompt-ids", "1"], "no such checkpoint folder './llama-8b'"),
    (["generate", "--model", "llama9", "--prompt-ids", "1"], "--model: unknown preset 'llama9'; choose one of"),
    (["generate", "--model", "tiny:layers=x", "--prompt-ids", "1"], "write ':layers=N' with N a whole number"),
    (
        ["generate", "--model", "tiny:layers=8", "--prompt-ids", "1"],
        "'tiny:layers=8': layers=8 must be between 1 and 4",
    ),
    # bench batch
    (BATCH + ["--iters", "0"], "--iters 0: must be >= 1"),
    (BATCH + ["--warmup", "-3"], "--warmup -3: must be >= 0"),
    (
        BATCH + ["--prompt-len", "5000"],
        "--prompt-len + --decode-len: 5000 + 512 = 5512 tokens exceed the context of 4096",
    ),
    (BATCH + ["--prompt-len", "0"], "prompt_len=0 and decode_len=512 must be >= 1"),
    (BATCH + ["--breakdown-steps", "0"], "--breakdown-steps 0: must be >= 1"),
    (BATCH + ["--batch-sizes", "1,x"], "--batch-sizes '1,x': expected a comma-separated list"),
    (BATCH + ["--batch-sizes", "0"], "--batch-sizes '0': give positive integers"),
    (BATCH + ["--nprocs", "2", "--tp", "0"], "--tp 0: must be >= 1"),
    (BATCH + ["--nprocs", "2", "--pp", "0"], "--pp 0: must be >= 1"),
    (BATCH + ["--nprocs", "2", "--allreduce", "gloo,nope"], "--allreduce 'nope': no such all-reduce algorithm"),
    (BATCH + ["--nprocs", "2", "--allreduce", "nccl"], "--allreduce nccl: runs on cuda only"),
    (BATCH + ["--tuning", "/no/table.json"], "--tuning: cannot read tuning table '/no/table.json'"),
    # bench study: the micro-batch list and --pp before the first layout
    (STUDY + ["--micro-batches", "1,x"], "--micro-batches '1,x': 'x' is not a count"),
    (STUDY + ["--micro-batches", "0"], "--micro-batches '0': '0' is not a count"),
    (
        STUDY + ["--pp", "4"],
        "--pp 4: no valid layout of 2 ranks has that pipeline degree; valid: TP=2 x PP=1, TP=1 x PP=2",
    ),
    (STUDY + ["--pp", "two"], "--pp 'two': pipeline degrees are integers"),
    (STUDY + ["--iters", "0"], "--iters 0: must be >= 1"),
    # bench allreduce
    (AR + ["-e", "64G"], "the largest message (68719476736 bytes, from -e/--maxbytes) needs about"),
    (AR + ["--dtype", "fp8"], "--dtype: unknown dtype 'fp8'"),
    (AR + ["--algos", "nvrar"], "--algos nvrar: runs on cuda only"),
    (AR + ["--algos", "gloo,foo"], "--algos 'foo': no such all-reduce algorithm"),
    (AR + ["-n", "0"], "-n/--iters 0: must be >= 1"),
    (AR + ["-w", "-1"], "-w/--warmup_iters -1: must be >= 0"),
    (AR + ["-c", "2"], "-c/--check 2: 1 checks every result, 0 skips the check"),
    (AR + ["--calls-per-sample", "0"], "--calls-per-sample 0: must be >= 1"),
    (AR + ["--graph"], "--graph needs GPUs"),
    (AR + ["--buffer-bytes", "lots"], "--buffer-bytes: size 'lots' is not a byte count"),
    (AR + ["--ranks-per-node", "3"], "--ranks-per-node 3: world_size=2 is not divisible by ranks_per_node=3"),
    (AR + ["-f", "1"], "-f 1.0: the size factor must be > 1"),
    (AR + ["-b", "0"], "sizes -b 0 -e 1048576: need 0 < begin <= end"),
    (AR + ["--rounds", "0"], "--rounds 0: must be between 1 and --iters (20)"),
    (AR + ["--plot", "x.png"], "--plot draws from the JSON rows: add --json FILE"),
    (AR + ["--nprocs", "0"], "--nprocs 0: must be >= 1"),
    # tune, demo
    (TUNE + ["-e", "64G"], "the largest message (68719476736 bytes, from -e/--maxbytes) needs about"),
    (["tune", "--out", __file__ + "/t.json"], f"--out {__file__}/t.json: cannot create its folder {__file__}"),
    (TUNE + ["--protocols", "ll9"], "--protocols 'll9': 'll9' is not an nvrar protocol; choose from ll8, simple"),
    (TUNE + ["--blocks", "0,4"], "--blocks '0,4': give comma-separated integers >= 1"),
    (TUNE + ["--pipelined", "2"], "--pipelined '2': give comma-separated values in [0, 1]"),
    (TUNE + ["-n", "0"], "-n/--iters 0: must be >= 1"),
    (["demo", "--nprocs", "3"], "--ranks-per-node 2: world_size=3 is not divisible by ranks_per_node=2"),
    (["demo", "--nprocs", "3", "--ranks-per-node", "1"], "--nprocs 3: the engine part runs the tiny model at TP=3"),
    (["demo", "--maxbytes", "64G"], "from --maxbytes) needs about"),
    (["demo", "--iters", "0"], "--iters 0: must be >= 1"),
    # generate: sampling ranges, the batch's micro-batches and KV blocks, before any rank starts
    (GEN + ["--temperature", "200"], "--temperature 200: must be in [0, 100] (0 = greedy)"),
    (GEN + ["--temperature", "nan"], "--temperature nan: must be in [0, 100] (0 = greedy)"),
    (
        GEN + ["--top-k", "100000000", "--temperature", "0.5"],
        "--top-k 100000000: exceeds the vocabulary of 512 tokens; use at most 512",
    ),
    # honoured or refused: a cut of greedy decoding's candidates could never change its token
    (GEN + ["--top-k", "5"], "--top-k: greedy decoding (--temperature 0, the default) takes the most likely token"),
    (GEN + ["--top-p", "0.9", "--top-k", "5"], "--top-k and --top-p: greedy decoding"),
    (THROUGHPUT + ["--num-kv-blocks", "999999999"], "num_kv_blocks=999999999: 30517.6 GiB of KV cache"),
    (GEN + ["--micro-batches", "2"], "--micro-batches 2: more than the 1 prompt(s) of the batch; give at most 1"),
    (
        GEN + ["--prompt-ids", "1,2", "--num-kv-blocks", "3", "--max-new-tokens", "20"],
        "--num-kv-blocks 3: 2 sequence(s) of up to 23 tokens need 5 blocks of 16 tokens (block 0 is reserved)",
    ),
    (GEN + ["--block-size", "100000"], "--block-size 100000: one KV block would hold more than a sequence's whole"),
    (["generate", "--model", "tiny", "--prompt-ids", "1,,2"], "--prompt-ids '1,,2': expected comma-separated"),
    (GEN + ["--prefill-tiling", ""], "--prefill-tiling '' is empty: give a PrefillConfig JSON file"),
    (
        ["generate", "--model", "/", "--prompt-ids", "1"],
        "pass an HF checkpoint directory, a .gguf file or a preset (llama3.1-8b, llama3.1-70b, llama3.1-405b, "
        "tiny, smollm2-135m-instruct)",
    ),
    # bench batch / study: micro-batches above every batch size, flags of a skipped pass, empty list items
    (
        BATCH + ["--batch-sizes", "1", "--micro-batches", "2"],
        "--micro-batches 2: more micro-batches than the largest batch (1 sequences, --batch-sizes)",
    ),
    (BATCH + ["--no-breakdown", "--breakdown-steps", "3"], "--breakdown-steps 3 sizes the per-op timing pass"),
    (BATCH + ["--allreduce", ""], "--allreduce '': expected a comma-separated list (no empty items)"),
    (BATCH + ["--batch-sizes", "1,,8"], "--batch-sizes '1,,8': expected a comma-separated list (no empty items)"),
    (
        STUDY + ["--batch-sizes", "1", "--micro-batches", "4"],
        "--micro-batches '4': more micro-batches than the largest batch (1 sequences, --batch-sizes)",
    ),
    # global options
    (["--pg-timeout", "0"] + GEN, "--pg-timeout 0: the collective timeout must be in (0, 604800] seconds"),
    (["--pg-timeout", "inf"] + GEN, "--pg-timeout inf: the collective timeout must be in (0, 604800] seconds"),
    (["--pg-timeout", "soon"] + GEN, "--pg-timeout 'soon': give the collective timeout in seconds"),
    (GEN + ["--pg-timeout", "-1"], "--pg-timeout -1: the collective timeout must be in (0, 604800] seconds"),
]


@pytest.mark.parametrize("argv,needle", CASES, ids=[" ".join(a)[:70] for a, _ in CASES])
def test_bad_input_is_one_line_exit_2(no_ranks, capsys, argv, needle):
    assert main(argv) == 2
    assert needle in one_error_line(capsys)


CPU_ONLY = [
    (GEN + ["--attention-backend", "triton"], "--attention-backend triton: Triton kernels for CUDA GPUs, and these "),
    (
        GEN
        + [
            "--prefill-tiling",
            os.path.join(
                os.path.dirname(__file__), "..", "results", "h100", "long_context", "best_prefill_config.json"
            ),
        ],
        "tiles the Triton prefill kernel, which this run does not use (--attention-backend auto on CPU ranks)",
    ),
    (GEN + ["--gpu-memory-utilization", "0.5"], "--gpu-memory-utilization 0.5 sizes the KV cache on a GPU, and "),
]


@pytest.mark.skipif(torch.cuda.is_available(), reason="options refused on CPU ranks")
@pytest.mark.parametrize("argv,needle", CPU_ONLY, ids=[" ".join(a[5:])[:50] for a, _ in CPU_ONLY])
def test_gpu_options_on_cpu_ranks_are_refused(no_ranks, capsys, argv, needle):
    assert main(argv) == 2
    assert needle in one_error_line(capsys)


def test_a_fixed_batch_the_engine_cannot_run_is_a_usage_error():
    """GenerationError (raised in a rank, e.g. a batch whose KV blocks do not fit the cache sized there) exits 2."""
    from spanllm.engine.fixed_batch import GenerationError
    from spanllm.errors import exit_code

    assert exit_code(GenerationError("micro_batches=2 must be between 1 and the batch size 1")) == 2


def test_memory_refusal_names_the_number_and_the_limit(no_ranks, capsys):
    assert main(AR + ["-e", "64G"]) == 2
    line = one_error_line(capsys)
    assert "(2 ranks x" in line and "GiB is available; lower -e/--maxbytes, or run fewer ranks" in line


def test_long_context_needs_the_explicit_switch(no_ranks, monkeypatch, capsys):
    monkeypatch.setenv("SPANLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    assert main(GEN + ["--max-model-len", "8192", "--max-new-tokens", "5000", "--nprocs", "0"]) == 2
    assert "--nprocs 0" in one_error_line(capsys)  # the long context passed; the next check failed


def test_argparse_errors_keep_exit_2(capsys):
    with pytest.raises(SystemExit) as e:
        main(["generate", "--model", "tiny", "--max-new-tokens", "many"])
    assert e.value.code == 2
    assert "argument --max-new-tokens: invalid int value: 'many'" in capsys.readouterr().err


@pytest.mark.parametrize("where", ["before", "after", "env"])
def test_debug_shows_the_traceback(no_ranks, monkeypatch, capsys, where):
    argv = GEN + ["--tp", "0"]
    if where == "before":
        argv = ["--debug"] + argv
    elif where == "after":
        argv = argv + ["--debug"]
    else:
        monkeypatch.setenv("SPANLLM_DEBUG", "1")
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and "UsageError" in err
    assert (
        err.strip().splitlines()[-1] == "spanllm: error: --tp 0: must be >= 1 (tensor-parallel degree; leave it "
        "out for world size / --pp)"
    )
    if where != "env":
        assert "SPANLLM_DEBUG" not in os.environ  # main restores the environment it changed


@pytest.mark.parametrize("known,code", [(True, 2), (False, 1)])
def test_rank_errors(monkeypatch, capsys, known, code):
    """A rank's project error is its one line; anything else (a bug) shows the rank's traceback first."""

    def fail(*args, **kwargs):
        raise RankError(
            "rank 1: token id 7 is bad" if known else "rank 1 raised IndexError: index 7 is out of bounds",
            rank=1,
            type_name="UsageError" if known else "IndexError",
            traceback="Traceback (most recent call last):\n  ...\nIndexError: index 7",
            exit_code=code,
            known=known,
        )

    monkeypatch.setattr(spanllm.commands.generate, "launch", fail)
    assert main(GEN) == code
    err = capsys.readouterr().err
    if known:
        assert err == "spanllm: error: rank 1: token id 7 is bad\n"
    else:
        assert "--- traceback of rank 1 ---" in err and "IndexError: index 7" in err
        assert err.strip().splitlines()[-1] == "spanllm: error: rank 1 raised IndexError: index 7 is out of bounds"


def test_pg_timeout_reaches_the_ranks(monkeypatch):
    seen = {}

    def fake_launch(fn, *args, nprocs=1, **kwargs):
        from spanllm.launch import pg_timeout_s

        seen["timeout"] = pg_timeout_s()
        raise RankError("rank 0: stop here", rank=0, type_name="UsageError", exit_code=2, known=True)

    monkeypatch.setattr(spanllm.commands.generate, "launch", fake_launch)
    assert main(["--pg-timeout", "7.5"] + GEN) == 2
    assert seen["timeout"] == 7.5 and "SPANLLM_PG_TIMEOUT_S" not in os.environ


def test_bad_pg_timeout_env(monkeypatch, capsys):
    from spanllm.launch import launch

    monkeypatch.setenv("SPANLLM_PG_TIMEOUT_S", "abc")
    monkeypatch.setattr(spanllm.commands.generate, "launch", launch)
    assert main(GEN) == 2
    assert "SPANLLM_PG_TIMEOUT_S='abc': the collective timeout must be a number of seconds in (0, 604800]" in (
        one_error_line(capsys)
    )


def test_one_line_from_the_console_entry_point():
    out = subprocess.run(
        [sys.executable, "-m", "spanllm.cli", "generate", "--model", "tiny", "--prompt-ids", "5,512"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr == (
        "spanllm: error: --prompt-ids #0 ('5,512'): prompt token 1 is 512, outside the "
        "vocabulary [0, 512); use ids from 0 to 511\n"
    )


# --- checkpoints: every file checked in the launching process, the file named ------------------------------
CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 64,
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}


@pytest.fixture
def checkpoint(tmp_path):
    """A tiny checkpoint folder (config.json + model.safetensors of zeros), valid as written."""
    safetensors = pytest.importorskip("safetensors.torch")
    from spanllm.model.config import ModelConfig
    from spanllm.model.loader import expected_tensors

    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(CONFIG))
    cfg = ModelConfig.from_hf_config(str(d))
    safetensors.save_file({n: torch.zeros(s) for n, s in expected_tensors(cfg).items()}, str(d / "model.safetensors"))
    return d


def _gen(d) -> list[str]:
    return ["generate", "--model", str(d), "--prompt-ids", "1,2"]


def test_valid_checkpoint_passes_the_checks(checkpoint, monkeypatch):
    started = []
    result = {
        "describe": "ckpt",
        "allreduce_ran": "none",
        "prompts": [[1, 2]],
        "tokens": [[3]],
        "texts": None,
        "ttft_ms": 1.0,
        "e2e_ms": 2.0,
    }
    monkeypatch.setattr(
        spanllm.commands.generate, "launch", lambda fn, args, prompts, **k: started.append(prompts) or [result]
    )
    assert main(_gen(checkpoint)) == 0
    assert started == [[[1, 2]]]


def _break_json(d):
    (d / "config.json").write_text('{"vocab_size": 64,')


def _drop_key(d):
    (d / "config.json").write_text(json.dumps({k: v for k, v in CONFIG.items() if k != "num_attention_heads"}))


def _bad_value(d):
    (d / "config.json").write_text(json.dumps({**CONFIG, "hidden_size": "wide"}))


def _truncate(d):
    p = d / "model.safetensors"
    p.write_bytes(p.read_bytes()[:-100])


def _garble(d):
    (d / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")


def _shape(d):
    (d / "config.json").write_text(json.dumps({**CONFIG, "intermediate_size": 48}))


def _layers(d):
    (d / "config.json").write_text(json.dumps({**CONFIG, "num_hidden_layers": 3}))


def _no_weights(d):
    (d / "model.safetensors").unlink()


def _index_names_missing_file(d):
    weights = d / "model.safetensors"
    weights.rename(d / "model-00001-of-00002.safetensors")
    from safetensors import safe_open

    with safe_open(str(d / "model-00001-of-00002.safetensors"), framework="pt") as f:
        names = list(f.keys())
    wm = {n: "model-00001-of-00002.safetensors" for n in names}
    wm[names[0]] = "model-00002-of-00002.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))


def _bad_index(d):
    (d / "model.safetensors").unlink()
    (d / "model.safetensors.index.json").write_text("[]")


CHECKPOINT_CASES = [
    (_break_json, "config.json: not valid JSON (Expecting"),
    (_drop_key, "config.json: no 'num_attention_heads' key"),
    (_bad_value, "config.json: a value has the wrong type"),
    (_truncate, "model.safetensors: truncated: the file has"),
    (_garble, "model.safetensors: the safetensors header is damaged"),
    (
        _shape,
        "model.safetensors: tensor 'model.layers.0.mlp.gate_proj.weight' has shape (32, 16) but config.json "
        "implies (48, 16)",
    ),
    (_layers, "tensor 'model.layers.2.input_layernorm.weight' is missing from the checkpoint"),
    (_no_weights, "has neither model.safetensors nor model.safetensors.index.json"),
    (
        _index_names_missing_file,
        "model.safetensors.index.json: lists model-00002-of-00002.safetensors, which is missing",
    ),
    (_bad_index, "model.safetensors.index.json: not a safetensors index"),
]


@pytest.mark.parametrize("damage,needle", CHECKPOINT_CASES, ids=[f.__name__ for f, _ in CHECKPOINT_CASES])
def test_bad_checkpoint_names_the_file(no_ranks, capsys, checkpoint, damage, needle):
    damage(checkpoint)
    assert main(_gen(checkpoint)) == 2
    line = one_error_line(capsys)
    assert needle in line and str(checkpoint) in line


def test_config_file_instead_of_folder(no_ranks, capsys, checkpoint):
    assert main(_gen(checkpoint / "config.json")) == 2
    assert "config.json' is a file; --model takes the checkpoint folder" in one_error_line(capsys)


def test_checkpoint_token_ids_use_its_vocabulary(no_ranks, capsys, checkpoint):
    assert main(["generate", "--model", str(checkpoint), "--prompt-ids", "1,64"]) == 2
    assert "prompt token 1 is 64, outside the vocabulary [0, 64); use ids from 0 to 63" in one_error_line(capsys)


# --- good input still reaches the launch ---------------------------------------------------------------------
class _Launched(Exception):
    pass


@pytest.mark.parametrize(
    "argv",
    [
        ["demo"],
        ["demo", "--nprocs", "2", "--no-engine"],
        ["bench", "allreduce"],
        AR + ["--algos", "gloo, ref_ring"],
        ["tune", "--out", "t.json"],
        GEN,
        GEN + ["--nprocs", "2", "--pp", "2", "--max-new-tokens", "4093"],
        BATCH + ["--nprocs", "2", "--allreduce", "gloo,ref_ring", "--warmup", "0"],
        STUDY,
        STUDY + ["--pp", "2"],
        ["bench", "batch", "--model", "llama3.1-405b:layers=2", "--workload", "prefill-heavy", "--nprocs", "2"],
        GEN + ["--max-model-len", "19"],
    ],
)
def test_good_input_reaches_the_launch(monkeypatch, argv):
    def launched(*args, **kwargs):
        raise _Launched

    for mod in COMMAND_MODULES:
        monkeypatch.setattr(mod, "launch", launched)
    with pytest.raises(_Launched):
        main(argv)


def test_files_that_cannot_be_read_or_written_are_refused_first(no_ranks, capsys, tmp_path):
    """A cluster file holding a JSON list (not an object), and an output path that opening refuses even to root
    (os.access says yes to root everywhere): one line each, before any work (found by a hostile test)."""
    listed = tmp_path / "cluster.json"
    listed.write_text("[1, 2]")
    assert main(["plan", "--model", "llama3.1-70b", "--cluster", str(listed)]) == 2
    assert "holds a list; it must be one object of ClusterSpec's fields" in one_error_line(capsys)
    assert main(["bench", "host", "--requests", "8", "--json", "/proc/spanllm-never/out.json"]) == 2
    assert "--json /proc/spanllm-never/out.json: cannot" in one_error_line(capsys)
    out = tmp_path / "fresh.json"
    assert main(["bench", "host", "--requests", "4", "--prompt-len", "8", "--output-len", "2", "--repeats", "1",
                 "--json", str(out)]) == 0  # fmt: skip
    assert out.exists()
