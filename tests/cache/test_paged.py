import random
import sys
from dataclasses import dataclass, field

import pytest
import torch

from leanlm.cache import paged
from leanlm.cache.paged import BlockManager, KVPool, block_key
from leanlm.cache.paged_attention import PagedStep
from leanlm.cache.static import StaticCache
from leanlm.models.loading import load_model
from tests.conftest import make_hf_model


@dataclass
class Seq:
    token_ids: list
    block_table: list = field(default_factory=list)
    block_keys: list = field(default_factory=list)
    num_cached: int = 0
    max_len: int = 0


def test_prefix_reuse_and_lru_eviction():
    bm = BlockManager(num_blocks=6, block_size=4)
    a = Seq(list(range(10)))  # blocks: [0..3] [4..7] [8, 9]
    assert bm.allocate(a) and a.block_table == [] and a.num_cached == 0  # blocks come chunk by chunk
    assert bm.grow(a, 10) and len(a.block_table) == 3
    bm.commit(a, 10)
    b = Seq(list(range(8)) + [50, 51, 52])  # shares two full blocks
    assert bm.allocate(b) and b.num_cached == 8 and b.block_table == a.block_table[:2]
    assert bm.grow(b, 11) and len(b.block_table) == 3
    assert [bm.ref[x] for x in a.block_table] == [2, 2, 1]
    bm.release(a)
    bm.release(b)
    assert bm.num_free == 6 and all(r == 0 for r in bm.ref)
    c = Seq(list(range(8)) + [7])  # found again after both were freed
    assert bm.allocate(c) and c.num_cached == 8 and bm.grow(c, 9)
    # a prompt that is exactly its cached blocks still computes its last block: the last token's logits are needed
    d = Seq(list(range(8)))
    assert bm.allocate(d) and d.num_cached == 4


def test_eviction_forgets_overwritten_blocks():
    bm = BlockManager(num_blocks=2, block_size=2)
    a = Seq([1, 2, 3, 4])
    assert bm.allocate(a) and bm.grow(a, 4)
    bm.commit(a, 4)
    bm.release(a)
    b = Seq([9, 9, 9, 9])  # takes both blocks back: the old keys must go
    assert bm.allocate(b) and bm.grow(b, 4) and not bm.cached
    bm.release(b)
    c = Seq([1, 2, 3, 4, 5])
    assert not bm.allocate(c)  # needs 3 blocks; nothing taken
    assert bm.num_free == 2 and c.block_table == []


def test_prefixes_colliding_under_python_hash_share_no_block(monkeypatch):
    """hash(2**61 - 1) == hash(0), so under the old key (hash(parent key), tokens) two prompts that differ only in
    their first token gave their second blocks one key, and a third prompt was served the other one's KV."""
    m = sys.hash_info.modulus
    assert hash(m) == hash(0)
    first_a, first_b, second = [0, 1, 2, 3], [m, 1, 2, 3], [5, 6, 7, 8]
    assert block_key(block_key(None, first_a), second) != block_key(block_key(None, first_b), second)

    def serve():  # a and b computed and registered, then c (b's prompt again) admitted
        bm = BlockManager(num_blocks=8, block_size=4)
        a, b, c = Seq(first_a + second + [9]), Seq(first_b + second + [9]), Seq(first_b + second + [9])
        for s in (a, b):
            assert bm.allocate(s) and bm.grow(s, 9)
            bm.commit(s, 9)
        assert bm.allocate(c) and c.num_cached == 8
        return a, b, c

    a, b, c = serve()
    assert c.block_table == b.block_table[:2]
    monkeypatch.setattr(paged, "block_key", lambda parent, tokens: (hash(parent), tuple(tokens)))
    a, b, c = serve()
    assert c.block_table == [b.block_table[0], a.block_table[1]]  # the old scheme: a's block after b's prefix


