"""StaticCache: preallocated keys/values for a batch of sequences, left-padded to a common length."""

from __future__ import annotations

import torch

from leanlm.cache.base import UpdateThenAttend
from leanlm.models.config import ModelConfig


class StaticCache(UpdateThenAttend):
    """Slot j of row b holds the token at position j - pad[b]; slots before pad[b] are padding.

    All rows advance together, so a batch of prompts of different lengths is left-padded once at prefill.
    `truncate(n)` rolls every row back to n slots (speculative decoding discards rejected tokens this way).
    """

    def __init__(self, cfg: ModelConfig, batch: int, max_len: int, dtype: torch.dtype, device=None, pad: torch.Tensor | None = None):
        shape = (batch, cfg.num_kv_heads, max_len, cfg.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]
        self.max_len = max_len
        self.length = 0
        self.pad = pad if pad is not None and bool(pad.any()) else None  # [B] padding slots per row

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Store k, v  # [B, Hkv, T, D] at the next T slots; return every slot so far  # [B, Hkv, S, D]"""
        end = self.length + k.shape[2]
        if end > self.max_len:
            raise ValueError(f"KV cache full: {end} > {self.max_len} slots")
        self.k[layer][:, :, self.length : end] = k
        self.v[layer][:, :, self.length : end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]

    def attention_mask(self, T: int):
        if self.pad is None:
            if T == 1:
                return None, False
            if self.length == 0:
                return None, True
        S = self.length + T
        key = torch.arange(S, device=self.k[0].device)
        query = torch.arange(self.length, S, device=self.k[0].device)
        allowed = key[None, :] <= query[:, None]  # [T, S]
        if self.pad is not None:
            allowed = allowed[None] & (key[None, None, :] >= self.pad[:, None, None])  # [B, T, S]
        else:
            allowed = allowed[None]
        return allowed.unsqueeze(1), False

    def advance(self, T: int) -> None:
        self.length += T

    def truncate(self, length: int) -> None:
        self.length = min(self.length, length)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.k + self.v)
