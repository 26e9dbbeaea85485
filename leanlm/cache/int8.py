"""The int8 KV-cache format: keys and values as int8 codes with one absmax scale per (token, head), used by the
static cache (Int8KVCache here), the paged pool (cache.paged) and the compiled slot cache (generation.compiled).
It lives with the caches, under the algorithms that choose it, so that no cache reaches up into `compress`."""

from __future__ import annotations

import torch

from leanlm.cache.static import StaticCache
from leanlm.models.config import ModelConfig


def int8_bytes_per_head(head_dim: int) -> int:
    """Bytes one token's key (or value) of one head takes in an int8 cache: the codes and a float32 scale."""
    return head_dim + 4


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric absmax int8 over the last dim: x [..., D] -> (q int8 [..., D], scale float32 [..., 1]).
    The grid is lowbit.primitives' symmetric 8-bit one at token granularity (a test holds them equal)."""
    scale = x.detach().float().abs().amax(-1, keepdim=True).clamp(min=1e-12) / 127
    return (x.float() / scale).round_().clamp_(-128, 127).to(torch.int8), scale


def dequantize_per_token(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q int8 [..., D] * scale [..., 1] -> [..., D] in dtype (symmetric: no zero point)."""
    return (q.float() * scale).to(dtype)


class Int8KVCache(StaticCache):
    """Drop-in StaticCache with int8 storage: about half the bytes of a bf16 cache at head_dim 64.

    Slots, padding, masks, advance and truncate are StaticCache's; only storage and `update` differ.
    `update` returns the attended range dequantized to `dtype`, so attention itself is unchanged.
    Scales are float32 so that every stored element is within scale/2 of what was written.
    """

    def __init__(self, cfg: ModelConfig, batch: int, max_len: int, dtype: torch.dtype, device=None, pad: torch.Tensor | None = None):
        super().__init__(cfg, batch, 0, dtype, device, pad=pad)  # zero slots: keeps StaticCache's pad handling, allocates nothing
        shape = (batch, cfg.num_kv_heads, max_len, cfg.head_dim)
        self.k = [torch.zeros(shape, dtype=torch.int8, device=device) for _ in range(cfg.num_layers)]
        self.v = [torch.zeros(shape, dtype=torch.int8, device=device) for _ in range(cfg.num_layers)]
        scale_shape = shape[:-1] + (1,)
        self.k_scale = [torch.zeros(scale_shape, dtype=torch.float32, device=device) for _ in range(cfg.num_layers)]
        self.v_scale = [torch.zeros(scale_shape, dtype=torch.float32, device=device) for _ in range(cfg.num_layers)]
        self.max_len = max_len
        self.dtype = dtype

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Quantize and store k, v  # [B, Hkv, T, D]; return all keys/values so far in dtype  # [B, Hkv, S, D]"""
        (qk, sk), (qv, sv) = quantize_per_token(k), quantize_per_token(v)
        end = self.length + k.shape[2]
        qk_all, qv_all = super().update(layer, qk, qv)  # bounds check and slot write on the int8 storage
        self.k_scale[layer][:, :, self.length : end] = sk
        self.v_scale[layer][:, :, self.length : end] = sv
        return (dequantize_per_token(qk_all, self.k_scale[layer][:, :, :end], self.dtype),
                dequantize_per_token(qv_all, self.v_scale[layer][:, :, :end], self.dtype))

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.k + self.v + self.k_scale + self.v_scale)