def test_fork_shares_full_blocks_and_copies_the_partial_one():
    bm = BlockManager(num_blocks=8, block_size=4)
    parent, child = Seq(list(range(10))), Seq(list(range(10)))
    assert bm.allocate(parent) and bm.grow(parent, 10)
    copies = bm.fork(parent, child)
    assert child.block_table[:2] == parent.block_table[:2] and child.block_table[2] != parent.block_table[2]
    assert copies == [(parent.block_table[2], child.block_table[2])]
    assert bm.ref[parent.block_table[0]] == 2


def test_random_workload_leaks_no_block():
    """Random arrivals, growth, forks and releases (finish, abort, preemption are all a release): at the end every
    block is free and the prefix cache only names free blocks whose keys match."""
    rng = random.Random(0)
    bm = BlockManager(num_blocks=40, block_size=4)
    live = []
    for _ in range(2000):
        op = rng.random()
        if op < 0.35:
            prefix = rng.choice([[], [1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4]])
            s = Seq(prefix + [rng.randrange(100) for _ in range(rng.randrange(1, 20))])
            s.max_len = len(s.token_ids) + rng.randrange(40)  # spans: from none to more than the pool
            if bm.allocate(s, reserve=rng.randrange(3)) and bm.grow(s, len(s.token_ids)):
                live.append(s)
            else:
                bm.release(s)  # admitted but no room for its tokens after all
        elif op < 0.7 and live:
            s = rng.choice(live)
            s.token_ids.append(rng.randrange(100))
            if bm.grow(s, len(s.token_ids)):
                bm.commit(s, len(s.token_ids) - 1)
            else:  # preempted: everything it held goes back
                bm.release(s)
                live.remove(s)
        elif op < 0.8 and live:
            parent = rng.choice(live)
            child = Seq(list(parent.token_ids), max_len=parent.max_len)
            if bm.fork(parent, child) is not None:
                live.append(child)
        elif live:
            s = live.pop(rng.randrange(len(live)))
            bm.release(s)
        held = sum(len(s.block_table) for s in live)
        assert sum(bm.ref) == held
        assert bm.num_free == sum(r == 0 for r in bm.ref)
    for s in live:
        bm.release(s)
    assert bm.num_free == bm.num_blocks and not any(bm.ref)
    assert all(bm.key_of[b] == k for k, b in bm.cached.items())


def runs(table: list[int]) -> int:
    """Runs of adjacent blocks in a block table."""
    return 1 + sum(b != a + 1 for a, b in zip(table, table[1:]))


def test_sequences_decoding_together_keep_their_blocks_in_a_row():
    """Prompts admitted together and decoding in step (the engine's order of growth, which scattered the later
    blocks when each took the least recently freed one) each get one run of blocks, and so do the next ones."""
    bm = BlockManager(num_blocks=100, block_size=4)
    for wave in range(3):
        seqs = [Seq([wave, i] + [7] * 10, max_len=12 + 8) for i in range(4)]  # 3 blocks of prompt, 5 in the end
        for s in seqs:
            assert bm.allocate(s) and bm.grow(s, 12)
        for _ in range(8):
            for s in seqs:
                s.token_ids.append(1)
                assert bm.grow(s, len(s.token_ids))
        assert [runs(s.block_table) for s in seqs] == [1, 1, 1, 1] and all(len(s.block_table) == 5 for s in seqs)
        for s in seqs:
            bm.release(s)


def test_a_gap_in_a_holders_span_is_left_to_it():
    """A sequence admitted later places its blocks past the span its predecessor may still grow into, even where
    the free blocks before it come first in the cursor's path or the least-recently-freed order."""
    bm = BlockManager(num_blocks=30, block_size=4)
    a, b = Seq([1] * 4, max_len=40), Seq([2] * 4, max_len=40)  # spans of 10 blocks
    assert bm.allocate(a) and bm.grow(a, 4) and bm.allocate(b) and bm.grow(b, 4)
    assert b.block_table[0] >= a.block_table[0] + 10
    bm.cursor = 0  # a later run looked for from the pool's start still passes over a's span
    c = Seq([3] * 4, max_len=8)
    assert bm.allocate(c) and bm.grow(c, 4) and c.block_table[0] not in range(a.block_table[0], a.block_table[0] + 10)
    assert bm.grow(a, 40) and runs(a.block_table) == 1


