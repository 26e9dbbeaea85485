"""One attention protocol (cache.base.KVCache): every cache takes the same q, k, v [B, T, heads, D] and gives the
same attention output, whatever it stores and however it reads it back."""

import pytest
import torch

from leanlm.cache.int8 import Int8KVCache
from leanlm.cache.paged import KVPool
from leanlm.cache.paged_attention import PagedStep
from leanlm.cache.static import StaticCache
from leanlm.engine.compiled import _SlotWrites
from leanlm.generation.compiled import _SlotCache
from leanlm.models.config import ModelConfig
from leanlm.models.layers import dense_attention

CFG = ModelConfig(model_type="llama", vocab_size=128, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=16, max_position=256)
TABLE = [5, 1, 7]  # scattered blocks of 4 slots: positions 0-11


def qkv(T: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [1, T, H, D]; k, v [1, T, Hkv, D]"""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, T, 4, 16, generator=g), torch.randn(1, T, 2, 16, generator=g) * 2,
            torch.randn(1, T, 2, 16, generator=g))


def attend(cache, T: int, q, k, v, layer: int = 1) -> torch.Tensor:
    """One forward's worth of the protocol, as models.layers.Attention and Transformer.hidden drive it."""
    mask, is_causal = cache.attention_mask(T)
    out = cache.attend(layer, q, k, v, mask, is_causal)
    cache.advance(T)
    return out


@pytest.mark.parametrize("int8", [False, True])
def test_static_and_paged_caches_attend_alike(int8):
    """A 9-token prompt, then two decode steps: the static cache (contiguous slots, its mask, dense attention) and
    an engine step over the block pool (SDPA over the gathered chunk, the paged kernel for single tokens)."""
    static = (Int8KVCache if int8 else StaticCache)(CFG, 1, 16, torch.float32)
    pool = KVPool(CFG, 8, 4, torch.float32, int8=int8)
    prompt = qkv(9, seed=0)
    steps = [(0, 9, prompt)] + [(9 + i, 1, qkv(1, seed=1 + i)) for i in range(2)]
    for start, n, (q, k, v) in steps:
        ours = attend(PagedStep(pool, [TABLE], [start], [n]), n, q, k, v)
        theirs = attend(static, n, q, k, v)
        assert ours.shape == theirs.shape == (1, n, 4, 16)
        assert (ours - theirs).abs().max() < 1e-5
    q, k, v = prompt  # no cache: the prompt's tokens attend to each other, causally
    alone = dense_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, True).transpose(1, 2)
    fresh = (Int8KVCache if int8 else StaticCache)(CFG, 1, 16, torch.float32)
    assert (attend(fresh, 9, q, k, v) - alone).abs().max() < (0.05 if int8 else 1e-6)


@pytest.mark.parametrize("int8", [False, True])
def test_bfloat16_prompt_chunks_attend_like_the_static_cache(int8):
    """bf16: a 9-token prompt in two chunks (5 tokens, then 4 attending to those too) through engine steps over the
    pool (leanlm's prefill kernel where the CPU has bf16 dot products, else SDPA over the gathered keys) against
    the static cache in float32 on the same bf16 inputs (int8: the int8 static cache, which rounds alike)."""
    pool = KVPool(CFG, 8, 4, torch.bfloat16, int8=int8)
    static = (Int8KVCache if int8 else StaticCache)(CFG, 1, 16, torch.float32)
    q, k, v = (x.bfloat16() for x in qkv(9, seed=0))
    for start, n in ((0, 5), (5, 4)):
        part = [x[:, start : start + n] for x in (q, k, v)]
        ours = attend(PagedStep(pool, [TABLE], [start], [n]), n, *part)
        theirs = attend(static, n, *(x.float() for x in part))
        assert ours.dtype == torch.bfloat16 and (ours.float() - theirs).abs().max() < 2e-2 * theirs.abs().max()


def test_the_compiled_steps_caches_attend_like_the_static_one():
    """The slot caches the compiled steps trace (run eagerly here): generation.compiled's writes at a slot and
    masks the rest; engine.compiled's writes at pool slots and reads through block tables."""
    static = StaticCache(CFG, 1, 16, torch.float32)
    attend(static, 9, *qkv(9, seed=0))
    q, k, v = qkv(1, seed=1)
    expected = attend(static, 1, q, k, v)

    slots = StaticCache(CFG, 1, 16, torch.float32)
    attend(slots, 9, *qkv(9, seed=0))
    mask = (torch.arange(16) <= 9)[None, None, None]  # [B, 1, 1, S]: slots 0..9 written
    cache = _SlotCache(slots.k, slots.v, torch.tensor([9]), mask)
    assert (cache.attend(1, q, k, v, *cache.attention_mask(1)) - expected).abs().max() < 1e-5

    pool = KVPool(CFG, 8, 4, torch.float32)
    if PagedStep(pool, [TABLE], [0], [9]).kernel is None:
        pytest.skip("the paged-attention kernel is not available here")
    attend(PagedStep(pool, [TABLE], [0], [9]), 9, *qkv(9, seed=0))
    tables, lens = torch.tensor([TABLE], dtype=torch.int32), torch.tensor([10], dtype=torch.int32)
    cache = _SlotWrites(pool.k, pool.v, torch.tensor([TABLE[2] * 4 + 1]), tables, lens, 4)
    assert (cache.attend(1, q, k, v, *cache.attention_mask(1)) - expected).abs().max() < 1e-5
