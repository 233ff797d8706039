"""Per-request sampling: temperature, top-k, top-p (nucleus) and a seed.

Greedy is the default (``temperature`` 0) and goes through the runtime's greedy choice
unchanged, so default requests stay bit-identical to offline :func:`dash_trt.model.generate`.
A sampling request draws from its own generator, seeded from ``seed`` (or from the system's
entropy when none is given): the same prompt, parameters and seed give the same tokens
whatever else runs in the same batch, on the same device. Image tokens are never chosen (as
in greedy: they come from the vision side). The draw happens on the host from the token's
float32 logits row, after the step's one device read.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

__all__ = ["SamplingParams", "Sampler", "SamplingError"]

#: The largest seed a request may carry (torch generators take 64-bit seeds; JSON and
#: Triton's INT64 carry signed ones).
MAX_SEED = 2**63 - 1


class SamplingError(ValueError):
    """Bad sampling parameters (the message names the parameter)."""


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  #: 0: greedy; > 0 divides the logits
    top_k: int = 0  #: keep the k most likely tokens (0: all)
    top_p: float = 1.0  #: keep the smallest set whose probability reaches top_p (1: all)
    seed: int | None = None  #: the request's generator seed (None: drawn from os.urandom)

    def __post_init__(self) -> None:
        t, k, p, s = self.temperature, self.top_k, self.top_p, self.seed
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise SamplingError(f"temperature must be a finite number >= 0, got {t!r}")
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise SamplingError(f"top_k must be an integer >= 0 (0: off), got {k!r}")
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not (0.0 < p <= 1.0):
            raise SamplingError(f"top_p must be in (0, 1], got {p!r}")
        if s is not None and (isinstance(s, bool) or not isinstance(s, int) or not 0 <= s <= MAX_SEED):
            raise SamplingError(f"seed must be an integer in 0..{MAX_SEED}, got {s!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class Sampler:
    """One request's draws: :meth:`choose` picks the next token from a logits row."""

    def __init__(self, params: SamplingParams, image_token_id: int | None):
        self.params = params
        self.image_token_id = image_token_id
        self.seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
        self.generator = torch.Generator(device="cpu").manual_seed(self.seed)

    def choose(self, logits: torch.Tensor) -> int:
        """The next token from ``logits`` [V] (any device and dtype; drawn in float32 on the CPU)."""
        p = self.params
        x = logits.detach().float().cpu().clone()
        if self.image_token_id is not None:
            x[self.image_token_id] = -math.inf
        if p.greedy:
            return int(x.argmax())
        x = (x - x.max()) / p.temperature  # the largest at 0: no inf / inf at small temperatures
        if 0 < p.top_k < x.numel():
            kth = torch.topk(x, p.top_k).values[-1]
            x[x < kth] = -math.inf
        probs = torch.softmax(x, -1)
        if p.top_p < 1.0:
            sorted_p, order = torch.sort(probs, descending=True, stable=True)
            before = sorted_p.cumsum(0) - sorted_p  # mass of the more likely tokens
            drop = order[before >= p.top_p]  # the first token is always kept (before = 0)
            probs[drop] = 0.0
        return int(torch.multinomial(probs, 1, generator=self.generator))
