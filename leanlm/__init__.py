"""leanlm: make transformer language models cheap to run, and show what it costs."""

from leanlm.models.loading import load
from leanlm.prompt.compressor import PromptCompressor, compress_prompt
from leanlm.distillation.run import distill
from leanlm.engine import LLM, AsyncLLM
from leanlm.errors import LeanLMError
from leanlm.eval.perplexity import agreement, perplexity
from leanlm.generation.sampling import SamplingParams
from leanlm.generation.text import generate, stream
from leanlm.pipeline import prune, quantize

__all__ = ["load", "LLM", "AsyncLLM", "generate", "stream", "perplexity", "agreement", "SamplingParams", "LeanLMError",
           "compress_prompt", "PromptCompressor", "quantize", "prune", "distill"]
