import asyncio
import os
import random
import time

import pytest
import torch

from leanlm.cache.paged import KVPool
from leanlm.engine import LLM, Engine, EngineConfig
from leanlm.engine.config import engine_config
from leanlm.errors import LeanLMError
from leanlm.generation.decode import generate_ids
from leanlm.generation.sampling import SamplingParams
from leanlm.generation.text import generate
from leanlm.models.loading import load_model
from leanlm.tokenizer import Tokenizer
from tests.conftest import make_hf_model, make_tokenizer

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Token-id prompts of mixed lengths (3 to 70), several sharing a 40-token prefix."""
    rng = random.Random(seed)
    common = [rng.randrange(3, 120) for _ in range(40)]
    out = []
    for i in range(n):
        tail = [rng.randrange(3, 120) for _ in range(rng.randrange(3, 31))]
        out.append(common + tail if i % 3 == 0 else tail + common[: rng.randrange(0, 40)])
    return out


def blocks_for(model, n: int, block_size: int = 4) -> int:
    return n * KVPool.bytes_per_block(model.config, block_size, model.dtype)


def one_by_one(model, ps, params=GREEDY):
    """Each prompt alone through the static-cache generation loop."""
    return [[step[0] for step in generate_ids(model, [p], params)] for p in ps]


@pytest.mark.parametrize("options,preempts", [
    (dict(kv_cache_memory=1 << 26), False),  # everything fits: pure continuous batching
    (dict(block_size=4, max_num_batched_tokens=16), False),  # prompts split into chunks of a 16-token budget
    (dict(block_size=4, max_prefill_tokens=8), False),  # beside decodes, prompts get 8 tokens a step
    (dict(block_size=4, blocks=48), True),  # so few blocks that sequences are preempted and computed again
    (dict(block_size=4, blocks=48, prefix_caching=False), True),
])
def test_concurrent_and_staggered_requests_equal_one_by_one(tiny, options, preempts):
    model, tok = tiny
    options = dict(options)
    if "blocks" in options:
        options["kv_cache_memory"] = blocks_for(model, options.pop("blocks"))
    engine = Engine(model, tok, EngineConfig(**options))
    ps = prompts(18)
    expected = one_by_one(model, ps)
    seqs = [engine.add_request(str(i), p, GREEDY)[0] for i, p in enumerate(ps[:10])]
    later = iter(enumerate(ps[10:], start=10))
    steps = 0
    while engine.has_work:
        engine.step()
        steps += 1
        if steps % 3 == 0 and (nxt := next(later, None)):  # the rest arrive while the first ones run
            seqs.append(engine.add_request(str(nxt[0]), nxt[1], GREEDY)[0])
    assert [s.output_ids for s in seqs] == expected
    assert engine.blocks.num_free == engine.blocks.num_blocks  # every block free (or held only by the cache)
    assert (engine.scheduler.num_preemptions > 0) == preempts


def test_prompt_chunks_beside_decodes_keep_to_max_prefill_tokens(tiny):
    model, tok = tiny
    engine = Engine(model, tok, EngineConfig(block_size=4, kv_cache_memory=1 << 24, max_prefill_tokens=8))
    schedule, fed = engine.scheduler.schedule, []

    def recorded():
        batch = schedule()
        fed.append((sum(n == 1 and s.remaining == 1 for s, n in batch), sum(n for s, n in batch if s.remaining > 1)))
        return batch

    engine.scheduler.schedule = recorded
    ps = prompts(6)
    engine.add_request("first", ps[0], GREEDY)
    for step in range(40):
        if step in (2, 5, 9):  # prompts arrive while the first decodes
            engine.add_request(str(step), ps[step % 5 + 1], GREEDY)
        if engine.has_work:
            engine.step()
    assert fed[0][1] == len(ps[0])  # alone: the whole prompt in one step
    beside = [prefill for decodes, prefill in fed if decodes]
    assert max(beside) == 8 and all(p <= 8 for p in beside)


def test_prefix_cache_skips_the_shared_prompt(tiny):
    model, tok = tiny
    engine = Engine(model, tok, EngineConfig(block_size=4, kv_cache_memory=1 << 24))
    first = prompts(1)[0]
    (a,) = engine.add_request("a", first, GREEDY)
    while engine.has_work:
        engine.step()
    (b,) = engine.add_request("b", first[:40] + [7, 8, 9], GREEDY)
    engine.step()
    assert b.num_cached == 40
    assert engine.blocks.hits == 40


def test_n_completions_share_the_prompt_blocks(tiny):
    model, tok = tiny
    engine = Engine(model, tok, EngineConfig(block_size=4, kv_cache_memory=1 << 24, prefix_caching=False))
    params = SamplingParams(temperature=1.0, max_tokens=6, n=3, seed=5, ignore_eos=True)
    seqs = engine.add_request("r", list(range(3, 33)), params)  # 30 tokens: 7 full blocks and a partial one
    engine.step()
    assert all(s.block_table[:7] == seqs[0].block_table[:7] for s in seqs)
    assert len({s.block_table[7] for s in seqs}) == 3
    assert engine.blocks.ref[seqs[0].block_table[0]] == 3
    while engine.has_work:
        engine.step()
    assert len({tuple(s.output_ids) for s in seqs}) > 1  # each completion samples on its own
    assert engine.blocks.num_free == engine.blocks.num_blocks


def test_abort_anywhere_frees_everything(tiny):
    model, tok = tiny
    engine = Engine(model, tok, EngineConfig(block_size=4, kv_cache_memory=blocks_for(model, 60),
                                             max_num_batched_tokens=24))
    rng = random.Random(1)
    live = []
    for step in range(60):
        if rng.random() < 0.5:
            live.append(engine.add_request(f"r{step}", prompts(1, seed=step)[0], GREEDY)[0].request_id)
        if live and rng.random() < 0.3:
            engine.abort(live.pop(rng.randrange(len(live))))
        engine.step()
    for rid in live:
        engine.abort(rid)
    assert not engine.has_work
    assert engine.blocks.num_free == engine.blocks.num_blocks


@pytest.mark.parametrize("prompt,params,message", [
    ([], GREEDY, "empty prompt"),
    ([5] * 600, GREEDY, "context window"),
    ([3, 4, 999], GREEDY, "token id 999"),
    ("hello", dict(max_tokens=0), "max_tokens"),
    ("hello", dict(top_p=2.0), "top_p"),
    ("hello", dict(temperature=-1), "temperature"),
])
def test_bad_requests_are_refused_and_others_go_on(tiny, prompt, params, message):
    model, tok = tiny
    engine = Engine(model, tok, EngineConfig(kv_cache_memory=1 << 24))
    (good,) = engine.add_request("good", [5, 6, 7], GREEDY)
    with pytest.raises(LeanLMError, match=message):
        engine.add_request("bad", prompt, params if isinstance(params, SamplingParams) else SamplingParams(**params))
    while engine.has_work:
        engine.step()
    assert len(good.output_ids) == GREEDY.max_tokens


def test_llm_generate_text_stop_and_logprobs(tiny):
    model, tok = tiny
    llm = LLM(model, tok, kv_cache_memory=1 << 24)
    texts = ["the quick brown fox", "hello world", "def f(x):"]
    params = SamplingParams(temperature=0, max_tokens=10, logprobs=2)
    outs = llm.generate(texts, params, progress=False)
    ref = generate(model, tok, texts, SamplingParams(temperature=0, max_tokens=10))
    for out, r in zip(outs, ref):
        assert out.outputs[0].token_ids == r.tokens and out.outputs[0].text == r.text
        lp = out.outputs[0].logprobs
        assert len(lp) == len(r.tokens) and all(x.logprob <= 0 and len(x.top) == 2 for x in lp)
    stop = ref[0].text[4:7]
    (out,) = llm.generate(texts[:1], SamplingParams(temperature=0, max_tokens=10, stop=stop), progress=False)
    assert out.outputs[0].text == ref[0].text[: ref[0].text.index(stop)] and out.outputs[0].finish_reason == "stop"
    with pytest.raises(LeanLMError):  # one bad prompt: nothing queued
        llm.generate(["fine", []], params, progress=False)
    assert not llm.engine.has_work


def test_async_streams_equal_one_by_one_and_abort_frees_blocks(tiny):
    from leanlm.engine import AsyncLLM

    model, tok = tiny
    llm = AsyncLLM(model, tok, block_size=4, kv_cache_memory=1 << 24)
    ps = prompts(8, seed=3)
    expected = one_by_one(model, ps)

    async def collect(p):
        ids = []
        async for delta in llm.stream(p, GREEDY):
            ids += delta.token_ids
        return ids

    async def abandon(p):  # a consumer that walks away after two tokens
        seen = 0
        async for _ in llm.stream(p, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)):
            seen += 1
            if seen == 2:
                break

    async def main():
        return await asyncio.gather(*(collect(p) for p in ps), abandon(ps[0]), abandon(ps[1]))

    try:
        results = asyncio.run(main())
        assert results[: len(ps)] == expected
        for _ in range(100):  # the aborts reach the engine thread between steps
            if not llm.engine.has_work:
                break
            time.sleep(0.01)
        assert llm.engine.blocks.num_free == llm.engine.blocks.num_blocks and not llm.engine.requests
        with pytest.raises(LeanLMError, match="empty prompt"):
            asyncio.run(collect([]))
    finally:
        llm.shutdown()


def test_compiled_decode_steps_equal_one_by_one(tiny, monkeypatch):
    """Decode-only steps run as compiled graphs whose batch size is symbolic: every step runs exactly its sequences'
    rows (no padding), one graph for a single sequence and one for each range of batch sizes."""
    model, tok = tiny
    engine = Engine(model, tok, EngineConfig(block_size=4, kv_cache_memory=1 << 24, compile=True))
    compiled = engine.runner.compiled
    assert compiled is not None
    compiler, steps = compiled.compiler, []

    def record(key, inputs, batch=None):
        steps.append((len(inputs["tokens"]), key[0]))
        return compiler(key, inputs, batch)

    monkeypatch.setattr(compiled, "compiler", record)
    assert_greedy_lengths_equal_one_by_one(engine, model, prompts(5, seed=4), (3, 9, 9, 12, 12))
    assert {n for n, _ in steps} == {5, 4, 2}  # 5 sequences, 4 once the first finished, then 2
    assert all(lo <= n <= hi for n, (lo, hi) in steps)
    assert {key[0] for key in compiler._plans} == {compiled.ranges[1]}  # one graph ran them all
    assert all(plan is not None for plan in compiler._plans.values())  # run without Dynamo, the sizes passed in


def test_a_graph_compiled_for_one_batch_range_is_not_taken_from_the_cache_for_another(tiny):
    """Inductor's caches key a graph by its code, not by the bounds of its symbolic batch size: a graph cached for
    2-8 rows would be a hit for 2-256 whose recorded bounds contradict the new range (a ConstraintViolationError),
    as when a kernel's measured row limit changes. The range is part of the key, so each range compiles its own."""
    from leanlm.engine.compiled import _paged_step, _scratch_batch
    from leanlm.generation.compiled import StepCompiler

    model, tok = tiny
    engine = Engine(model, tok, EngineConfig(block_size=4, kv_cache_memory=1 << 22, compile=True))
    decoder = engine.runner.compiled
    inputs = decoder._inputs(*_scratch_batch(decoder.scratch, 3))
    narrow, wide = (StepCompiler(model, _paged_step)(("rows", r), inputs, batch=r) for r in ((2, 8), (2, 256)))
    torch.testing.assert_close(narrow, wide)


