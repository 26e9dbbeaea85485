"""The serving engine: paged KV cache, continuous batching with chunked prefill and preemption, the LLM facade."""

from leanlm.engine.config import EngineConfig
from leanlm.engine.engine import Engine
from leanlm.engine.llm import LLM, AsyncLLM
from leanlm.engine.sequence import CompletionOutput, Delta, RequestOutput

__all__ = ["Engine", "EngineConfig", "LLM", "AsyncLLM", "CompletionOutput", "Delta", "RequestOutput"]
