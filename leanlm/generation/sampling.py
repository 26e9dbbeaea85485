"""SamplingParams and the one function that turns logits into a next-token distribution."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from leanlm.errors import LeanLMError


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy; top_k 0 and top_p 1 mean no truncation; seed makes sampling repeatable."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    max_tokens: int = 128
    stop: tuple[str, ...] = field(default_factory=tuple)
    seed: int | None = None
    ignore_eos: bool = False

    def __post_init__(self):
        if self.temperature < 0:
            raise LeanLMError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise LeanLMError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise LeanLMError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_tokens < 1:
            raise LeanLMError(f"max_tokens must be >= 1, got {self.max_tokens}")
        object.__setattr__(self, "stop", (self.stop,) if isinstance(self.stop, str) else tuple(self.stop))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Next-token distribution after temperature, top-k and top-p  # [..., V] -> [..., V] float32"""
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = logits.topk(params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)
    if params.top_p < 1:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p (always at least the top token)
        drop = (sorted_p.cumsum(-1) - sorted_p) >= params.top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row  # [B, V] -> [B]"""
    if params.greedy:
        return logits.argmax(-1)
    probs = probabilities(logits, params)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
