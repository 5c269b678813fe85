"""SamplingParams.include_stop_str_in_output (vLLM's): the stop string that ended the output, or the text of the
stop id that did, stays at the end of the text (streamed too); EOS's text never does. The server takes the field on
both endpoints. The tiny preset's byte tokenizer: id 100 is "a", id 7 the byte 0x04."""

from __future__ import annotations

import pytest
import torch

from spanllm.engine.config import EngineConfig
from spanllm.engine.llm import LLM
from spanllm.engine.sampler import SamplingParams, SamplingParamsError
from spanllm.serve.api import sampling_params
from spanllm.serve.protocol import validate

LIMITS = {"max_stop_strings": 8, "max_stop_length": 64, "max_stop_token_ids": 64}


@pytest.fixture(scope="module")
def llm():
    cfg = EngineConfig(dtype=torch.float32, block_size=4, max_num_seqs=4, max_num_batched_tokens=16, num_kv_blocks=64)
    with LLM("tiny", cfg) as llm:
        llm.get_tokenizer()
        yield llm


def _run(llm, **kw):
    deltas = []
    params = SamplingParams(max_tokens=6, logit_bias={100: 100.0}, **kw)
    out = llm.generate(["hello"], params, on_output=lambda o: deltas.append(o.new_text))[0]
    return out, "".join(deltas)


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_string_stays_in_the_text_when_asked(llm, include):
    out, streamed = _run(llm, stop=["aaa"], include_stop_str_in_output=include)
    assert (out.output_ids, out.finish_reason, out.stop_reason) == ([100, 100, 100], "stop", "aaa")
    assert out.text == streamed == ("aaa" if include else "")
    out, streamed = _run(llm, stop=["zz", "aa"], min_tokens=3, include_stop_str_in_output=include)
    # min_tokens: the stop is looked for from the third token on, as one ending in that token's text: "a|aa"
    assert out.output_ids == [100, 100, 100] and out.text == streamed == ("aaa" if include else "a")


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_ids_text_stays_when_asked_eos_never(llm, include):
    out, streamed = _run(llm, stop_token_ids=[100], include_stop_str_in_output=include)
    assert (out.output_ids, out.finish_reason, out.stop_reason) == ([100], "stop", 100)
    assert out.text == streamed == ("a" if include else "")
    eos = llm.generate(
        ["hello"], SamplingParams(max_tokens=6, logit_bias={2: 100.0}, include_stop_str_in_output=include)
    )[0]
    assert (eos.output_ids, eos.finish_reason, eos.text) == ([2], "stop", "")  # id 2: the tiny preset's EOS


def test_the_flag_is_a_bool():
    with pytest.raises(SamplingParamsError, match="include_stop_str_in_output=1 must be True or False"):
        SamplingParams(include_stop_str_in_output=1)


@pytest.mark.parametrize("chat", [False, True])
def test_the_server_takes_the_field(chat):
    body = {"messages": [{"role": "user", "content": "x"}]} if chat else {"prompt": "x"}
    req = validate({**body, "stop": "y", "include_stop_str_in_output": True}, chat, **LIMITS)
    assert sampling_params(req, chat).include_stop_str_in_output is True
    assert sampling_params(validate(body, chat, **LIMITS), chat).include_stop_str_in_output is False
