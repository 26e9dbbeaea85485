import pytest

from serving import Server


@pytest.fixture(scope="module")
def server(tiny):
    """One server per test module: a tiny model, 4-token blocks, its prompt compression on the same model."""
    from leanlm.prompt.compressor import PromptCompressor

    s = Server(*tiny, block_size=4, kv_cache_memory=1 << 24, prompt_scorer=PromptCompressor(model=tiny))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def process_server(tmp_path_factory):
    """The same tiny model (same seed) served with its engine in a process of its own (EngineProcess)."""
    from leanlm.engine.process import EngineProcess
    from tests.conftest import make_hf_model, make_tokenizer

    path = tmp_path_factory.mktemp("tiny-process")
    make_hf_model("llama", path, max_position_embeddings=512)
    make_tokenizer(path)
    s = Server(EngineProcess(path, dtype="float32", block_size=4, kv_cache_memory=1 << 24, quiet=True))
    yield s
    s.stop()


@pytest.fixture(params=["engine thread", "engine process"])
def either_server(request, server):
    """The module's server (AsyncLLM), then the same model behind EngineProcess."""
    return server if request.param == "engine thread" else request.getfixturevalue("process_server")
