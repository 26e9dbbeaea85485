"""The OpenAI request bodies the server accepts (with vLLM's extra sampling fields), and its error body."""

from __future__ import annotations

import json
from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from leanlm.errors import LeanLMError
from leanlm.generation.grammar import GrammarSpec
from leanlm.generation.sampling import SamplingParams


class StreamOptions(BaseModel):
    include_usage: bool = False


class CompressPrompt(BaseModel):
    """Opt-in prompt compression (prompt.compressor) of the prompt, or of a chat's last user message."""

    model_config = ConfigDict(extra="forbid")
    rate: float | None = Field(default=None, gt=0, le=1)
    target_tokens: int | None = Field(default=None, gt=0)
    question: str = ""
    method: Literal["llmlingua", "longllmlingua", "classifier", "selective", "random"] | None = None
    force: list[str] = []
    keep_numbers: bool = True
    keep_identifiers: bool = False
    auto: bool = False  # only where it pays: the prompt at least as long as the measured break-even

    def options(self) -> dict:
        """PromptCompressor.compress's keyword arguments (rate 0.5 unless a rate or target is given; the method
        llmlingua, or with auto the classifier, the one that pays from the shortest prompts)."""
        return {**self.model_dump(exclude={"auto"}), "force": tuple(self.force), "rate": self.rate or 0.5,
                "method": self.method or ("classifier" if self.auto else "llmlingua")}


class LeanLMOptions(BaseModel):
    """leanlm's own request fields, under "leanlm" (the openai client sends them with extra_body)."""

    model_config = ConfigDict(extra="forbid")
    compress_prompt: CompressPrompt | None = None


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str = "response"
    description: str | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's response_format: text, any JSON object, or JSON following a schema (always strict here: the
    grammar admits nothing else)."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def spec(self) -> GrammarSpec | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return GrammarSpec("json_object")
        if self.json_schema is None or self.json_schema.schema_ is None:
            raise LeanLMError("response_format json_schema needs json_schema.schema")
        return GrammarSpec("json_schema", json.dumps(self.json_schema.schema_))


class StructuredOutputs(BaseModel):
    """vLLM's structured_outputs: one of a JSON schema, any JSON object, a regex, a choice or a grammar."""

    model_config = ConfigDict(extra="forbid")
    json_: str | dict | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def spec(self) -> GrammarSpec | None:
        return GrammarSpec.one_of(self.json_, self.json_object, self.regex, self.choice, self.grammar)


class _Sampling(BaseModel):
    """Fields both endpoints share. A field the server does not know is a 400 that names it (never silently
    dropped); `user` is accepted and unused, as it is only an end-user tag for abuse monitoring."""

    model_config = ConfigDict(extra="forbid")

    model: str
    max_tokens: int | None = None  # None: to the end of the context window, as OpenAI and vLLM do
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's extra sampling fields, so that tools written for vLLM work unchanged
    top_k: int = -1
    min_p: float = 0.0
    min_tokens: int = 0
    ignore_eos: bool = False
    repetition_penalty: float = 1.0
    stop_token_ids: list[int] | None = None
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs and its older guided_* fields
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: str | dict | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    leanlm: LeanLMOptions | None = None

    def grammar(self) -> GrammarSpec | None:
        """The one structured-output constraint the request asks for, if any (two are a 400)."""
        guided = StructuredOutputs(json=self.guided_json, regex=self.guided_regex, choice=self.guided_choice,
                                   grammar=self.guided_grammar)
        specs = [x.spec() for x in (self.response_format, self.structured_outputs, guided) if x is not None]
        specs = [x for x in specs if x is not None]
        if len(specs) > 1:
            raise LeanLMError("give one structured-output constraint (response_format, structured_outputs or a "
                              "guided_* field), not several")
        return specs[0] if specs else None

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        prompt_logprobs: int | None = None) -> SamplingParams:
        """The engine's SamplingParams; LeanLMError (a 400) for what it cannot honour."""
        if self.top_k < -1:
            raise LeanLMError(f"top_k must be -1 (off) or >= 0, got {self.top_k}")
        if self.stream_options is not None and not self.stream:
            raise LeanLMError("stream_options applies to a streamed response: send it with stream: true")
        if max_tokens is not None and max_tokens < 1:
            raise LeanLMError(f"max_tokens must be >= 1 (or left out: to the end of the context), got {max_tokens}")
        stop = [self.stop] if isinstance(self.stop, str) else self.stop or []
        bias = self.logit_bias or {}
        if any(not key.isdigit() for key in bias):
            raise LeanLMError("logit_bias keys must be token ids (strings of digits)")
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=max(self.top_k, 0),
                              max_tokens=max_tokens, stop=tuple(stop), seed=self.seed, ignore_eos=self.ignore_eos,
                              min_p=self.min_p, repetition_penalty=self.repetition_penalty, min_tokens=self.min_tokens,
                              stop_token_ids=tuple(self.stop_token_ids or ()), n=self.n, logprobs=logprobs,
                              presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                              logit_bias={int(k): v for k, v in bias.items()}, prompt_logprobs=prompt_logprobs,
                              grammar=self.grammar())


class CompletionRequest(_Sampling):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    prompt_logprobs: int | None = Field(default=None, ge=0, le=20)  # vLLM's
    best_of: int | None = None
    suffix: str | None = None

    def prompts(self) -> list:
        """The prompts of a batch request: text or token ids each; LeanLMError for none or an empty one."""
        p = self.prompt
        prompts = [p] if isinstance(p, str) or (p and isinstance(p[0], int)) else list(p)
        if not prompts or any(len(x) == 0 for x in prompts):
            raise LeanLMError("prompt must be a non-empty string, a list of token ids, or a non-empty list of those")
        return prompts

    def params(self) -> SamplingParams:
        if self.best_of not in (None, 1, self.n):
            raise LeanLMError("best_of other than n is not supported: ask for n completions and rank them yourself")
        if self.suffix:
            raise LeanLMError("suffix (fill-in-the-middle) is not supported")
        # echo with logprobs: the prompt's tokens come back with theirs, as the legacy completions API does
        prompt_logprobs = self.prompt_logprobs
        if self.echo and self.logprobs is not None:
            prompt_logprobs = max(prompt_logprobs or 0, self.logprobs)
        return self.sampling_params(self.max_tokens, self.logprobs, prompt_logprobs)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict] | None = None
    name: str | None = None
    tool_calls: list[dict] | None = None
    tool_call_id: str | None = None

    def as_template_input(self) -> dict:
        """{"role", "content"} with list content (text parts) joined: the chat template wants a string; the tool
        fields as they came."""
        content = self.content
        if isinstance(content, list):
            if any(part.get("type") != "text" for part in content):
                raise LeanLMError("only text content parts are supported in chat messages")
            content = "".join(part.get("text", "") for part in content)
        extra = self.model_dump(include={"name", "tool_calls", "tool_call_id"}, exclude_none=True)
        return {"role": self.role, "content": content or "", **extra}


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[dict] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict | None = None  # default: auto with tools, else none
    parallel_tool_calls: bool = True

    def params(self) -> SamplingParams:
        if self.top_logprobs and not self.logprobs:
            raise LeanLMError("top_logprobs needs logprobs: true (the alternatives come with each token's logprob)")
        return self.sampling_params(self.max_completion_tokens or self.max_tokens,
                                    self.top_logprobs or 0 if self.logprobs else None)


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a prompt, or chat messages rendered by the template."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[int]


def error_body(message: str, kind: str = "invalid_request_error", code: int = 400, param: str | None = None) -> dict:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
