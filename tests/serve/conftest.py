import pytest

from serving import Server


@pytest.fixture(scope="module")
def server(tiny):
    """One server per test module: a tiny model, 4-token blocks, its prompt compression on the same model."""
    from leanlm.prompt.compressor import PromptCompressor

    s = Server(*tiny, block_size=4, kv_cache_memory=1 << 24, prompt_scorer=PromptCompressor(model=tiny))
    yield s
    s.stop()
