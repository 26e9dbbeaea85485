"""The server under test: build_app on a real uvicorn on 127.0.0.1 in a thread, and what its tests share."""

import threading
import time

import pytest

from leanlm.bench.serve import free_port
from leanlm.engine import AsyncLLM
from leanlm.engine.llm import EngineFront
from leanlm.generation.decode import generate_ids
from leanlm.generation.sampling import SamplingParams

openai = pytest.importorskip("openai")
KEY, NAME = "sekrit", "tiny"


class Server:
    """build_app on a real uvicorn in a thread; stopped (drained) at the end."""

    def __init__(self, model, tok=None, **options):
        """model, tok: an AsyncLLM is made of them; or model: an engine front end made already (EngineProcess)."""
        import uvicorn

        from leanlm.serve.app import build_app

        max_requests = options.pop("max_requests", 512)
        scorer = options.pop("prompt_scorer", "smollm2-135m")
        self.llm = model if isinstance(model, EngineFront) else AsyncLLM(model, tok, quiet=True, **options)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.app = app = build_app(self.llm, NAME, api_key=KEY, max_requests=max_requests, prompt_scorer=scorer)
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            assert time.time() < deadline, "server did not start"
            time.sleep(0.05)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(30)
        self.llm.shutdown()

    def settled(self, timeout: float = 10) -> bool:
        """Every block free (or held only by the prefix cache) and no request left in the engine."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.idle():
                return True
            time.sleep(0.05)
        return False

    def idle(self) -> bool:
        if isinstance(self.llm, AsyncLLM):  # the engine itself, on its thread
            e = self.llm.engine
            return not e.has_work and not e.requests and e.blocks.num_free == e.blocks.num_blocks
        s = self.llm.stats()  # as the engine's process last reported
        return s.running == s.waiting == 0 and s.kv_usage == 0


def client(server) -> "openai.OpenAI":
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


def greedy(model, tok, text: str, n: int) -> list[int]:
    return [s[0] for s in generate_ids(model, [tok.encode(text)], SamplingParams(temperature=0, max_tokens=n,
                                                                                 ignore_eos=True))]