def test_row_ranges_cover_every_batch_once_and_split_where_a_module_changes_path(tiny):
    """The graphs' batch ranges: one sequence alone, then ranges that end at each module's row_splits() (inside the
    256 a graph runs), covering every size once; a real model's modules say where their paths change."""
    from torch import nn

    from leanlm.engine.compiled import MAX_SEQS, row_ranges

    class Splits(nn.Module):
        def __init__(self, *rows):
            super().__init__()
            self.rows = rows

        def row_splits(self):
            return self.rows

    for rows in [(64, 256, 64), (0, 8, 16), (1, 1, 1), (300, 0, 255), ()]:
        model = nn.Sequential(nn.ReLU(), *(Splits(n) for n in rows))
        ranges = row_ranges(model)
        assert ranges[0] == (1, 1) and ranges[-1][1] == MAX_SEQS
        assert all(a[1] + 1 == b[0] and b[0] <= b[1] for a, b in zip(ranges, ranges[1:]))
        assert {hi for _, hi in ranges[1:-1]} == {n for n in rows if 1 < n < MAX_SEQS}
        assert row_ranges(model, 5) == [r for r in ranges if r[0] <= 5]
    model, _ = tiny
    splits = {t for m in model.modules() if hasattr(m, "row_splits") for t in m.row_splits()}
    assert {hi for _, hi in row_ranges(model)[1:-1]} == {t for t in splits if 1 < t < MAX_SEQS}


