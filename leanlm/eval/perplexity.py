"""Perplexity over a token stream with a sliding window; KL and top-1 agreement against a reference model.

Windowing (the same for every model, so numbers are comparable): windows of `window` tokens start every
`stride` tokens; each window scores only the tokens no earlier window scored, each predicted from all the
tokens before it inside its window. With stride < window every scored token after the first window sees at
least window - stride tokens of context, and N tokens give N - 1 predictions (the first token has no
context). With stride == window the windows are disjoint and each window's first token goes unscored.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from leanlm.errors import LeanLMError
from leanlm.models.transformer import Transformer

DEFAULT_WINDOW = 1024
DEFAULT_STRIDE = 512
DEFAULT_MAX_TOKENS = 16384  # of the evaluation text: ~20 s for the default model on two cores


@dataclass(frozen=True)
class PerplexityResult:
    perplexity: float
    nll: float  # mean negative log-likelihood per token, nats
    tokens: int  # number of scored tokens


DP_QUANTILES = (0.0, 0.01, 0.05, 0.5, 0.95, 0.99, 1.0)  # of dp, as llama.cpp's KL statistics report them


@dataclass(frozen=True)
class Agreement:
    kl: float  # mean KL(reference || model) per token, nats
    top1: float  # fraction of positions where both models' most likely token is the same
    tokens: int
    dp: tuple[float, ...] = ()  # quantiles DP_QUANTILES of p_model(next token) - p_reference(next token)
    dp_rms: float = 0.0  # root mean square of that difference


def windows(n: int, window: int, stride: int) -> Iterator[tuple[int, int, int]]:
    """(begin, end, first scored index) of each window over n tokens; every index 1..n-1 scored once."""
    if window < 2 or not 1 <= stride <= window:
        raise LeanLMError(f"need window >= 2 and 1 <= stride <= window (got window={window}, stride={stride})")
    if n < 2:
        raise LeanLMError(f"need at least 2 tokens of text to score, got {n}")
    scored_until = 1
    for begin in range(0, n, stride):
        end = min(begin + window, n)
        yield begin, end, max(scored_until, begin + 1)
        scored_until = end
        if end == n:
            return


def _scored_logits(model: Transformer, ids: torch.Tensor, begin: int, end: int, first: int,
                   cache_cls=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits [n, V] predicting ids[first:end], and those targets [n]; with `cache_cls` (e.g. Int8KVCache) the
    window's keys and values pass through such a cache, so attention sees what decoding from it would."""
    chunk = ids[begin:end].to(model.device)[None]
    cache = None if cache_cls is None else cache_cls(model.config, 1, end - begin, model.dtype, model.device)
    logits = model(chunk, torch.arange(end - begin, device=model.device)[None], cache)[0]
    return logits[first - begin - 1 : end - begin - 1].float(), chunk[0, first - begin :]


@torch.inference_mode()
def score(model: Transformer, ids: torch.Tensor, reference: Transformer | None = None, window: int = DEFAULT_WINDOW,
          stride: int = DEFAULT_STRIDE, progress=None, cache_cls=None) -> tuple[PerplexityResult, Agreement | None]:
    """Perplexity of `model` on a token stream ids [N] (see the module docstring for the windowing) and, with a
    reference, in the same pass: mean KL(reference || model), top-1 agreement and the spread of the change in
    the next token's probability. `cache_cls`: the model's KV cache (see _scored_logits)."""
    window = min(window, model.config.max_position, reference.config.max_position if reference else window)
    nll, kl, same, count, dps = 0.0, 0.0, 0, 0, []
    for begin, end, first in windows(len(ids), window, min(stride, window)):
        logits, targets = _scored_logits(model, ids, begin, end, first, cache_cls)
        nll += F.cross_entropy(logits, targets, reduction="sum").item()
        count += len(targets)
        if reference is not None:
            logp = logits.log_softmax(-1)
            logq = _scored_logits(reference, ids, begin, end, first)[0].log_softmax(-1)
            kl += (logq.exp() * (logq - logp)).sum().item()
            same += (logp.argmax(-1) == logq.argmax(-1)).sum().item()
            picked = targets[:, None].to(logp.device)
            dps.append((logp.gather(-1, picked).exp() - logq.gather(-1, picked).exp())[:, 0].cpu())
        if progress:
            progress(len(targets))
    agree = None
    if reference is not None:
        dp = torch.cat(dps)
        agree = Agreement(kl / count, same / count, count, tuple(torch.quantile(dp, torch.tensor(DP_QUANTILES)).tolist()),
                          dp.square().mean().sqrt().item())
    return PerplexityResult(math.exp(nll / count), nll / count, count), agree


def perplexity(model: Transformer, ids: torch.Tensor, window: int = DEFAULT_WINDOW, stride: int = DEFAULT_STRIDE,
               progress=None) -> PerplexityResult:
    """Perplexity of `model` on a token stream ids [N]."""
    return score(model, ids, None, window, stride, progress)[0]


def agreement(model: Transformer, reference: Transformer, ids: torch.Tensor, window: int = DEFAULT_WINDOW,
              stride: int = DEFAULT_STRIDE, progress=None) -> Agreement:
    """How closely `model` follows `reference` on the same tokens: mean KL and top-1 agreement."""
    return score(model, ids, reference, window, stride, progress)[1]


def scored_tokens(n: int, window: int = DEFAULT_WINDOW, stride: int = DEFAULT_STRIDE) -> int:
    return sum(end - first for _, end, first in windows(n, window, stride))
