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

    def __init__(self, request_id: str, index: int, prompt_ids: list[int], params: SamplingParams, max_tokens: int,
                 stop_ids: set[int], detokenizer: Detokenizer, arrival: float | None = None):
        """max_tokens: params.max_tokens clipped to the context window; stop_ids: token ids that end it."""
        self.request_id, self.index, self.params = request_id, index, params
        self.max_tokens, self.stop_ids = max_tokens, stop_ids
        self.prompt_ids = prompt_ids
        self.token_ids = list(prompt_ids)
        self.num_computed = 0
        self.block_table: list[int] = []
        self.block_keys: list = []
        self.num_cached = 0
        self.detokenizer = detokenizer
        self.finish_reason: str | None = None
        self.logprobs: list = []
        self.prompt_logprobs: list = [None]  # per prompt token when asked for: none for the first
        self.generator = None
        if params.seed is not None:  # one stream of draws per completion; preemption does not replay it
            self.generator = torch.Generator().manual_seed(params.seed + index)
        self.arrival = time.perf_counter() if arrival is None else arrival
        self.first_token_time: float | None = None
        self.children: list[Sequence] = []  # the request's other n - 1 completions, forked after the prompt
        self.proposal: list[int] = []  # speculative tokens fed after the last one this step (prompt lookup)
        self.matcher = None  # generation.grammar.Matcher of a structured output
        self.draft_computed = 0  # tokens whose keys and values the draft model holds (draft speculation)
        self.draft_probs: torch.Tensor | None = None  # the draft's distributions of a sampled proposal [k, V]

    @property
    def num_prompt(self) -> int:
        return len(self.prompt_ids)

    @property
    def max_len(self) -> int:
        """Tokens it holds if it runs to max_tokens."""
        return self.num_prompt + self.max_tokens

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt :]

    @property
    def remaining(self) -> int:
        """Tokens still to feed before the next token can be sampled (1 while decoding)."""
        return len(self.token_ids) - self.num_computed

    def fed(self, n: int) -> list[int]:
        """The next n tokens to feed: the rest of the prompt, or the last token and the proposal."""
        begin = self.num_computed
        if self.proposal and begin + n > len(self.token_ids):
            return self.token_ids[begin:] + self.proposal[: begin + n - len(self.token_ids)]
        return self.token_ids[begin : begin + n]

    def rows(self, n: int) -> int:
        """How many of the n fed tokens give logits to sample from: 0 mid-prompt, else 1 + the proposal."""
        return 1 + len(self.proposal) if self.num_computed + n == len(self.token_ids) + len(self.proposal) else 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def prompt_logprob_rows(self, n: int) -> int:
        """How many of the next n fed tokens give a prompt token's log-probability still missing (0 when not asked
        for, and when computed again after preemption)."""
        if self.params.prompt_logprobs is None or len(self.prompt_logprobs) != self.num_computed + 1:
            return 0
        return max(0, min(n, self.num_prompt - 1 - self.num_computed))

    def banned(self) -> set[int] | None:
        """Token ids it may not sample yet: the stop ids until min_tokens are out."""
        return self.stop_ids if len(self.output_ids) < self.params.min_tokens else None


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
    prompt_logprobs: list | None = None  # None, then sampling.TokenLogprobs per prompt token, when asked for


@dataclass
class Delta:
    """What one step added to one completion (the streaming interface's unit)."""
    request_id: str
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list | None = None
    prompt_logprobs: list | None = None  # on a completion's first delta, when asked for
