"""SamplingParams (one request's), TokenLogprob, and BatchSampler: the serving engine's sampler.

Every row of a batch has its own parameters. Only TP rank 0 samples; its tokens reach the other ranks as input
ids in the next step's plan, and nothing else the sampler keeps (token counts, logprobs) is needed there.

One step, in vLLM v1's order (vllm/v1/sample/sampler.py):
1. logprobs, for the rows that ask: the log-softmax of the logits as the model gave them, before every step
   below (no mask, bias, penalty or temperature): vLLM's default (logprobs_mode "raw_logprobs"). So a greedy
   request's logprobs are exactly log_softmax(logits).
2. min_tokens: EOS and stop ids to -inf until the request has min_tokens tokens (the engine passes them).
3. logit_bias: added to the logits.
4. penalties, from the request's tokens (`TokenCounts`, on the device): repetition (OpenAI has none; vLLM's
   multiplicative rule: a token of the prompt or of the output so far has its logit divided by r if positive,
   multiplied by r if not), then frequency and presence (OpenAI's additive rule, on the output only: minus
   f x the token's count, minus p if it occurred).
5. greedy rows (temperature < 1e-5, as vLLM): the argmax.
6. the others: logits / temperature, min_p (drop the tokens whose probability is below min_p x the row's
   highest), top-k, top-p, then the exponential race: argmax of p / E, E ~ Exp(1) (no host sync). Rows with
   a seed draw E from their own generator, so a seeded request draws the same numbers whatever else shares
   its batch (and samples the same tokens, up to float32 rounding at a near-tie: on CUDA a batch in which no
   row asks for top-k / top-p takes the one-pass race of spanllm.kernels.sampler, which ranks tokens in log
   space; other batches take the unfused ops).
logprobs, logit_bias, the penalties and min_p each run on the rows that ask for them only (a gather, the op, a
scatter back; no host loop over the vocabulary): a batch that asks for none of them runs the plain path, and
pays nothing for them but one check per row on the host.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple

import numpy as np
import torch

from spanllm.checks import MAX_TEMPERATURE

try:  # the one-pass race on the GPU (Triton); the CPU wheel has none and takes the unfused ops
    from spanllm.kernels.sampler import race_argmax
except ImportError:
    race_argmax = None

GREEDY_BELOW = 1e-5  # vLLM's _SAMPLING_EPS: a lower temperature samples greedily (1 / T would overflow float32)
PENALIZED_LOGIT_MAX = 1e30  # apply_penalties' cap: / GREEDY_BELOW is 1e35, finite in float32 (3.4e38)
MAX_LOGPROBS = 20  # OpenAI's top_logprobs limit (vLLM's default max_logprobs)
LOGIT_BIAS_LIMIT = 100.0  # OpenAI: each bias in [-100, 100]


class SamplingParamsError(ValueError):
    """A sampling parameter outside its range (the server answers 400 with this message)."""


INT32_MAX = 2**31 - 1  # top_k, max_tokens and token ids live in int32 / int64 arrays
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # a seed must fit the generator's int64
MAX_N = 16  # samples per prompt (SamplingParams.n): each is an engine request of its own


def seed_for_sample(seed: int, i: int) -> int:
    """Sample i's seed of a request with `seed` and n > 1: seed itself for sample 0, then seed + i wrapped into int64
    (the server's choices and LLM.generate's samples alike)."""
    return (seed - INT64_MIN + i) % 2**64 + INT64_MIN if i else seed


@dataclass(frozen=True)
class SamplingParams:
    """vLLM's names and meanings. stop: strings that end the output (not included in it); stop_token_ids:
    ids that end it besides EOS (the id itself is kept, as EOS is; its text is not: include_stop_str_in_output keeps
    the stop string, or the stop id's text, at the end of the text, as vLLM's does); min_tokens: EOS and stop ids are
    masked until this many tokens exist; ignore_eos: EOS does not end the output (stop ids still do).
    presence_penalty / frequency_penalty / repetition_penalty / min_p / logit_bias / logprobs: see the module
    docstring. logit_bias: (token id, bias) pairs (a {id: bias} mapping is taken too); the ids are checked
    against the vocabulary at admission (engine_core.validate_request). logprobs: None for none, k for the
    sampled token's logprob and the k most likely tokens' (TokenLogprob). n: samples of the prompt (LLM.generate
    serves them as n engine requests, sample i seeded by seed_for_sample; an engine request itself is one sample)."""

    temperature: float = 0.0  # below 1e-5: greedy
    top_p: float = 1.0
    max_tokens: int = 16
    ignore_eos: bool = False
    top_k: int = 0  # 0 (or -1): off
    seed: int | None = None
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # 1: off
    min_p: float = 0.0  # 0: off
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None
    n: int = 1
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        # Integers and reals of any kind (numpy's, a 0-d tensor's) are taken as Python ints and floats; bools and
        # anything else are refused by name. None for stop / stop_token_ids / logit_bias means none (vLLM's default).
        for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p"):
            object.__setattr__(self, name, _as_float(getattr(self, name)))
        for name in ("max_tokens", "top_k", "min_tokens", "seed", "logprobs", "n"):
            object.__setattr__(self, name, as_int(getattr(self, name)))
        for name in ("ignore_eos", "include_stop_str_in_output"):
            if isinstance(getattr(self, name), np.bool_):
                object.__setattr__(self, name, bool(getattr(self, name)))
            if not isinstance(getattr(self, name), bool):
                raise SamplingParamsError(f"{name}={getattr(self, name)!r} must be True or False")
        if not _is_real(self.temperature) or not 0 <= self.temperature <= MAX_TEMPERATURE:
            raise SamplingParamsError(
                f"temperature={self.temperature!r} must be in [0, {MAX_TEMPERATURE:g}] (0 = greedy)"
            )
        _check_range("top_p", self.top_p, 0.0, 1.0, "1 = no nucleus cut", open_low=True)
        if not is_int(self.max_tokens) or self.max_tokens < 1:
            raise SamplingParamsError(f"max_tokens={self.max_tokens!r} must be an integer >= 1")
        if not is_int(self.top_k) or self.top_k < -1:
            raise SamplingParamsError(f"top_k={self.top_k!r} must be -1 or 0 (off) or a positive integer")
        if not is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise SamplingParamsError(
                f"min_tokens={self.min_tokens!r} must be an integer between 0 and max_tokens={self.max_tokens}"
            )
        if self.seed is not None and (not is_int(self.seed) or not INT64_MIN <= self.seed <= INT64_MAX):
            raise SamplingParamsError(f"seed={self.seed!r} must be an integer in [-2**63, 2**63 - 1] (int64)")
        if self.top_k > INT32_MAX or self.max_tokens > INT32_MAX:
            raise SamplingParamsError(f"top_k={self.top_k} and max_tokens={self.max_tokens} must be <= {INT32_MAX}")
        object.__setattr__(self, "stop", _as_tuple("stop", self.stop, "a string or a list of strings", one_string=True))
        ids = _as_tuple("stop_token_ids", self.stop_token_ids, "a list of token ids, e.g. [2]")
        object.__setattr__(self, "stop_token_ids", tuple(as_int(t) for t in ids))
        if any(not isinstance(t, str) or not t for t in self.stop):
            raise SamplingParamsError(f"stop={self.stop!r} must hold non-empty strings")
        if any(not is_int(t) or t < 0 for t in self.stop_token_ids):
            raise SamplingParamsError(f"stop_token_ids={self.stop_token_ids!r} must hold non-negative integers")
        # once each (in order): every step checks a row's ids, and masks them before min_tokens
        object.__setattr__(self, "stop_token_ids", tuple(dict.fromkeys(self.stop_token_ids)))
        _check_range("presence_penalty", self.presence_penalty, -2.0, 2.0, "0 = off")
        _check_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0, "0 = off")
        _check_range("repetition_penalty", self.repetition_penalty, 0.0, 2.0, "1 = off", open_low=True)
        _check_range("min_p", self.min_p, 0.0, 1.0, "0 = off")
        if self.logprobs is not None and (not is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise SamplingParamsError(
                f"logprobs={self.logprobs!r} must be None (none) or an integer in [0, {MAX_LOGPROBS}] (the sampled "
                "token's logprob plus that many of the most likely tokens')"
            )
        object.__setattr__(self, "logit_bias", _normalize_logit_bias(self.logit_bias))
        if not is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise SamplingParamsError(f"n={self.n!r} must be an integer in [1, {MAX_N}] (samples of the prompt)")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def top_k_active(self) -> bool:
        return self.top_k > 0

    @property
    def penalized(self) -> bool:
        """Asks for a penalty (and so needs its token counts)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @cached_property
    def plain(self) -> bool:
        """Asks for none of logprobs, logit_bias, penalties and min_p (a batch of such rows skips those steps)."""
        return self.logprobs is None and not self.logit_bias and not self.penalized and self.min_p == 0.0

    @cached_property
    def logit_bias_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """logit_bias as (ids int64, biases float32), built once per request (the sampler concatenates the
        rows' arrays every step)."""
        ids = np.fromiter((t for t, _ in self.logit_bias), dtype=np.int64, count=len(self.logit_bias))
        bias = np.fromiter((b for _, b in self.logit_bias), dtype=np.float32, count=len(self.logit_bias))
        return ids, bias