def test_spans_larger_than_the_pool_share_it():
    """When every free block lies in some holder's span, a new sequence takes the second half of the longest gap,
    and every block is still handed out: placement never refuses a free block."""
    bm = BlockManager(num_blocks=12, block_size=4)
    a = Seq([1] * 4, max_len=400)
    assert bm.allocate(a) and bm.grow(a, 4)
    b = Seq([2] * 4, max_len=400)
    assert bm.allocate(b) and bm.grow(b, 4) and b.block_table == [a.block_table[0] + 6]
    assert bm.grow(a, 24) and bm.grow(b, 24) and bm.num_free == 0
    assert sorted(a.block_table + b.block_table) == list(range(12))


def test_prefix_hits_outlive_blocks_nobody_asked_for_again():
    """A freed block that a prefix hit found is taken only after every other free block (the least-recently-freed
    order alone would take it first, freed first); a block found by no one goes back like any other."""
    bm = BlockManager(num_blocks=8, block_size=4)
    system = [9] * 4
    a = Seq(system + [1], max_len=5)
    assert bm.allocate(a) and bm.grow(a, 5)
    bm.commit(a, 5)
    b = Seq(system + [2], max_len=5)
    assert bm.allocate(b) and b.num_cached == 4 and bm.grow(b, 5)
    hot = a.block_table[0]
    rest = Seq([4] * 20, max_len=20)  # the other five blocks, freed after the hit
    assert bm.allocate(rest) and bm.grow(rest, 20) and bm.num_free == 0
    for s in (a, b, rest):
        bm.release(s)
    fill = Seq([5] * 28, max_len=28)  # seven blocks: every free one but the hit
    assert bm.allocate(fill, reuse=False) and bm.grow(fill, 28) and hot not in fill.block_table
    assert bm.cached[block_key(None, system)] == hot
    more = Seq([6] * 4, max_len=4)
    assert bm.allocate(more) and bm.grow(more, 4) and more.block_table == [hot] and not bm.cached


def test_pool_size_follows_the_budget(tmp_path):
    make_hf_model("llama", tmp_path)
    cfg = load_model(tmp_path, torch.float32).config
    per_block = 2 * cfg.num_layers * 16 * cfg.num_kv_heads * cfg.head_dim * 4
    assert KVPool.bytes_per_block(cfg, 16, torch.float32) == per_block
    pool = KVPool.from_budget(cfg, 10 * per_block + 5, 16, torch.float32)
    assert pool.num_blocks == 10 and pool.nbytes == 10 * per_block
    assert KVPool.from_budget(cfg, 10 * per_block, 16, torch.bfloat16, int8=True).num_blocks > 30


@pytest.mark.parametrize("dtype, int8, block_size", [(torch.float32, False, 4), (torch.float32, True, 4),
                                                     (torch.bfloat16, False, 16), (torch.bfloat16, True, 16)],
                         ids=["float32", "int8", "bf16", "int8-bf16"])
