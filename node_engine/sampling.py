"""Sampling parameters (validated as SGLang 0.5.23 validates them) and the batched sampler.

Every request draws from its own ``torch.Generator``: the same seed gives the
same tokens whatever else is in the batch. Logits reach :func:`sample` after
:mod:`node_engine.logits` applied penalties, ``min_new_tokens`` and
``logit_bias``; the sampler then scales by temperature and filters by top-k,
top-p and min-p, jointly as SGLang's PyTorch sampling backend does (top-p on the
whole distribution's cumulative probability, not renormalised after top-k).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import torch

MAX_STOP_STRINGS = 32
MAX_STOP_TOKEN_IDS = 4096   # each step looks a sampled token up in them: bounded, so one request cannot slow all
MAX_STOP_STRING_CHARS = 256
GREEDY_TEMPERATURE = 1e-6   # below it, sampling is greedy (SGLang's _SAMPLING_EPS)
_SEED_MASK = (1 << 64) - 1
MIN_SEED, MAX_SEED = -(2**63), 2**64 - 1  # a seed outside would alias another once folded to 64 bits
FLOAT32_MAX = float(torch.finfo(torch.float32).max)
FLOAT32_TINY = float(torch.finfo(torch.float32).tiny)  # the smallest normal float32


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_new_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    stream_interval: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be an integer >= 0, got {self.max_new_tokens!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        greedy_override = self.temperature < GREEDY_TEMPERATURE  # SGLang sets top_k 1 before its range check
        if not isinstance(self.top_k, int) or (self.top_k < 1 and self.top_k not in (-1, 0) and not greedy_override):
            raise ValueError(f"top_k must be -1 or 0 (disabled) or >= 1, got {self.top_k!r}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)!r}")
        if not FLOAT32_TINY <= self.repetition_penalty <= 2:  # below it, 0 in the float32 logits: x / 0
            raise ValueError(f"repetition_penalty must be in [{FLOAT32_TINY:g}, 2] (1 = none), got "
                             f"{self.repetition_penalty!r}")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ValueError(f"min_new_tokens must be in [0, max_new_tokens ({self.max_new_tokens})], "
                             f"got {self.min_new_tokens!r}")
        if self.stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1, got {self.stream_interval!r}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}")
        for s in self.stop:
            if not isinstance(s, str) or not s or len(s) > MAX_STOP_STRING_CHARS:
                raise ValueError(f"stop strings must be non-empty strings of at most {MAX_STOP_STRING_CHARS} "
                                 f"characters, got {s!r}")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids takes at most {MAX_STOP_TOKEN_IDS} ids, got {len(self.stop_token_ids)}")
        for token, bias in self.logit_bias:
            if not abs(bias) <= FLOAT32_MAX and bias != float("-inf"):  # past it, inf in the float32 logits
                raise ValueError(f"logit_bias of token {token} must be a number of magnitude at most "
                                 f"{FLOAT32_MAX:g}, or -inf, got {bias!r}")
        if self.seed is not None and not (isinstance(self.seed, int) and MIN_SEED <= self.seed <= MAX_SEED):
            raise ValueError(f"sampling_seed must be an integer in [-2**63, 2**64), got {self.seed!r}")

    @cached_property
    def stop_token_set(self) -> frozenset[int]:
        return frozenset(self.stop_token_ids)

    @cached_property
    def logit_bias_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``logit_bias`` as (token ids, float32 biases) on the CPU, built once for every step of the request."""
        return (torch.tensor([token for token, _ in self.logit_bias], dtype=torch.long),
                torch.tensor([bias for _, bias in self.logit_bias], dtype=torch.float32))

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return (self.frequency_penalty != 0 or self.presence_penalty != 0 or self.repetition_penalty != 1
                or self.min_new_tokens > 0 or bool(self.logit_bias))


def generator_seed(seed: int, sample_index: int = 0) -> int:
    """The generator seed of sample ``sample_index`` of a request seeded ``seed`` (a 64-bit value)."""
    return (seed + sample_index) & _SEED_MASK


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> list[int]:
    """One token per row of ``logits`` [B, V] (float32, penalties already applied)."""
    if all(p.is_greedy for p in params):
        return logits.argmax(dim=-1).tolist()
    tokens: list[int] = []
    for row, p, gen in zip(logits, params, generators, strict=True):
        if p.is_greedy:
            tokens.append(int(row.argmax()))
            continue
        tokens.append(_sample_row(row, p, gen))
    return tokens


def _sample_row(row: torch.Tensor, p: SamplingParams, gen: torch.Generator | None) -> int:
    scores = row / p.temperature
    if p.temperature < 1:  # a large logit over a small temperature overflows: the largest float keeps softmax sane
        scores.nan_to_num_(nan=float("-inf"), posinf=torch.finfo(row.dtype).max)
    probs = torch.softmax(scores, dim=-1)
    top_k = p.top_k if 0 < p.top_k < probs.shape[-1] else 0
    if top_k or p.top_p < 1.0 or p.min_p > 0:
        # SGLang's joint filtering (its PyTorch backend; FlashInfer's "joint" order): top-k by rank and top-p on
        # the cumulative probability of the whole distribution, not of what top-k kept; min-p relative to the
        # most likely token, which both always keep.
        sorted_probs, order = probs.sort(descending=True)
        drop = (sorted_probs.cumsum(-1) - sorted_probs) > p.top_p if p.top_p < 1.0 else None
        if top_k:
            sorted_probs[top_k:] = 0.0
        if drop is not None:
            sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        if p.min_p > 0:
            sorted_probs = sorted_probs.masked_fill(sorted_probs < sorted_probs[0] * p.min_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=gen))
