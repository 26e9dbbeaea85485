"""Sequence: one completion's tokens, blocks and text as the engine advances it; the outputs a request gets."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from leanlm.generation.sampling import SamplingParams
from leanlm.generation.text import Detokenizer


class Sequence:
    """Tokens [0, num_computed) have their keys and values in the pool; the rest are fed in the next steps (a
    prompt in chunks, then one sampled token per step). Preemption frees the blocks and sets num_computed to 0:
    the prompt and the output so far are computed again on readmission."""

    def __init__(self, request_id: str, index: int, prompt_ids: list[int], params: SamplingParams,
                 detokenizer: Detokenizer, arrival: float | None = None):
        self.request_id, self.index, self.params = request_id, index, params
        self.prompt_ids = prompt_ids
        self.token_ids = list(prompt_ids)
        self.num_computed = 0
        self.block_table: list[int] = []
        self.block_keys: list = []
        self.num_cached = 0
        self.detokenizer = detokenizer
        self.finish_reason: str | None = None
        self.logprobs: list = []
        self.generator = None
        if params.seed is not None:  # one stream of draws per completion; preemption does not replay it
            self.generator = torch.Generator().manual_seed(params.seed + index)
        self.arrival = time.perf_counter() if arrival is None else arrival
        self.first_token_time: float | None = None
        self.children: list[Sequence] = []  # the request's other n - 1 completions, forked after the prompt

    @property
    def num_prompt(self) -> int:
        return len(self.prompt_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt :]

    @property
    def remaining(self) -> int:
        """Tokens still to feed before the next token can be sampled (1 while decoding)."""
        return len(self.token_ids) - self.num_computed

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def banned(self, stop_ids: set[int]) -> set[int] | None:
        """Token ids it may not sample yet: end-of-sequence ids until min_tokens are out."""
        return stop_ids if len(self.output_ids) < self.params.min_tokens else None


@dataclass
class CompletionOutput:
    """One of a request's n completions, as far as it has got."""
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop", "length", "abort" or None while running
    logprobs: list | None = None  # per token: sampling.TokenLogprobs, when asked for


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: dict = field(default_factory=dict)


@dataclass
class Delta:
    """What one step added to one completion (the streaming interface's unit)."""
    request_id: str
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list | None = None
