"""Postprocess: what a step's chosen tokens do to their sequence: appended one by one, their text detokenized (the
delta a stream gets), until one finishes it: a stop string or stop token (the detokenizer watches both), the end
of its grammar, or max_tokens."""

from __future__ import annotations

from typing import NamedTuple

from leanlm.engine.sequence import Delta, Sequence
from leanlm.tokenizer import Tokenizer


class Sampled(NamedTuple):
    """What sampling chose for one sequence this step."""
    seq: Sequence
    tokens: list[int]  # one, or the accepted part of a proposal and the token after it
    logprobs: list | None  # sampling.TokenLogprobs per token, when asked for
    verified: bool  # it fed a proposal this step


def append(seq: Sequence, tokens: list[int], logprobs: list | None, tokenizer: Tokenizer, now: float) -> Delta:
    """Add tokens (several after an accepted proposal) until one finishes seq; what this step added to it."""
    first = seq.first_token_time is None
    seq.first_token_time = seq.first_token_time or now
    text, added = "", []
    for token in tokens:
        seq.token_ids.append(token)
        added.append(token)
        text += seq.detokenizer.add(token, tokenizer)
        seq.finish_reason = seq.detokenizer.finish_reason
        if seq.matcher is not None and seq.finish_reason is None:
            seq.matcher.accept(token)  # allowed: the mask saw to it
            if seq.matcher.done:  # only an end of sequence could follow
                seq.finish_reason = "stop"
                text += seq.detokenizer.flush(len(seq.detokenizer.text))
        if seq.finish_reason is None and len(seq.output_ids) >= seq.max_tokens:
            seq.finish_reason = "length"
            text += seq.detokenizer.flush(len(seq.detokenizer.text))
        if seq.finished:
            break
    if logprobs is not None:
        seq.logprobs += logprobs
    prompt_logprobs = seq.prompt_logprobs if first and seq.params.prompt_logprobs is not None else None
    return Delta(seq.request_id, seq.index, text, added, seq.finish_reason, logprobs, prompt_logprobs)