def assert_greedy_lengths_equal_one_by_one(engine, model, ps, lengths) -> None:
    """Greedy requests of these lengths (ignore_eos), stepped together in `engine`, as each one alone."""
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    seqs = [engine.add_request(str(i), p, sp)[0] for i, (p, sp) in enumerate(zip(ps, params))]
    while engine.has_work:
        engine.step()
    assert [s.output_ids for s in seqs] == [one_by_one(model, [p], sp)[0] for p, sp in zip(ps, params)]


def test_deterministic_mode_is_batch_invariant_in_bfloat16(tiny):
    """bf16, deterministic: each request's tokens and logprobs are bit-identical alone, in a crowd of others, and
    with its prompt cut into chunks (without the mode, chunking changed the logprobs of all ten requests here)."""
    model, tok = tiny
    model = model.to(torch.bfloat16)
    try:
        ps = prompts(10, seed=7)
        params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=3)

        def run(group, **options):
            engine = Engine(model, tok, EngineConfig(block_size=4, kv_cache_memory=1 << 24, deterministic=True,
                                                     **options))
            seqs = [engine.add_request(str(i), p, params)[0] for i, p in enumerate(group)]
            while engine.has_work:
                engine.step()
            return [(s.output_ids, [(x.token, x.logprob, x.top) for x in s.logprobs]) for s in seqs]

        alone = [run([p])[0] for p in ps]
        assert run(ps) == alone
        assert run(ps, max_num_batched_tokens=7) == alone
    finally:
        model.float()