def test_paged_logits_equal_static_cache_logits(tmp_path, dtype, int8, block_size):
    """Three sequences in one packed step (two decodes, one prefill chunk continuing a cached prefix) against
    each sequence run alone through the static cache, with scattered, non-contiguous blocks. Pools of 16-token
    blocks keep their keys by block (bf16, and int8 on AVX-512 VNNI)."""
    make_hf_model("qwen2", tmp_path)
    model = load_model(tmp_path, dtype)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 128, (n,), generator=g).tolist() for n in (9, 21, 30)]
    pool = KVPool(model.config, 24, block_size, dtype, int8=int8)
    assert pool.k[0].dim() == (5 if paged.keys_by_block(dtype, "cpu", block_size, int8) else 3)
    tables = [[5, 1, 9], [2, 7, 3, 11, 0, 8], [4, 6, 10, 12, 13, 14, 15, 16]]

    def run(seqs):  # (table, first new position, new tokens)
        step = PagedStep(pool, [t for t, _, _ in seqs], [b for _, b, _ in seqs], [len(x) for _, _, x in seqs])
        tokens = torch.tensor([sum((x for _, _, x in seqs), [])])
        positions = torch.tensor([sum((list(range(b, b + len(x))) for _, b, x in seqs), [])])
        return model(tokens, positions, step)[0]

    # prefill: all but the last token of prompts 0 and 1; prompt 2 only up to 17
    run([(tables[0], 0, prompts[0][:-1]), (tables[1], 0, prompts[1][:-1]), (tables[2], 0, prompts[2][:17])])
    logits = run([(tables[0], 8, prompts[0][-1:]), (tables[1], 20, prompts[1][-1:]), (tables[2], 17, prompts[2][17:])])
    expected = []
    for p in prompts:
        cache_cls = StaticCache
        if int8:
            from leanlm.cache.int8 import Int8KVCache as cache_cls
        cache = cache_cls(model.config, 1, 32, dtype)
        expected.append(model(torch.tensor([p]), torch.arange(len(p))[None], cache)[0])
    ours = [logits[0:1], logits[1:2], logits[2:]]
    theirs = [expected[0][-1:], expected[1][-1:], expected[2][17:]]
    for a, b in zip(ours, theirs):  # bf16: the two paths round attention's products differently
        assert (a.float() - b.float()).abs().max() < (1e-4 if dtype == torch.float32 else 0.1 * b.float().abs().max())


@pytest.mark.parametrize("int8", [False, True], ids=["bf16", "int8"])
def test_keys_by_block_round_trip_and_copy(monkeypatch, int8):
    """put/take by slot on keys by block, and copy_blocks (a fork's partial block) copying whole blocks of them; an
    int8 pool's codes by block and scales by slot."""
    from leanlm.cache.int8 import dequantize_per_token, quantize_per_token
    from leanlm.models.config import ModelConfig

    if paged.kernels.ops() is None:
        pytest.skip("no CPU kernels")
    monkeypatch.setattr(paged, "keys_by_block", lambda *_: True)  # whatever this CPU's dot products
    cfg = ModelConfig("llama", 8, 128, 8, 2, 4, 2, 32, 256)
    pool = KVPool(cfg, 6, 16, torch.bfloat16, int8=int8)
    assert pool.k[1].shape == (6, 2, 16, 16, 2) and pool.v[1].shape == (96, 2, 32)
    k, v = torch.randn(96, 2, 32).bfloat16(), torch.randn(96, 2, 32).bfloat16()
    slots = torch.randperm(96)
    pool.write(1, slots, k[slots], v[slots])
    codes = k
    if int8:  # what the pool holds
        (codes, ks), (vq, vs) = quantize_per_token(k), quantize_per_token(v)
        k, v = dequantize_per_token(codes, ks, torch.bfloat16), dequantize_per_token(vq, vs, torch.bfloat16)
    assert torch.equal(paged.take(pool.k[1], torch.arange(96)), codes) and torch.equal(pool.read(1, slots)[0], k[slots])
    assert torch.equal(paged.take(pool.k[1], slots.view(8, 12)), codes[slots].view(8, 12, 2, 32))
    pool.copy_blocks([(4, 1)])
    assert torch.equal(pool.read(1, torch.arange(16, 32))[0], k[64:80])
    assert torch.equal(pool.read(1, torch.arange(16, 32))[1], v[64:80])
    keys = torch.zeros(2, 1, 2, 16, 2, dtype=torch.bfloat16)
    paged.put(keys, torch.tensor([17]), torch.tensor([[[1.0, 2.0, 3.0, 4.0]]]).bfloat16())
    assert keys[1, 0, :, 1].tolist() == [[1.0, 2.0], [3.0, 4.0]] and keys.count_nonzero() == 4
    with pytest.raises(RuntimeError, match="slot 32 is not in the pool"):
        paged.put(keys, torch.tensor([32]), torch.ones(1, 1, 4).bfloat16())
