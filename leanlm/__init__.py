"""leanlm: make transformer language models cheap to run, and show what it costs."""

from leanlm.api import load
from leanlm.errors import LeanLMError
from leanlm.eval.perplexity import agreement, perplexity
from leanlm.generation.sampling import SamplingParams
from leanlm.generation.text import generate, stream

__all__ = ["load", "generate", "stream", "perplexity", "agreement", "SamplingParams", "LeanLMError"]
