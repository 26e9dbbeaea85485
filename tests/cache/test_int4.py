"""The int4 paged KV pool (cache.int4): keys per channel over each block, values rotated and quantized per token
in groups of 16, the keys of blocks still filling in full precision, measured against the naive per-block / per-token definitions."""

import pytest
import torch

from leanlm.cache.int4 import GROUP, Int4KVPool, fit, pack, unpack
from leanlm.cache.paged import KVPool
from leanlm.cache.paged_attention import PagedStep
from leanlm.errors import LeanLMError
from leanlm.models.config import ModelConfig

@pytest.fixture(autouse=True, params=["kernels", "python"])
def path(request, monkeypatch):
    """Every test twice: with the C++ ops (reads, value grids, decode attention) where they build, and without
    (the tensor-op definitions they replace)."""
    if request.param == "python":
        monkeypatch.setattr("leanlm.cache.int4.kernels.ops", lambda: None)
        monkeypatch.setattr("leanlm.cache.paged_attention.kernels.ops", lambda: None)
    return request.param


CFG = ModelConfig(model_type="llama", vocab_size=128, hidden_size=128, intermediate_size=96, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=64, max_position=256)
BS = 4


def keys_values(T: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """k, v [T, Hkv, D]; the keys with outlier channels (3 and 40 large in every token), as real keys have."""
    g = torch.Generator().manual_seed(seed)
    k, v = torch.randn(T, 2, 64, generator=g), torch.randn(T, 2, 64, generator=g)
    k[..., 3] += 20
    k[..., 40] -= 12
    return k, v


def write(pool, slots: list[int], k, v, layers=(0, 1), firsts=()):
    """One step's writes, as PagedStep makes them."""
    slots = torch.tensor(slots)
    pool.prepare(slots, list(firsts))
    for layer in layers:
        pool.write(layer, slots, k, v)


def naive_keys(k: torch.Tensor) -> torch.Tensor:
    """Per-channel asymmetric 4-bit over each whole block of BS tokens, float16 scale and minimum."""
    out = torch.empty_like(k)
    for b in range(0, len(k), BS):
        x = k[b : b + BS]
        low = x.amin(0).half().float()
        scale = ((x.amax(0) - low) / 15).clamp(min=1e-7).half().float()
        out[b : b + BS] = ((x - low) / scale).round().clamp(0, 15) * scale + low
    return out


def naive_values(v: torch.Tensor) -> torch.Tensor:
    """Per-token asymmetric 4-bit in groups of GROUP channels."""
    x = v.unflatten(-1, (-1, GROUP))
    low = x.amin(-1, keepdim=True).half().float()
    scale = ((x.amax(-1, keepdim=True) - low) / 15).clamp(min=1e-7).half().float()
    return (((x - low) / scale).round().clamp(0, 15) * scale + low).flatten(-2)


def test_codes_pack_two_to_a_byte_and_fit_within_half_a_step():
    x = torch.randn(5, 64) * torch.linspace(0.1, 10, 64)
    codes, scale, low = fit(x, -1)
    assert codes.dtype == torch.uint8 and int(codes.max()) <= 15 and scale.dtype == low.dtype == torch.float16
    packed = pack(codes)
    assert packed.shape == (5, 32) and torch.equal(unpack(packed), codes.float())
    error = (codes.float() * scale.float() + low.float() - x).abs()
    assert bool((error <= scale.float() / 2 + 1e-3).all())


def test_decoded_keys_and_values_are_the_naive_quantization_with_the_open_block_exact():
    """A prompt chunk, then token by token (decode steps): full blocks read back as the naive per-channel grid over
    the block, the open block's keys exactly as written; values per token, in the pool's rotated basis."""
    pool = Int4KVPool(CFG, 8, BS, torch.float32)
    table = [6, 2, 5, 0]  # positions 0-15
    k, v = keys_values(14, seed=0)
    slots = [table[p // BS] * BS + p % BS for p in range(14)]
    write(pool, slots[:5], k[:5], v[:5])  # a prompt chunk: one full block, one open
    for p in range(5, 14):
        write(pool, slots[p : p + 1], k[p : p + 1], v[p : p + 1])
    keys, values = pool.read(1, torch.tensor(slots))
    expected = naive_keys(k[:12])
    assert (keys[:12] - expected).abs().max() < 1e-5
    assert torch.equal(keys[12:], k[12:])  # the open block: full precision
    Q = pool.value_basis
    assert torch.allclose(Q @ Q.T, torch.eye(64), atol=1e-6)
    assert (values - naive_values(v @ Q)).abs().max() < 1e-5
    assert pool.open == {0: [pool.open[0][0], 2]}  # one side entry in use, holding two tokens


def test_per_channel_keys_beat_per_token_keys_on_outlier_channels():
    """KIVI's reason for quantizing keys per channel: a token's grid spans the outliers and crushes the rest."""
    k, _ = keys_values(64, seed=1)
    per_channel = (naive_keys(k) - k).pow(2).mean()
    per_token = (naive_values(k) - k).pow(2).mean()
    assert per_channel < per_token / 4


def test_rotated_values_lose_less_to_a_large_channel():
    """A value with a few large channels: its groups' grids stretch to them; rotated (v Q), they are spread."""
    pool = Int4KVPool(CFG, 8, BS, torch.float32)
    _, v = keys_values(64, seed=6)
    v[:, :, 5] *= 8
    Q = pool.value_basis
    plain = (naive_values(v) - v).pow(2).mean()
    rotated = (naive_values(v @ Q) @ Q.T - v).pow(2).mean()
    assert rotated < 0.8 * plain


def test_side_entries_run_out_and_evicted_blocks_open_again():
    """Three sequences' open blocks with two side entries: the least recent is quantized over the tokens it holds;
    written again, it opens from the codes and closes with the rest."""
    pool = Int4KVPool(CFG, 8, BS, torch.float32, open_blocks=2)
    k, v = keys_values(12, seed=2)
    for block in (1, 4):
        write(pool, [block * BS, block * BS + 1], k[:2], v[:2])
    write(pool, [7 * BS], k[2:3], v[2:3])  # a third open block: block 1 (least recent) is given up
    assert set(pool.open) == {4, 7} and pool.evicted == {1: 2}
    keys, _ = pool.read(0, torch.tensor([BS, BS + 1]))
    assert (keys - k[:2]).abs().max() < (k[:2].amax(0) - k[:2].amin(0)).max() / 15
    write(pool, [BS + 2, BS + 3], k[3:5], v[3:5])  # block 1 again: it fills and is quantized over all four
    assert 1 not in pool.open and 1 not in pool.evicted
    keys, _ = pool.read(0, torch.tensor([BS + i for i in range(4)]))
    reference = torch.cat([keys[:2], k[3:5]])  # its first two keys went through 4 bits once already
    assert (keys - naive_keys(reference)).abs().max() < 1e-5


def test_a_forked_open_block_keeps_its_full_precision_keys():
    pool = Int4KVPool(CFG, 8, BS, torch.float32)
    k, v = keys_values(6, seed=3)
    write(pool, [0, 1, 2, 3, 8, 9], k, v)  # blocks 0 (full) and 2 (open, 2 tokens)
    pool.copy_blocks([(2, 5)])
    write(pool, [22], *keys_values(1, seed=4))  # the child writes its third token in block 5
    parent, _ = pool.read(0, torch.tensor([8, 9]))
    child, _ = pool.read(0, torch.tensor([20, 21]))
    assert torch.equal(parent, k[4:]) and torch.equal(child, k[4:])
    assert set(pool.open) == {2, 5}


def test_a_sequences_first_token_reads_back_exact_until_its_block_is_reused():
    """The attention sink: position 0's key and value kept exact beside their codes; a block taken by another
    sequence at a later position loses it; with more first tokens than entries the oldest fall back to codes."""
    pool = Int4KVPool(CFG, 8, BS, torch.float32, open_blocks=2)
    k, v = keys_values(8, seed=7)
    write(pool, [12, 13, 14, 15, 4, 5, 6, 7], k, v, firsts=[12])  # positions 0-7 in blocks 3 and 1
    keys, values = pool.read(1, torch.tensor([12, 13]))
    assert torch.equal(keys[0], k[0]) and torch.allclose(values[0], v[0] @ pool.value_basis, atol=1e-6)
    assert not torch.equal(keys[1], k[1])  # the rest of the block: codes
    write(pool, [12, 13], k[:2], v[:2])  # block 3 reused by another sequence, from its position 16
    assert 3 not in pool.sinks and pool.free_sinks
    _, values = pool.read(1, torch.tensor([12]))  # (its keys are open again: exact in the side pool)
    assert not torch.allclose(values[0], v[0] @ pool.value_basis, atol=1e-3)
    for block in (0, 2, 5):  # three first tokens, two entries: block 0's is dropped
        write(pool, [block * BS], k[:1], v[:1], firsts=[block * BS])
    assert list(pool.sinks) == [2, 5] and int(pool.sink_of[0]) == -1
    pool.copy_blocks([(5, 6)])  # a fork of a one-token sequence: its copy keeps the exact first token
    keys, _ = pool.read(0, torch.tensor([24]))
    assert torch.equal(keys[0], k[0]) and set(pool.sinks) == {5, 6}


def test_the_budget_buys_about_2_7_times_the_bfloat16_tokens():
    per_block = Int4KVPool.bytes_per_block(CFG, 16)
    assert per_block == 2 * 2 * (16 * 32 + 4 * 64 + 16 * (32 + 16))  # layers x heads x (keys + values)
    assert KVPool.bytes_per_block(CFG, 16, torch.bfloat16) / per_block == pytest.approx(256 / 96)
    pool = Int4KVPool.from_budget(CFG, 2**22, 16, torch.bfloat16, open_blocks=8)
    assert pool.nbytes <= 2**22 < pool.nbytes + per_block
    assert pool.nbytes == pool.num_blocks * per_block + Int4KVPool.side_bytes(CFG, 16, torch.bfloat16, 8)
    assert Int4KVPool.side_bytes(CFG, 16, torch.bfloat16, 8) == 8 * (16 + 2) * 2 * 2 * 64 * 2  # keys; sinks' k, v


def test_a_float16_pool_reads_back_what_it_was_given():
    """The C++ passes take float32 and bfloat16 pools; a float16 model's pool runs the tensor-op path."""
    pool = Int4KVPool(CFG, 8, BS, torch.float16)
    k, v = keys_values(6, seed=8)
    write(pool, list(range(6)), k.half(), v.half(), firsts=[0])
    keys, values = pool.read(1, torch.arange(6))
    assert keys.dtype == values.dtype == torch.float16
    assert torch.equal(keys[0], k[0].half()) and torch.equal(keys[4:], k[4:].half())  # first token, open block
    assert (keys[1:4].float() - naive_keys(k[:4].half().float())[1:]).abs().max() < 0.05


def test_a_head_size_the_value_groups_do_not_divide_is_refused():
    from dataclasses import replace

    with pytest.raises(LeanLMError, match="head_dim 24 is not a multiple"):
        Int4KVPool(replace(CFG, head_dim=24), 8, BS, torch.float32)


def test_attention_through_the_int4_pool_is_close_to_full_precision():
    """A paged step (a prompt chunk, then decodes) over the int4 pool against the same over a float32 pool."""
    pools = KVPool(CFG, 8, BS, torch.float32), Int4KVPool(CFG, 8, BS, torch.float32)
    table, g = [3, 1, 6, 2], torch.Generator().manual_seed(5)
    outs = []
    for pool in pools:
        g.manual_seed(5)
        steps = [(0, 9)] + [(9 + i, 1) for i in range(3)]
        res = []
        for start, n in steps:
            q = torch.randn(1, n, 4, 64, generator=g)
            k, v = keys_values(n, seed=start)
            step = PagedStep(pool, [table], [start], [n])
            res.append(step.attend(0, q, k[None], v[None], None, True))
        outs.append(torch.cat(res, 1))
    assert outs[1].shape == outs[0].shape
    assert 0 < (outs[1] - outs[0]).abs().max() < 0.25
