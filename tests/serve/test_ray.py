"""Two engine replicas of a tiny model behind one endpoint on a local Ray instance (loopback only)."""

import asyncio

import pytest
import torch

from leanlm.generation.decode import generate_ids
from leanlm.generation.sampling import SamplingParams
from leanlm.models.loading import load_model
from leanlm.tokenizer import Tokenizer
from leanlm.bench.serve import free_port

ray = pytest.importorskip("ray")
openai = pytest.importorskip("openai")


def test_two_replicas_serve_one_endpoint(tiny_dir):
    from ray import serve

    from leanlm.engine import EngineConfig
    from leanlm.serve.ray import APP_NAME, serve_replicas, shutdown

    port = free_port()
    serve_replicas(str(tiny_dir), "tiny", 2, port=port, config=EngineConfig(kv_cache_memory="16MiB"), blocking=False,
                   max_n=2, dtype="float32", quiet=True)
    try:
        status = serve.status().applications[APP_NAME].deployments["LeanLMReplica"]
        assert status.replica_states == {"RUNNING": 2}
        model, tok = load_model(tiny_dir, torch.float32), Tokenizer(tiny_dir)
        prompts = [f"hello world {i}" for i in range(8)]
        expected = [tok.decode([s[0] for s in generate_ids(model, [tok.encode(p)], SamplingParams(
            temperature=0, max_tokens=6, ignore_eos=True))]) for p in prompts]

        async def main():
            async with openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0) as c:
                return await asyncio.gather(*(c.completions.create(model="tiny", prompt=p, max_tokens=6, temperature=0,
                                                                   extra_body={"ignore_eos": True}) for p in prompts))

        assert [r.choices[0].text for r in asyncio.run(main())] == expected
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="max-n"):  # the replicas' bounds are the server's
            c.completions.create(model="tiny", prompt="hi", max_tokens=2, n=3)
    finally:
        shutdown()