@pytest.mark.parametrize("config", ["w8a16", "w4a16", "w8a8"])
def test_quantized_models_run_in_the_engine(tmp_path, config):
    from leanlm.compress.quant.rtn import RTN
    from leanlm.compress.registry import apply

    make_hf_model("qwen2", tmp_path, max_position_embeddings=512)
    make_tokenizer(tmp_path)
    model, tok = load_model(tmp_path, torch.float32), Tokenizer(tmp_path)
    apply(model, {"w8a16": RTN(8), "w4a16": RTN(4, 32), "w8a8": RTN(8, act_bits=8)}[config])
    ps = prompts(6, seed=5)
    engine = Engine(model, tok, EngineConfig(block_size=4, kv_cache_memory=1 << 24, max_num_batched_tokens=32))
    seqs = [engine.add_request(str(i), p, GREEDY)[0] for i, p in enumerate(ps)]
    while engine.has_work:
        engine.step()
    assert [s.output_ids for s in seqs] == one_by_one(model, ps)


def repetitive(n: int, seed: int) -> list[list[int]]:
    """Prompts that repeat a phrase, so that prompt lookup finds continuations to propose."""
    rng = random.Random(seed)
    return [[rng.randrange(3, 120) for _ in range(rng.randrange(4, 9))] * rng.randrange(3, 6) for _ in range(n)]


def test_prompt_lookup_in_the_engine_equals_plain_greedy(tiny):
    model, tok = tiny
    ps = repetitive(8, seed=1)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    engine = Engine(model, tok, EngineConfig(block_size=4, kv_cache_memory=1 << 24, prompt_lookup=3,
                                             max_num_batched_tokens=40))
    seqs = [engine.add_request(str(i), p, params)[0] for i, p in enumerate(ps)]
    while engine.has_work:
        engine.step()
    assert [s.output_ids for s in seqs] == one_by_one(model, ps, params)
    assert engine.spec_accepted > 0 and engine.blocks.num_free == engine.blocks.num_blocks
    sampled = SamplingParams(temperature=0.8, max_tokens=16, ignore_eos=True, seed=3)
    (s,) = engine.add_request("s", ps[0], sampled)
    while engine.has_work:
        engine.step()
    assert len(s.output_ids) == 16 and all(0 <= t < 128 for t in s.output_ids)


def test_deterministic_mode_makes_speculation_invisible_in_bfloat16(tiny):
    model, tok = tiny
    model = model.to(torch.bfloat16)
    try:
        ps = repetitive(6, seed=2)
        params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
        outputs = []
        for lookup in (0, 3):
            engine = Engine(model, tok, EngineConfig(block_size=4, kv_cache_memory=1 << 24, deterministic=True,
                                                     prompt_lookup=lookup))
            seqs = [engine.add_request(str(i), p, params)[0] for i, p in enumerate(ps)]
            while engine.has_work:
                engine.step()
            outputs.append([s.output_ids for s in seqs])
        assert outputs[0] == outputs[1] and engine.spec_accepted > 0
    finally:
        model.float()


