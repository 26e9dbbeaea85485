"""The KVCache protocol that the model talks to; static, paged and compiled-step caches implement it."""

from __future__ import annotations

from typing import Protocol

import torch

from leanlm.models.layers import dense_attention


class KVCache(Protocol):
    """What models.layers.Attention asks of a cache, whatever it is: a static cache (rows of contiguous slots), an
    engine step over the paged pool (B = 1, T packed tokens of many sequences), or a compiled step's slot cache.
    The model calls attention_mask once per forward and hands its result to every layer's `attend`, so that no cache
    keeps per-forward state and the mask is built once, not once per layer."""

    def attention_mask(self, T: int) -> tuple[torch.Tensor | None, bool]:
        """(mask [B, 1, T, S] of allowed keys, or None; is_causal) for the next T queries."""

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
               is_causal: bool) -> torch.Tensor:
        """Store this step's keys and values and attend over every key so far  # q [B, T, H, D]; k, v [B, T, Hkv, D]
        -> [B, T, H, D]; mask, is_causal: what attention_mask(T) returned."""

    def advance(self, T: int) -> None:
        """Called once per forward, after every layer has stored its T new entries."""


class UpdateThenAttend:
    """`attend` for a cache whose `update(layer, k, v)` stores keys and values  # [B, Hkv, T, D] and returns every
    one so far  # [B, Hkv, S, D]: then dense attention (models.layers) under the cache's mask."""

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
               is_causal: bool) -> torch.Tensor:
        """q [B, T, H, D]; k, v [B, T, Hkv, D] -> [B, T, H, D]"""
        keys, values = self.update(layer, k.transpose(1, 2), v.transpose(1, 2))
        return dense_attention(q.transpose(1, 2), keys, values, mask, is_causal).transpose(1, 2)
