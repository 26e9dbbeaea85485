"""The server's prompt compression: a request's prompt (or its chat's last user message) cut by prompt.compressor
before it reaches the engine, with the original and compressed sizes reported in `usage`."""

from __future__ import annotations

import asyncio

from leanlm.errors import LeanLMError
from leanlm.generation.text import encode_prompt
from leanlm.prompt.compressor import PromptCompressor


class PromptCompression:
    """One scorer (a model name, loaded on first use, or a PromptCompressor); one compression at a time, off the
    event loop."""

    def __init__(self, scorer):
        self.scorer, self.lock = scorer, asyncio.Lock()
        self.compressor = None if isinstance(scorer, str) else scorer

    async def compress(self, text: str, options) -> tuple[str, float]:
        async with self.lock:
            if self.compressor is None:
                self.compressor = await asyncio.to_thread(PromptCompressor, self.scorer, progress=False)
            result = await asyncio.to_thread(self.compressor.compress, text, **options.options())
        return result.text, result.seconds

    async def apply(self, options, prompts: list, chat: bool, tok) -> tuple[list, dict]:
        """The prompts compressed, and the usage fields: original_prompt_tokens (in the served model's tokens)
        and compression_seconds."""
        seconds, out = 0.0, []
        for prompt in prompts:
            if chat:
                users = [i for i, m in enumerate(prompt) if m["role"] == "user"]
                if not users:
                    raise LeanLMError("compress_prompt needs a user message to compress")
                text, s = await self.compress(prompt[users[-1]]["content"], options)
                out.append([*prompt[:users[-1]], {**prompt[users[-1]], "content": text}, *prompt[users[-1] + 1:]])
            elif isinstance(prompt, str):
                text, s = await self.compress(prompt, options)
                out.append(text)
            else:
                raise LeanLMError("compress_prompt needs text prompts, not token ids")
            seconds += s
        original = sum(len(encode_prompt(tok, p, chat)) for p in prompts)
        return out, {"original_prompt_tokens": original, "compression_seconds": round(seconds, 4)}