def is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_real(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def as_int(v):
    """An integer of any kind (numpy's, a 0-d integer tensor) as a Python int; anything else (bools included) as it
    is, for the checks to name."""
    if isinstance(v, np.integer) or (isinstance(v, torch.Tensor) and v.dim() == 0 and _integer_dtype(v.dtype)):
        return int(v)
    return v


def _as_float(v):
    """A real number of any kind (numpy's, a 0-d tensor) as a Python float or int; anything else as it is."""
    if isinstance(v, (np.integer, np.floating)) or (
        isinstance(v, torch.Tensor) and v.dim() == 0 and (v.dtype.is_floating_point or _integer_dtype(v.dtype))
    ):
        return v.item()
    return v


def _integer_dtype(dtype: torch.dtype) -> bool:
    return not dtype.is_floating_point and not dtype.is_complex and dtype != torch.bool


def _as_tuple(name: str, v, what: str, one_string: bool = False) -> tuple:
    """A list-valued parameter as a tuple: None is none (vLLM's default), one string one stop string where
    `one_string`; anything that is not a list of values is refused, naming `what` it must be."""
    if v is None:
        return ()
    if isinstance(v, str) and one_string:
        return (v,)
    if isinstance(v, (str, bytes, bytearray, Mapping)) or not isinstance(v, Iterable):
        raise SamplingParamsError(f"{name}={v!r} ({type(v).__name__}) must be {what}")
    return tuple(v)


def _check_range(name: str, v, lo: float, hi: float, off: str, open_low: bool = False) -> None:
    ok = _is_real(v) and (lo < v if open_low else lo <= v) and v <= hi
    if not ok:
        raise SamplingParamsError(f"{name}={v!r} must be a number in {'(' if open_low else '['}{lo:g}, {hi:g}] ({off})")


def _normalize_logit_bias(bias) -> tuple[tuple[int, float], ...]:
    if bias is None:
        return ()
    pairs = bias.items() if isinstance(bias, Mapping) else bias
    try:
        pairs = [(as_int(t), _as_float(b)) for t, b in pairs]
    except (TypeError, ValueError):
        raise SamplingParamsError(
            f"logit_bias={bias!r} must be (token id, bias) pairs or a {{id: bias}} mapping"
        ) from None
    for t, b in pairs:
        if not is_int(t) or t < 0:
            raise SamplingParamsError(f"logit_bias token id {t!r} must be a non-negative integer")
        if not isinstance(b, (int, float)) or isinstance(b, bool) or not -LOGIT_BIAS_LIMIT <= b <= LOGIT_BIAS_LIMIT:
            raise SamplingParamsError(
                f"logit_bias[{t}]={b!r} must be a number in [-{LOGIT_BIAS_LIMIT:g}, {LOGIT_BIAS_LIMIT:g}]"
            )
    ids = [t for t, _ in pairs]
    if len(set(ids)) != len(ids):
        dup = next(t for t in ids if ids.count(t) > 1)
        raise SamplingParamsError(f"logit_bias names token {dup} twice; give each token one bias")
    return tuple((int(t), float(b)) for t, b in pairs)


@dataclass(frozen=True)
class TokenLogprob:
    """One sampled token's logprob and the top most likely tokens' (id, logprob), most likely first; raw
    logprobs (see the module docstring)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]


@dataclass
class Logprobs:
    """One step's logprobs of the rows that asked: tensors on the device (host copies after to_host)."""

    rows: list[int]  # the batch rows that asked, ascending
    num_top: list[int]  # each such row's k
    sampled: torch.Tensor  # [R] float32: the sampled token's logprob
    top_ids: torch.Tensor  # [R, K] int64, K = max(num_top) (K may be 0)
    top_logprobs: torch.Tensor  # [R, K] float32, descending along a row

    def to_host(self) -> Logprobs:
        """Host copies, started without waiting (pinned memory on a GPU): read them only once an event
        recorded after this call has fired (the engine records the one its tokens' copy uses)."""
        if not self.sampled.is_cuda:
            return self

        def pinned(t: torch.Tensor) -> torch.Tensor:
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            host.copy_(t, non_blocking=True)
            return host

        return Logprobs(self.rows, self.num_top, pinned(self.sampled), pinned(self.top_ids), pinned(self.top_logprobs))

    def token_logprobs(self, tokens: list[int]) -> list[TokenLogprob | None]:
        """Per batch row (tokens: the step's sampled ids): its TokenLogprob, or None where it did not ask."""
        out: list[TokenLogprob | None] = [None] * len(tokens)
        sampled, ids, lps = self.sampled.tolist(), self.top_ids.tolist(), self.top_logprobs.tolist()
        for j, (row, k) in enumerate(zip(self.rows, self.num_top)):
            out[row] = TokenLogprob(tokens[row], sampled[j], tuple(zip(ids[j][:k], lps[j][:k])))
        return out


class SamplerOutput(NamedTuple):
    tokens: torch.Tensor  # [B] int64 on the device
    logprobs: Logprobs | None  # None when no row asked


def apply_penalties(
    logits: torch.Tensor,
    output_counts: torch.Tensor,
    prompt_mask: torch.Tensor,
    presence: torch.Tensor,
    frequency: torch.Tensor,
    repetition: torch.Tensor,
) -> torch.Tensor:
    """vLLM's penalties (vllm/model_executor/layers/utils.py apply_penalties): logits [R, V] float32,
    output_counts [R, V] (each token's count in the output so far), prompt_mask [R, V] bool (in the prompt),
    presence / frequency / repetition [R] float32. A neutral value (0, 0, 1) leaves a row's logits bit-exact."""
    seen_out = output_counts > 0
    r = repetition[:, None]
    # A tiny penalty (any r in (0, 2] is allowed) divides a positive logit past float32's range: inf would make the
    # softmax NaN. Capped at PENALIZED_LOGIT_MAX instead, the seen tokens with positive logits still dominate, and
    # the cap over the smallest temperature (GREEDY_BELOW) stays finite.
    repeated = torch.where(logits > 0, (logits / r).clamp(max=PENALIZED_LOGIT_MAX), logits * r)
    logits = torch.where(seen_out | prompt_mask, repeated, logits)
    logits = logits - frequency[:, None] * output_counts
    return logits - presence[:, None] * seen_out


class TokenCounts:
    """The token counts of the requests that ask for a penalty, on the device: one row ("slot") per request,
    made at its first sampled token and kept until `release`. `output` [slots, V] int32: each token's count in
    its output, updated on the device from each step's sampled tokens (so under async scheduling it includes
    a token the host has not read yet); `prompt` [slots, V] bool: its prompt's tokens (repetition). The pool
    grows by doubling; a released slot is reused (zeroed in stream order, after the last update to it)."""

    def __init__(self, to_device) -> None:
        self.to_device = to_device
        self.output: torch.Tensor | None = None
        self.prompt: torch.Tensor | None = None
        self._slot: dict[str, int] = {}
        self._free: list[int] = []

    @property
    def num_active(self) -> int:
        return len(self._slot)

    def slots(self, requests: list, vocab: int, device: torch.device) -> list[int]:
        """Each request's slot (requests: anything with request_id, prompt_ids and output_ids; a Sequence)."""
        out = []
        for r in requests:
            s = self._slot.get(r.request_id)
            if s is None:
                s = self._new_slot(vocab, device)
                self._slot[r.request_id] = s
                self.prompt[s, self.to_device(np.asarray(r.prompt_ids, dtype=np.int64))] = True
                if r.output_ids:
                    ids = self.to_device(np.asarray(r.output_ids, dtype=np.int64))
                    self.output[s].index_put_((ids,), torch.ones_like(ids, dtype=torch.int32), accumulate=True)
            out.append(s)
        return out

    def add(self, slots: torch.Tensor, tokens: torch.Tensor) -> None:
        """Count one sampled token per slot (slots, tokens: [R] int64 on the device)."""
        self.output.index_put_((slots, tokens), torch.ones_like(tokens, dtype=torch.int32), accumulate=True)

    def release(self, request_id: str) -> None:
        s = self._slot.pop(request_id, None)
        if s is not None:
            self._free.append(s)

    def _new_slot(self, vocab: int, device: torch.device) -> int:
        if not self._free:
            n = 0 if self.output is None else self.output.shape[0]
            grown = max(4, 2 * n)
            output = torch.zeros(grown, vocab, dtype=torch.int32, device=device)
            prompt = torch.zeros(grown, vocab, dtype=torch.bool, device=device)
            if n:
                output[:n] = self.output
                prompt[:n] = self.prompt
            self.output, self.prompt = output, prompt
            self._free.extend(range(grown - 1, n - 1, -1))  # pop() hands out the lowest first
        s = self._free.pop()
        self.output[s].zero_()
        self.prompt[s].zero_()
        return s


class BatchSampler:
    """Per-row sampling for the serving engine: logits [B, vocab] float32 and one SamplingParams per row (the
    steps: the module docstring). On CUDA, when no row asks for top-k or top-p, the race runs as one Triton
    kernel over the logits and the draws (spanllm.kernels.sampler: the same draws and, up to float32 rounding
    at near-ties, the same token, in 3 passes over the logits' size instead of 10); masks, biases, penalties
    and min_p only change the logits it reads."""

    def __init__(self, device: torch.device, seed: int, to_device=None) -> None:
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        # host list/array -> tensor on the device; the engine passes its runner's pinned staging (HostStaging.tensor),
        # so that sampling never makes the host wait for the GPU
        self.to_device = to_device or (lambda a: torch.as_tensor(np.asarray(a), device=device))
        self.counts = TokenCounts(self.to_device)

    def release(self, request_id: str) -> None:
        """A request ended: free what the sampler kept for it (its token counts)."""
        self.counts.release(request_id)

    def sample(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        stop_masks: list[tuple[int, ...]],
        generators: list[torch.Generator | None],
        requests: list | None = None,
    ) -> SamplerOutput:
        """stop_masks[i]: ids to forbid in row i (EOS / stop ids before min_tokens); generators[i]: row i's own
        (a seeded request's) or None; requests[i]: row i's request (request_id, prompt_ids, output_ids: a
        Sequence), needed for the rows with a penalty, whose token counts persist until `release`. The
        logits are changed in place. Nothing here waits for the GPU."""
        h2d = self.to_device
        featured = not all(p.plain for p in params)
        lp_rows = [i for i, p in enumerate(params) if p.logprobs is not None] if featured else []
        raw = None
        if lp_rows:  # before anything below changes the logits
            raw = torch.log_softmax(self._rows(logits, lp_rows), dim=-1)
        masked = [(i, t) for i, ids in enumerate(stop_masks) for t in ids]
        if masked:
            rc = np.asarray(masked, dtype=np.int64)
            logits[h2d(rc[:, 0]), h2d(rc[:, 1])] = float("-inf")
        counted = None
        if featured:
            self._add_logit_bias(logits, params)
            counted = self._apply_penalties(logits, params, requests)
        tokens = self._sample_tokens(logits, params, generators, featured)
        logprobs = None
        if lp_rows:
            picked = tokens if len(lp_rows) == len(params) else tokens[h2d(np.asarray(lp_rows, dtype=np.int64))]
            num_top = [params[i].logprobs for i in lp_rows]
            top = raw.topk(max(num_top), dim=-1)  # sorted, descending
            logprobs = Logprobs(lp_rows, num_top, raw.gather(1, picked[:, None])[:, 0], top.indices, top.values)
        if counted is not None:  # last: a call that raised before here counted nothing, and can run again
            rows, slots = counted
            self.counts.add(slots, tokens[rows])
        return SamplerOutput(tokens, logprobs)

    def _rows(self, x: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """x[rows] (a copy); x itself when rows are all of them."""
        if len(rows) == x.shape[0]:
            return x
        return x[self.to_device(np.asarray(rows, dtype=np.int64))]

    def _set_rows(self, x: torch.Tensor, rows: list[int], value: torch.Tensor) -> None:
        if len(rows) == x.shape[0]:
            x.copy_(value)
        else:
            x[self.to_device(np.asarray(rows, dtype=np.int64))] = value

    def _add_logit_bias(self, logits: torch.Tensor, params: list[SamplingParams]) -> None:
        """One scatter-add of every row's (id, bias) pairs."""
        biased = [(i, p.logit_bias_arrays) for i, p in enumerate(params) if p.logit_bias]
        if not biased:
            return
        h2d = self.to_device
        rows = np.concatenate([np.full(len(ids), i, dtype=np.int64) for i, (ids, _) in biased])
        ids = np.concatenate([ids for _, (ids, _) in biased])
        bias = np.concatenate([b for _, (_, b) in biased])
        logits.index_put_((h2d(rows), h2d(ids)), h2d(bias), accumulate=True)

    def _apply_penalties(
        self, logits: torch.Tensor, params: list[SamplingParams], requests: list | None
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The penalties on the rows that ask (their token counts from self.counts); returns (rows, slots) as
        device tensors, for counting the tokens these rows sample, or None when no row asks."""
        rows = [i for i, p in enumerate(params) if p.penalized]
        if not rows:
            return None
        if requests is None:
            raise ValueError("rows with a penalty need their requests (the sampler keeps their token counts)")
        h2d = self.to_device
        slots = h2d(np.asarray(self.counts.slots([requests[i] for i in rows], logits.shape[1], logits.device)))
        rows_t = h2d(np.asarray(rows, dtype=np.int64))

        def per_row(name: str) -> torch.Tensor:
            return h2d(np.asarray([getattr(params[i], name) for i in rows], dtype=np.float32))

        penalized = apply_penalties(
            self._rows(logits, rows),
            self.counts.output[slots],
            self.counts.prompt[slots],
            per_row("presence_penalty"),
            per_row("frequency_penalty"),
            per_row("repetition_penalty"),
        )
        self._set_rows(logits, rows, penalized)
        return rows_t, slots

    def _sample_tokens(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        featured: bool,
    ) -> torch.Tensor:
        if all(p.greedy for p in params):
            return logits.argmax(dim=-1)
        h2d = self.to_device
        temps_host = np.asarray([p.temperature if not p.greedy else 1.0 for p in params], dtype=np.float32)
        if featured:
            self._apply_min_p(logits, params, temps_host)
        if race_argmax is not None and logits.is_cuda and not any(p.top_k_active or p.top_p < 1.0 for p in params):
            # the race in one pass (spanllm.kernels.sampler): the same draws, no probabilities formed
            sampled = race_argmax(logits, self._race(logits, generators), h2d(1.0 / temps_host))
            return self._greedy_rows(sampled, logits, params)
        temps = h2d(temps_host)
        probs_logits = logits / temps[:, None]
        if any(p.top_k_active for p in params):
            k = h2d(np.asarray([p.top_k if p.top_k_active else logits.shape[1] for p in params], dtype=np.int64))
            kth = probs_logits.sort(dim=-1, descending=True).values.gather(
                1, (k - 1).clamp(max=logits.shape[1] - 1)[:, None]
            )
            probs_logits = probs_logits.masked_fill(probs_logits < kth, float("-inf"))
        probs = torch.softmax(probs_logits, dim=-1)
        if any(p.top_p < 1.0 for p in params):
            top_p = h2d(np.asarray([p.top_p for p in params], dtype=np.float32))
            sorted_p, order = probs.sort(dim=-1, descending=True)
            drop = (sorted_p.cumsum(dim=-1) - sorted_p) > top_p[:, None]  # mass above already >= top_p
            probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p.masked_fill(drop, 0.0))
        sampled = (probs / self._race(probs, generators)).argmax(dim=-1)
        return self._greedy_rows(sampled, logits, params)

    def _apply_min_p(self, logits: torch.Tensor, params: list[SamplingParams], temps_host: np.ndarray) -> None:
        """vLLM's MinPLogitsProcessor on the sampled rows that ask: with p = softmax(logits / T), a token with
        p < min_p x max(p) gets -inf (which no temperature undoes, so the logits themselves are masked)."""
        rows = [i for i, p in enumerate(params) if p.min_p > 0.0 and not p.greedy]
        if not rows:
            return
        h2d = self.to_device
        x = self._rows(logits, rows)
        probs = torch.softmax(x / h2d(temps_host[rows])[:, None], dim=-1)
        min_p = h2d(np.asarray([params[i].min_p for i in rows], dtype=np.float32))
        drop = probs < probs.amax(dim=-1, keepdim=True) * min_p[:, None]
        self._set_rows(logits, rows, x.masked_fill(drop, float("-inf")))

    def _race(self, like: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
        """Exp(1) draws shaped like the logits: the engine's generator, then each seeded row from its own
        (own stream: the same draws whatever shares the batch)."""
        race = torch.empty_like(like)
        race.exponential_(1.0, generator=self.generator)
        for i, g in enumerate(generators):
            if g is not None:
                race[i].exponential_(1.0, generator=g)
        return race

    def _greedy_rows(self, sampled: torch.Tensor, logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        greedy_rows = [i for i, p in enumerate(params) if p.greedy]
        if greedy_rows:
            rows = self.to_device(np.asarray(greedy_rows, dtype=np.int64))
            sampled[rows] = logits[rows].argmax(dim=-1)
        return sampled
