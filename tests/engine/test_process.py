"""EngineProcess: the engine core in a spawned process behaves as AsyncLLM's engine on a thread does (same tokens,
aborts, failures), with bad input refused in the front end."""

import asyncio
import time

import pytest

from leanlm.engine import AsyncLLM
from leanlm.engine.llm import EngineStopped
from leanlm.engine.process import EngineProcess
from leanlm.errors import LeanLMError
from leanlm.generation.sampling import SamplingParams
from tests.conftest import make_hf_model, make_tokenizer
from tests.engine.test_engine import prompts

OPTIONS = {"dtype": "float32", "block_size": 4, "kv_cache_memory": 1 << 22, "quiet": True}


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    make_hf_model("llama", path, max_position_embeddings=512)
    make_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def core(tiny_path):
    llm = EngineProcess(tiny_path, **OPTIONS)
    yield llm
    llm.shutdown()


async def completions(llm, requests) -> list[list[tuple[int, list[int]]]]:
    """Every request streamed at once: each one's (completion index, token ids) deltas in order."""
    async def one(prompt, params):
        return [(d.index, d.token_ids) async for d in llm.stream(prompt, params)]
    return await asyncio.gather(*(one(p, sp) for p, sp in requests))


def settle(llm, timeout: float = 10.0):
    deadline = time.time() + timeout
    while time.time() < deadline and (llm.stats().running or llm.stats().waiting):
        time.sleep(0.02)
    return llm.stats()


def test_the_core_streams_what_an_engine_thread_does(core, tiny_path):
    sampled = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=9, seed=7, n=2, ignore_eos=True)
    requests = [(p, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)) for p in prompts(6)]
    requests += [(prompts(1, seed=3)[0], sampled), ("hello world, hello", sampled)]
    got = asyncio.run(completions(core, requests))
    thread = AsyncLLM(tiny_path, **OPTIONS)
    try:
        assert got == asyncio.run(completions(thread, requests))
    finally:
        thread.shutdown()
    assert all(len(c) > 1 for c in got)
    stats = settle(core)
    assert stats.running == 0 and stats.prefix_queries > 0 and core.error is None


def test_bad_requests_are_refused_in_the_front_end(core, tiny):
    async def add(prompt, params):
        return core.add_request(prompt, params)

    with pytest.raises(LeanLMError, match="context window"):
        asyncio.run(add([5] * 600, SamplingParams(max_tokens=1)))
    with pytest.raises(LeanLMError, match="is not an integer"):
        asyncio.run(add([5, 10_000], SamplingParams(max_tokens=1)))
    with pytest.raises(LeanLMError, match="by name or path"):
        EngineProcess(tiny[0], **OPTIONS)  # a model object: only AsyncLLM takes one
    assert core.error is None and core.prefill_seconds(8) > 0


def test_an_abandoned_stream_is_aborted_in_the_core(core):
    async def two_then_leave():
        stream = core.stream([7, 8, 9], SamplingParams(temperature=0, max_tokens=400, ignore_eos=True))
        got = [await anext(stream), await anext(stream)]
        await stream.aclose()  # the consumer leaves: the request is aborted
        return got

    assert len(asyncio.run(two_then_leave())) == 2
    stats = settle(core)
    assert stats.running == 0 and stats.waiting == 0


def test_a_core_that_dies_fails_every_stream(tiny_path):
    llm = EngineProcess(tiny_path, **OPTIONS)

    async def killed_midway():
        stream = llm.stream([7, 8, 9], SamplingParams(temperature=0, max_tokens=400, ignore_eos=True))
        await anext(stream)
        llm._process.kill()
        async for _ in stream:
            pass

    try:
        with pytest.raises(EngineStopped, match="exited"):
            asyncio.run(killed_midway())
        assert llm.error is not None
        with pytest.raises(EngineStopped):
            asyncio.run(completions(llm, [([1, 2, 3], SamplingParams(max_tokens=2))]))
    finally:
        llm.shutdown()