def test_stop_token_ids_and_min_tokens(tiny):
    model, tok = tiny
    prompt = prompts(1, seed=9)[0]
    first = one_by_one(model, [prompt])[0][0]
    engine = Engine(model, tok, EngineConfig(kv_cache_memory=1 << 24))
    (stopped,) = engine.add_request("a", prompt, SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[first]))
    (held,) = engine.add_request("b", prompt, SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[first],
                                                             min_tokens=3, repetition_penalty=1.3))
    while engine.has_work:
        engine.step()
    assert stopped.output_ids == [first] and stopped.finish_reason == "stop"
    assert first not in held.output_ids[:3] and len(held.output_ids) >= 3


def test_int8_kv_pool_equals_one_by_one_with_the_int8_static_cache(tiny):
    from leanlm.cache.int8 import Int8KVCache

    model, tok = tiny
    ps = prompts(8, seed=11)
    engine = Engine(model, tok, EngineConfig(block_size=4, kv_cache_memory=1 << 24, kv_cache="int8",
                                             max_num_batched_tokens=32))
    seqs = [engine.add_request(str(i), p, GREEDY)[0] for i, p in enumerate(ps)]
    while engine.has_work:
        engine.step()
    expected = [[s[0] for s in generate_ids(model, [p], GREEDY, cache_cls=Int8KVCache)] for p in ps]
    assert [s.output_ids for s in seqs] == expected


def test_int4_kv_pool_is_batch_invariant_and_close_to_the_full_precision_pool(tiny):
    """The int4 pool (cache.int4) quantizes each block by its own tokens, so a sequence's outputs do not depend on
    what shares its steps, how its prompt is chunked or which blocks the prefix cache hands it; its prompt
    log-probabilities stay near the float32 pool's."""
    model, tok = tiny
    ps = prompts(8, seed=12)
    config = EngineConfig(block_size=4, kv_cache_memory=1 << 24, kv_cache="int4", max_num_batched_tokens=32)
    engine = Engine(model, tok, config)
    seqs = [engine.add_request(str(i), p, GREEDY)[0] for i, p in enumerate(ps)]
    while engine.has_work:
        engine.step()
    alone = []
    for p in ps:
        single = Engine(model, tok, engine_config(config, prefix_caching=False, max_num_batched_tokens=256))
        alone.append(single.add_request("0", p, GREEDY)[0])
        while single.has_work:
            single.step()
    assert [s.output_ids for s in seqs] == [s.output_ids for s in alone]
    assert engine.blocks.num_free == engine.blocks.num_blocks and "int4" in engine.describe()

    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    logprobs = {}
    for kv in ("auto", "int4"):
        llm = LLM(model, tok, config=engine_config(config, kv_cache=kv), quiet=True)
        out = llm.generate([ps[0]], params)[0]
        logprobs[kv] = torch.tensor([t.logprob for t in out.prompt_logprobs[1:]])
    gap = (logprobs["int4"] - logprobs["auto"]).abs()
    assert 0 < gap.mean() < 0.05


def test_build_graphs_compiles_every_graph_up_to_max_num_seqs_before_any_request(tiny, monkeypatch):
    """A server's engine compiles each graph a step of up to max_num_seqs sequences runs before it answers (no
    request pays a compilation), and serving then compiles nothing."""
    from leanlm.engine.compiled import row_ranges

    model, tok = tiny
    engine = Engine(model, tok, EngineConfig(block_size=4, kv_cache_memory=1 << 24, compile=True, max_num_seqs=5))
    if engine.runner.compiled is None:
        pytest.skip("no paged-attention kernel here")
    logs = []
    engine.build_graphs(logs.append)
    ranges = row_ranges(model, 5)
    assert sorted(k[0] for k in engine.runner.compiled.compiler._plans) == ranges
    assert len(logs) == 2 and logs[0].startswith(f"compiling {len(ranges)} decode steps, for 1, 2-")
    assert logs[1].startswith(f"{len(ranges)} compiled decode steps ready in")
    if len(os.sched_getaffinity(0)) > 1:  # the last range compiled by a helper process, loaded here from the caches
        assert f"{ranges[-1][0]}-{ranges[-1][1]} in a helper process" in logs[0]
    monkeypatch.setattr(engine.runner.compiled.compiler, "_compile", lambda: pytest.fail("compiled on a request"))
    assert_greedy_lengths_equal_one_by_one(engine, model, prompts(5, seed=5), (2, 5, 5, 8, 8))
