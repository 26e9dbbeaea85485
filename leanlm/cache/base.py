"""The KVCache protocol that the model talks to; static and paged caches implement it."""

from __future__ import annotations

from typing import Protocol

import torch


class KVCache(Protocol):
    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this step's keys/values  # [B, Hkv, T, D]; return all keys/values so far  # [B, Hkv, S, D]"""

    def attention_mask(self, T: int) -> tuple[torch.Tensor | None, bool]:
        """(mask [B, 1, T, S] of allowed keys, or None; is_causal) for the next T queries."""

    def advance(self, T: int) -> None:
        """Called once per forward, after every layer has stored its T new entries."""
