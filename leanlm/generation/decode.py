"""Prefill, decode step and the generation loop (batched, streaming, EOS and stop strings)."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial

import torch

from leanlm.cache.static import StaticCache
from leanlm.errors import LeanLMError
from leanlm.generation.sampling import SamplingParams, sample
from leanlm.models.transformer import Transformer


@dataclass
class Completion:
    prompt_tokens: list[int]
    tokens: list[int]
    text: str
    finish_reason: str  # "stop" (EOS or a stop string) or "length"


def check_fits(window: int, prompt_len: int, max_tokens: int | None) -> int:
    """Clip max_tokens (None: no limit) to the context window (a model's max_position); refuse a prompt that does
    not fit at all."""
    if prompt_len == 0:
        raise LeanLMError("empty prompt: give at least one token of text")
    if prompt_len >= window:
        raise LeanLMError(f"prompt is {prompt_len} tokens; the model's context window is {window} tokens")
    return window - prompt_len if max_tokens is None else min(max_tokens, window - prompt_len)


@torch.inference_mode()
def prefill(model: Transformer, prompts: list[list[int]], max_new: int, round_to: int = 1,
            cache_cls: type = StaticCache) -> tuple[torch.Tensor, StaticCache]:
    """Run the prompts (left-padded to one length) through the model; return last logits [B, V] and the cache.

    round_to: size the cache to a multiple of this, so that a compiled decode step sees few distinct shapes.
    cache_cls: StaticCache or a drop-in subclass (cache.int8.Int8KVCache).
    """
    longest = max(len(p) for p in prompts)
    slots = min(-(-(longest + max_new) // round_to) * round_to, max(model.config.max_position, longest + max_new))
    pad = torch.tensor([longest - len(p) for p in prompts], device=model.device)
    tokens = torch.tensor([[0] * (longest - len(p)) + list(p) for p in prompts], device=model.device)
    positions = (torch.arange(longest, device=model.device)[None] - pad[:, None]).clamp(min=0)
    cache = cache_cls(model.config, len(prompts), slots, model.dtype, model.device, pad=pad)
    logits = model(tokens, positions, cache, last_only=True)
    return logits[:, -1], cache


@torch.inference_mode()
def prefill_seconds(model: Transformer, n: int, repeats: int = 2) -> float:
    """The best of `repeats` timings of one prefill of n random tokens."""
    ids = torch.randint(0, model.config.vocab_size, (n,)).tolist()
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        prefill(model, [ids], 1)
        best = min(best, time.perf_counter() - start)
    return best


@torch.inference_mode()
def decode_step(model: Transformer, cache: StaticCache, tokens: torch.Tensor) -> torch.Tensor:
    """Feed one token per row  # [B] -> next logits [B, V]"""
    positions = torch.full((tokens.shape[0], 1), cache.length, device=tokens.device)
    if cache.pad is not None:
        positions = positions - cache.pad[:, None]
    return model(tokens[:, None], positions, cache)[:, -1]


def generate_ids(model: Transformer, prompts: list[list[int]], params: SamplingParams,
                 eos_ids: set[int] = frozenset(), compiled=None, cache_cls: type = StaticCache) -> Iterator[list[int]]:
    """Yield one list per step with the new token of every row; stop once every row has produced EOS.

    `compiled`: a generation.compiled.CompiledDecoder to run the decode steps with (default: eager).
    """
    step = compiled.decode_step if compiled is not None else partial(decode_step, model)
    max_new = check_fits(model.config.max_position, max(len(p) for p in prompts), params.max_tokens)
    generator = None
    if params.seed is not None:
        generator = torch.Generator(device=model.device).manual_seed(params.seed)
    logits, cache = prefill(model, prompts, max_new, round_to=256 if compiled is not None else 1, cache_cls=cache_cls)
    done = [False] * len(prompts)
    for i in range(max_new):
        tokens = sample(logits, params, generator)
        ids = tokens.tolist()
        done = [d or (t in eos_ids and not params.ignore_eos) for d, t in zip(done, ids)]
        yield ids
        if all(done) or i == max_new - 1:
            return
        logits = step(cache, tokens)
