"""A decode step compiled with torch.compile (inductor): static shapes, fused kernels, little Python per step.

Eager PyTorch pays a fixed cost per op; a 30-layer model runs ~600 ops per token, which on a small model
costs as much as reading its weights. Compiled, every layer becomes a few fused C++ loops. Shapes must
stay fixed, so the compiled step writes the new key/value at a slot given as a tensor and attends over
every slot of the cache with a mask, instead of slicing to the current length.
"""

from __future__ import annotations

import types

import torch

from leanlm.cache.static import StaticCache
from leanlm.compress.quant.kv import dequantize_per_token, quantize_per_token
from leanlm.models.transformer import Transformer


# cpp_wrapper: a C++ launcher, no Python between kernels.
# realize_opcount_threshold: inductor inlines a pointwise chain into its consumer unless the chain has more
# ops than this (CPU default 50). Inlined into a GEMV, the RMSNorm and residual before each projection are
# recomputed for every one of its output rows, which made the kernels compute-bound. At batch 1 those
# activations are a single row, so storing them costs nothing. Measured on the default model, bf16, two
# threads (tokens/s): default 60, threshold 16: 70, 12: 73, 10: 82, 9: 83, 8: 90, 7: 77, 4: 65, 2: 75.
# size_asserts off: the launcher would check the sizes and strides of each of its ~250-490 inputs (the weights
# among them) on every step, ~0.2 ms on the default model; the model is fixed once compiled (see CompiledDecoder).
INDUCTOR_OPTIONS = {"cpu": {"cpp_wrapper": True, "realize_opcount_threshold": 8, "size_asserts": False}, "cuda": {}}


class _SlotCache:
    """KVCache for one static-shape step: writes at a tensor slot, attends over every slot (masked). With scales
    (an Int8KVCache's), k and v are stored as int8 codes with a scale per (token, head) and read dequantized."""

    def __init__(self, k: list[torch.Tensor], v: list[torch.Tensor], slot: torch.Tensor, mask: torch.Tensor,
                 k_scale: list[torch.Tensor] | None = None, v_scale: list[torch.Tensor] | None = None):
        self.k, self.v, self.slot, self.mask, self.k_scale, self.v_scale = k, v, slot, mask, k_scale, v_scale

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        if self.k_scale is None:
            self.k[layer].index_copy_(2, self.slot, k)
            self.v[layer].index_copy_(2, self.slot, v)
            return self.k[layer], self.v[layer]
        out = []
        for codes, scales, x in ((self.k, self.k_scale, k), (self.v, self.v_scale, v)):
            q, scale = quantize_per_token(x)
            codes[layer].index_copy_(2, self.slot, q)
            scales[layer].index_copy_(2, self.slot, scale)
            # float32, not rounded back to x.dtype: with two more conversions the chain feeding attention's
            # reductions passes realize_opcount_threshold, and inductor stored its [B, Hkv, G, S, D] products
            # (two 9 MB buffers per layer at 4096 slots: 8x slower than the bf16 cache)
            out.append(dequantize_per_token(codes[layer], scales[layer], torch.float32))
        return tuple(out)

    def attention_mask(self, T: int):
        return self.mask, False

    def advance(self, T: int) -> None:
        pass


def _step(model: Transformer, tokens, positions, k, v, slot, pad, k_scale, v_scale):
    """tokens, positions [B, 1]; slot [1]; pad [B] -> logits [B, V]"""
    key = torch.arange(k[0].shape[2], device=tokens.device)
    mask = (key[None] <= slot) & (key[None] >= pad[:, None])  # [B, S]
    cache = _SlotCache(k, v, slot, mask[:, None, None, :], k_scale, v_scale)
    return model(tokens, positions, cache, last_only=True)[:, -1]


class CompiledDecoder:
    """decode_step() with the same contract as generation.decode.decode_step, run by a compiled graph."""

    def __init__(self, model: Transformer):
        """`model` must not change (weights, dtype, modules) once its decoder is built."""
        self.model = model
        # Dynamo checks guards on every module attribute and parameter before each step: ~1.3 ms per token on the
        # default model, more than its attention. The model is fixed, so those guards are dropped (0.2 ms left).
        # Dynamo keeps its graphs per code object; a copy of _step's code for each decoder keeps two models in
        # one process (equal shapes, no module guards left to tell them apart) from running each other's graph.
        step = types.FunctionType(_step.__code__.replace(), _step.__globals__, _step.__name__)
        options = dict(INDUCTOR_OPTIONS[model.device.type])
        if hasattr(torch.compiler, "skip_guard_on_all_nn_modules_unsafe"):  # not in older torch
            options["guard_filter_fn"] = torch.compiler.skip_guard_on_all_nn_modules_unsafe
        self.fn = torch.compile(step, fullgraph=True, dynamic=False, options=options)

    @torch.inference_mode()
    def decode_step(self, cache: StaticCache, tokens: torch.Tensor) -> torch.Tensor:
        B, dev = tokens.shape[0], tokens.device
        pad = cache.pad if cache.pad is not None else torch.zeros(B, dtype=torch.long, device=dev)
        slot = torch.tensor([cache.length], device=dev)
        scales = getattr(cache, "k_scale", None), getattr(cache, "v_scale", None)  # an Int8KVCache's
        logits = self.fn(self.model, tokens[:, None], (slot - pad)[:, None], cache.k, cache.v, slot, pad, *scales)
        cache.advance(1)
        return logits
