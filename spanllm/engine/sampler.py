"""SamplingParams (one request's) and two samplers.

`Sampler` (the static-batch path): one set of parameters for the whole batch, greedy or temperature +
top-p, identical on every rank that samples. Every TP rank of the last stage holds bitwise-identical
logits (they were all-gathered), and each seeds its generator the same way, so each draws the same
token without a broadcast. Sampling uses the exponential-race trick (argmax of p / E, E ~ Exp(1)),
which needs no host sync.

`BatchSampler` (the serving engine): every row has its own parameters (temperature, top-k, top-p,
min_tokens, seed). Only rank 0 samples there; its tokens travel to the other ranks in the next step's
plan. Rows with a seed draw from their own generator, so a seeded request draws the same numbers
whatever else shares its batch (and samples the same tokens, up to float32 rounding at a near-tie: on CUDA a
batch in which no row asks for top-k / top-p takes the one-pass race of spanllm.kernels.sampler, which
ranks tokens in log space; other batches take the unfused ops).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

try:  # the one-pass race on the GPU (Triton); the CPU wheel has none and takes the unfused ops
    from spanllm.kernels.sampler import race_argmax
except ImportError:
    race_argmax = None


class SamplingParamsError(ValueError):
    """A sampling parameter outside its range (the server answers 400 with this message)."""


INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # seeds (torch.Generator.manual_seed takes an int64)
INT32_MAX = 2**31 - 1  # top_k, max_tokens and token ids live in int32 / int64 arrays

# Below this temperature a request samples greedily (vLLM's _SAMPLING_EPS): logits / 1e-39 overflow float32.
GREEDY_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's log-probability and the top alternatives (id, logprob), best first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]


@dataclass(frozen=True)
class SamplingParams:
    """vLLM's names and meanings. stop: strings that end the output (not included in it); stop_token_ids:
    ids that end it besides EOS (the id itself is kept, as EOS is); min_tokens: EOS and stop ids are
    masked until this many tokens exist; ignore_eos: EOS does not end the output (stop ids still do)."""

    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    max_tokens: int = 16
    ignore_eos: bool = False
    top_k: int = 0  # 0 (or -1): off
    seed: int | None = None
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    presence_penalty: float = 0.0  # [-2, 2]
    frequency_penalty: float = 0.0  # [-2, 2]
    repetition_penalty: float = 1.0  # (0, 2]
    min_p: float = 0.0  # [0, 1]
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in [-100, 100])
    logprobs: int | None = None  # None: none; k in [0, 20]: the sampled token's logprob and the top k

    def __post_init__(self) -> None:
        if not isinstance(self.temperature, (int, float)) or not 0 <= self.temperature <= 100:
            raise SamplingParamsError(f"temperature={self.temperature} must be in [0, 100] (0 = greedy)")
        if not 0.0 < self.top_p <= 1.0:
            raise SamplingParamsError(f"top_p={self.top_p} must be in (0, 1]")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise SamplingParamsError(f"max_tokens={self.max_tokens} must be an integer >= 1")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise SamplingParamsError(f"top_k={self.top_k} must be -1 or 0 (off) or a positive integer")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise SamplingParamsError(
                f"min_tokens={self.min_tokens} must be between 0 and max_tokens={self.max_tokens}"
            )
        if self.seed is not None and (not isinstance(self.seed, int) or not INT64_MIN <= self.seed <= INT64_MAX):
            raise SamplingParamsError(f"seed={self.seed!r} must be an integer in [{INT64_MIN}, {INT64_MAX}]")
        if self.top_k > INT32_MAX or self.max_tokens > INT32_MAX:
            raise SamplingParamsError(f"top_k={self.top_k} and max_tokens={self.max_tokens} must be <= {INT32_MAX}")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if any(not isinstance(t, str) or not t for t in self.stop):
            raise SamplingParamsError(f"stop={self.stop!r} must hold non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise SamplingParamsError(f"stop_token_ids={self.stop_token_ids!r} must hold non-negative integers")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise SamplingParamsError(f"{name}={getattr(self, name)} must be in [-2, 2]")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise SamplingParamsError(f"repetition_penalty={self.repetition_penalty} must be in (0, 2]")
        if not 0.0 <= self.min_p <= 1.0:
            raise SamplingParamsError(f"min_p={self.min_p} must be in [0, 1]")
        object.__setattr__(self, "logit_bias", tuple((int(t), float(b)) for t, b in self.logit_bias))
        if any(t < 0 or not -100.0 <= b <= 100.0 for t, b in self.logit_bias):
            raise SamplingParamsError(f"logit_bias={self.logit_bias!r}: token ids >= 0, biases in [-100, 100]")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= 20):
            raise SamplingParamsError(f"logprobs={self.logprobs!r} must be None or an integer in [0, 20]")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def top_k_active(self) -> bool:
        return self.top_k > 0


class Sampler:
    def __init__(self, device: torch.device, seed: int) -> None:
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        """logits [B, vocab] float32 -> token ids [B] int64."""
        if params.temperature == 0.0:
            return logits.argmax(dim=-1)
        probs = torch.softmax(logits / params.temperature, dim=-1)
        if params.top_p < 1.0:
            sorted_p, order = probs.sort(dim=-1, descending=True)
            # Drop a token when the tokens ranked above it already hold top_p of the mass.
            drop = (sorted_p.cumsum(dim=-1) - sorted_p) > params.top_p
            sorted_p = sorted_p.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
        race = torch.empty_like(probs).exponential_(1.0, generator=self.generator)
        return (probs / race).argmax(dim=-1)


class BatchSampler:
    """Per-row sampling for the serving engine: logits [B, vocab] float32 and one SamplingParams per row.

    Greedy rows take the argmax. The others: logits / temperature, then top-k and top-p masks (only
    when some row asks: the sort is the costly part), then the exponential race, with the engine's
    generator for unseeded rows and each seeded row's own generator (created at its first token). On CUDA,
    when no row asks for top-k or top-p, the race runs as one Triton kernel over the logits and the draws
    (spanllm.kernels.sampler: the same draws and, up to float32 rounding at near-ties, the same token,
    in 3 passes over the logits' size instead of 10)."""

    def __init__(self, device: torch.device, seed: int, to_device=None) -> None:
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        # host list/array -> tensor on the device; the engine passes its runner's pinned staging (HostStaging.tensor),
        # so that sampling never makes the host wait for the GPU
        self.to_device = to_device or (lambda a: torch.as_tensor(a, device=device))

    def __call__(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        stop_masks: list[tuple[int, ...]],
        generators: list[torch.Generator | None],
    ) -> list[int]:
        """stop_masks[i]: ids to forbid in row i (EOS / stop ids before min_tokens). Returns B token ids."""
        return self.sample(logits, params, stop_masks, generators).tolist()

    def sample(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        stop_masks: list[tuple[int, ...]],
        generators: list[torch.Generator | None],
    ) -> torch.Tensor:
        """As __call__, but the ids stay on the device ([B] int64): nothing here waits for the GPU."""
        masked = [(i, t) for i, ids in enumerate(stop_masks) for t in ids]
        if masked:
            rc = np.asarray(masked, dtype=np.int64)
            logits[self.to_device(rc[:, 0]), self.to_device(rc[:, 1])] = float("-inf")
        if all(p.greedy for p in params):
            return logits.argmax(dim=-1)
        h2d = self.to_device
        temps_host = np.asarray([p.temperature if not p.greedy else 1.0 for p in params], dtype=np.float32)
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
