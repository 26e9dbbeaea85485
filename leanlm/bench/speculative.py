"""Speculative decoding against plain decoding of the same target, on the same prompts, in one run."""

from __future__ import annotations

import time

from leanlm.eval.datasets import builtin_text
from leanlm.generation.decode import generate_ids
from leanlm.generation.sampling import SamplingParams
from leanlm.generation.speculative import DraftProposer, LookupProposer, SpecStats, speculative_generate
from leanlm.generation.text import encode_prompt, eos_ids
from leanlm.models.transformer import Transformer
from leanlm.tokenizer import Tokenizer

CODE_PROMPTS = [
    "Write a Python function `is_prime(n)` that returns True when n is a prime number. Include a docstring.",
    "Write a Python function that merges two sorted lists into one sorted list, with type hints.",
    "Write a Python class `Stack` with push, pop, peek and is_empty methods.",
    "Write a Python function that counts how often each word occurs in a text and returns a dict.",
]


def grounded_prompts(n: int = 4, chars: int = 600) -> list[str]:
    """Edit / continue / quote tasks over passages of the built-in evaluation text: answers copy the input."""
    text = builtin_text("evaluation")
    passages = [text[i * 20000 : i * 20000 + chars].strip() for i in range(1, n + 1)]
    tasks = ["Repeat the following passage exactly, then stop:\n\n{}",
             "Rewrite the following passage, replacing every 'thou' with 'you' and changing nothing else:\n\n{}",
             "Copy out the following lines and continue them:\n\n{}",
             "Quote the first lines of this passage word for word:\n\n{}"]
    return [tasks[i % len(tasks)].format(p) for i, p in enumerate(passages)]


def compare(target: Transformer, tokenizer: Tokenizer, prompts: list[str], params: SamplingParams, new_proposer,
            k: int, chat: bool = True) -> dict:
    """Time plain and speculative decoding of each prompt (eager, batch 1); `new_proposer(max_len)` per prompt."""
    eos = eos_ids(target, tokenizer)
    stats = SpecStats(k)
    plain_time = spec_time = 0.0
    plain_tokens = spec_tokens = identical = 0
    for prompt in prompts:
        ids = encode_prompt(tokenizer, prompt, chat)
        start = time.perf_counter()
        plain = [step[0] for step in generate_ids(target, [ids], params, eos)]
        plain_time += time.perf_counter() - start
        proposer = new_proposer(len(ids) + params.max_tokens)
        start = time.perf_counter()
        spec = [t for step in speculative_generate(target, ids, params, proposer, k, eos, stats) for t in step]
        spec_time += time.perf_counter() - start
        identical += spec == plain  # greedy: equal up to 16-bit rounding (verifying K+1 rows sums in another order)
        plain_tokens += len(plain)
        spec_tokens += len(spec)
    return {**stats.to_dict(), "plain_tokens_per_s": plain_tokens / plain_time, "spec_tokens_per_s": spec_tokens / spec_time,
            "measured_speedup": (spec_tokens / spec_time) / (plain_tokens / plain_time), "prompts": len(prompts),
            "identical_outputs": identical}


def speculation(target: Transformer, tokenizer: Tokenizer, params: SamplingParams, k: int,
                draft: Transformer | None = None, ngram: int = 3, prompts: list | None = None) -> dict:
    """compare() where each proposer can pay unless `prompts` (texts or chats) are given: a draft model on code
    prompts, or prompt lookup (n-grams up to `ngram`) on input-grounded prompts."""
    if draft is not None:
        return compare(target, tokenizer, prompts or CODE_PROMPTS, params,
                       lambda max_len: DraftProposer(draft, max_len + k + 1, params), k)
    return compare(target, tokenizer, prompts or grounded_prompts(), params, lambda max_len: LookupProposer(ngram=ngram), k)
