"""What LLM.generate takes as prompts and sampling parameters, normalized: a string or token ids per prompt (vLLM's
prompt forms included), one SamplingParams per prompt. Anything else is refused by name before a request is admitted."""

from __future__ import annotations

from spanllm.engine.sampler import SamplingParams, as_int, is_int
from spanllm.errors import UsageError

_PROMPT_KEYS = ("prompt", "prompt_token_ids")  # vLLM's TextPrompt / TokensPrompt


def _is_token_id(x) -> bool:
    """An integer of any kind but bool: a Python or numpy int, a 0-d integer tensor."""
    return is_int(as_int(x))


def prompt_list(prompts) -> list:
    """generate's prompts as a list. One string, one {"prompt": ...} dict or one list of integers is one prompt
    (vLLM's rule); any other iterable is a list of prompts."""
    from spanllm.engine.engine_core import RequestError

    if isinstance(prompts, (str, dict)):
        return [prompts]
    try:
        if prompts is None or isinstance(prompts, (bytes, bytearray, set, frozenset)):
            raise TypeError
        items = list(prompts)
    except TypeError:  # not iterable (a number, a 0-d array), or without an order
        raise RequestError(
            f"prompts={prompts!r} ({type(prompts).__name__}) is not a prompt: give a string, a list of token ids, "
            "or a list of them"
        ) from None
    if items and all(_is_token_id(x) for x in items):
        return [items]
    return items


def prompt_of(i: int, p):
    """Prompt i as a string or a list of token ids (Python ints; other values kept, for validate to name)."""
    from spanllm.engine.engine_core import RequestError, token_ids

    if isinstance(p, dict):
        keys = [k for k in _PROMPT_KEYS if k in p]
        if len(keys) != 1 or len(p) != 1:
            raise RequestError(
                f"prompt {i} is a dict with keys {sorted(map(str, p))}: give {{'prompt': text}} or "
                "{'prompt_token_ids': ids}, one of them alone (no other key is supported)"
            )
        p = p[keys[0]]
        if keys[0] == "prompt" and not isinstance(p, str):
            raise RequestError(
                f"prompt {i}: 'prompt' is {p!r} ({type(p).__name__}); give it text, or use prompt_token_ids"
            )
        if keys[0] == "prompt_token_ids" and isinstance(p, str):  # not to be encoded as if it were 'prompt'
            raise RequestError(f"prompt {i}: 'prompt_token_ids' is {p!r} (str); give it token ids, or use 'prompt'")
    if isinstance(p, str):
        return p
    if p is None:
        raise RequestError(f"a prompt is None (prompt {i}): give a string or a list of token ids")
    try:
        if isinstance(p, (bytes, bytearray, set, frozenset)) or _is_token_id(p):
            raise TypeError
        return token_ids(p)  # numpy / torch integer ids as Python ints
    except TypeError:  # not iterable (a number, a 0-d array or tensor)
        raise RequestError(
            f"prompt {i} is {p!r} ({type(p).__name__}), not a prompt: give a string or a list of token ids "
            "(one prompt of ids alone may be given as the list itself)"
        ) from None


def params_list(params, n: int) -> list[SamplingParams]:
    """One SamplingParams per prompt: `params` is None (the defaults), one for every prompt, or a list (or tuple)
    of exactly n."""
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    if not isinstance(params, (list, tuple)):
        raise UsageError(
            f"params={params!r} ({type(params).__name__}) is not a SamplingParams: pass one SamplingParams for every "
            "prompt, or a list of one per prompt"
        )
    for j, sp in enumerate(params):
        if not isinstance(sp, SamplingParams):
            raise UsageError(f"params[{j}] is {sp!r} ({type(sp).__name__}), not a SamplingParams")
    if len(params) != n:
        raise UsageError(f"{len(params)} SamplingParams for {n} prompts; pass one, or one per prompt")
    return list(params)
