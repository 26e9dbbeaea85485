"""The OpenAI request bodies the server accepts (with vLLM's extra sampling fields), and its error body."""

from __future__ import annotations

from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from leanlm.errors import LeanLMError
from leanlm.generation.sampling import SamplingParams


class StreamOptions(BaseModel):
    include_usage: bool = False


class CompressPrompt(BaseModel):
    """Opt-in prompt compression (compress.prompt) of the prompt, or of a chat's last user message."""

    model_config = ConfigDict(extra="forbid")
    rate: float | None = Field(default=None, gt=0, le=1)
    target_tokens: int | None = Field(default=None, gt=0)
    question: str = ""
    method: Literal["llmlingua", "longllmlingua", "selective", "random"] = "llmlingua"
    force: list[str] = []
    keep_numbers: bool = True
    keep_identifiers: bool = False

    def options(self) -> dict:
        """PromptCompressor.compress's keyword arguments (rate 0.5 unless a rate or target is given)."""
        return {**self.model_dump(), "force": tuple(self.force), "rate": self.rate or 0.5}


class LeanLMOptions(BaseModel):
    """leanlm's own request fields, under "leanlm" (the openai client sends them with extra_body)."""

    model_config = ConfigDict(extra="forbid")
    compress_prompt: CompressPrompt | None = None


class _Sampling(BaseModel):
    """Fields both endpoints share. Unknown fields are ignored, as OpenAI's own server does (clients send `user`)."""

    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # vLLM's extra sampling fields, so that tools written for vLLM work unchanged
    top_k: int = -1
    min_p: float = 0.0
    min_tokens: int = 0
    ignore_eos: bool = False
    repetition_penalty: float = 1.0
    stop_token_ids: list[int] | None = None
    leanlm: LeanLMOptions | None = None

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """The engine's SamplingParams; LeanLMError (a 400) for what it cannot honour."""
        if self.presence_penalty or self.frequency_penalty:
            raise LeanLMError("presence_penalty and frequency_penalty are not supported; use repetition_penalty")
        if self.top_k < -1:
            raise LeanLMError(f"top_k must be -1 (off) or >= 0, got {self.top_k}")
        stop = [self.stop] if isinstance(self.stop, str) else self.stop or []
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=max(self.top_k, 0),
                              max_tokens=max_tokens if max_tokens is not None else 16, stop=tuple(stop),
                              seed=self.seed, ignore_eos=self.ignore_eos, min_p=self.min_p,
                              repetition_penalty=self.repetition_penalty, min_tokens=self.min_tokens,
                              stop_token_ids=tuple(self.stop_token_ids or ()), n=self.n, logprobs=logprobs)


class CompletionRequest(_Sampling):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False

    def prompts(self) -> list:
        """The prompts of a batch request: text or token ids each."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict] | None = None

    def as_template_input(self) -> dict:
        """{"role", "content"} with list content (text parts) joined: the chat template wants a string."""
        content = self.content
        if isinstance(content, list):
            if any(part.get("type") != "text" for part in content):
                raise LeanLMError("only text content parts are supported in chat messages")
            content = "".join(part.get("text", "") for part in content)
        return {"role": self.role, "content": content or ""}


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)


def error_body(message: str, kind: str = "invalid_request_error", code: int = 400, param: str | None = None) -> dict:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
