"""Intake: a request's prompt tokenized and checked into its Sequences, on any thread and in either process: the
engine keeps one, and a front end with the engine in another process (engine.process) keeps one made from the
engine's Limits, so that bad input is refused before anything crosses to the engine."""

from __future__ import annotations

import threading
from dataclasses import dataclass

from leanlm.cache.paged import cdiv
from leanlm.engine.sequence import Sequence
from leanlm.errors import LeanLMError
from leanlm.generation.decode import check_fits
from leanlm.generation.grammar import GrammarCompiler
from leanlm.generation.sampling import SamplingParams
from leanlm.generation.text import Detokenizer, encode_prompt
from leanlm.tokenizer import Tokenizer


@dataclass(frozen=True)
class Limits:
    """What a request is checked against: the model's vocabulary, context window and end-of-text ids, and the KV
    cache's blocks."""
    vocab_size: int
    max_position: int
    eos: frozenset[int]
    block_size: int
    num_blocks: int

    @property
    def capacity(self) -> int:
        """Tokens the KV cache holds."""
        return self.num_blocks * self.block_size


class Intake:
    def __init__(self, tokenizer: Tokenizer, limits: Limits):
        self.tokenizer, self.limits = tokenizer, limits
        self._grammars, self._grammar_lock = None, threading.Lock()

    def make(self, request_id: str, prompt: str | list[int] | list[dict], params: SamplingParams,
             chat: bool = False) -> list[Sequence]:
        """Tokenize and check a request (any thread; raises LeanLMError on bad input, changing nothing). The prompt:
        text (in the chat template with chat=True), token ids, or chat messages ([{"role", "content"}, ...])."""
        limits = self.limits
        chat = chat or (isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], dict))
        if isinstance(prompt, str) or chat:
            ids = encode_prompt(self.tokenizer, prompt, chat)
        else:
            ids = list(prompt)
            for t in ids:
                if not isinstance(t, int) or not 0 <= t < limits.vocab_size:
                    raise LeanLMError(f"prompt token id {t!r} is not an integer in [0, {limits.vocab_size})")
        max_tokens = check_fits(limits.max_position, len(ids), params.max_tokens)
        if params.max_tokens is None:  # to the end of the context, as far as the KV cache holds one sequence
            max_tokens = max(1, min(max_tokens, limits.capacity - len(ids)))
        need = cdiv(len(ids) + max_tokens, limits.block_size)
        if need > limits.num_blocks:
            raise LeanLMError(f"a request of {len(ids)} prompt + {max_tokens} new tokens needs {need} KV blocks; the "
                              f"KV cache holds {limits.num_blocks}: give it more memory or ask for fewer tokens")
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else limits.eos)
        seqs = [Sequence(request_id, i, ids, params, max_tokens, stop_ids, Detokenizer(ids, params.stop, stop_ids))
                for i in range(params.n)]
        if params.grammar is not None:
            matcher = self.grammars().matcher(params.grammar, params.stop_token_ids)
            for seq in seqs:
                seq.matcher = matcher.fork()
        seqs[0].children = seqs[1:]
        return seqs

    def grammars(self) -> GrammarCompiler:
        """The structured-output compiler (generation.grammar), made on first use: reading the vocabulary takes
        0.2-1.3 s. Any thread (make runs off the server's event loop)."""
        with self._grammar_lock:
            if self._grammars is None:
                self._grammars = GrammarCompiler(self.tokenizer, self.limits.vocab_size, self.limits.eos)
            return self._grammars
