"""Prompts to time a served model with, as users would send them: passages of the built-in text, or the user's own
prompts (random token ids, `leanlm bench serve`'s default, give speculation nothing to find).

`passage_prompts` cuts passages of a split of the built-in corpus at random line starts. For a model with a chat
template half of them go as chat requests asking for a summary, a rewrite, an answer or a continuation (tasks where
the answer may or may not copy from the prompt); the other half as plain text to continue. `read_prompts` reads a
user's JSONL (their traffic): one {"prompt": "..."} or {"messages": [...]} a line."""

from __future__ import annotations

import random

from leanlm.eval.corpus import read_items
from leanlm.eval.datasets import builtin_text
from leanlm.errors import LeanLMError

INSTRUCTIONS = ("Summarize this passage in a few sentences.", "Rewrite this passage in plain modern English.",
                "Who speaks in this passage, and what do they want?", "Continue this passage.")

Prompt = str | list[dict]  # text to complete, or chat messages


def passage_prompts(tokenizer, n: int, prompt_tokens: int, split: str = "evaluation", seed: int = 0) -> list[Prompt]:
    """`n` prompts of about `prompt_tokens` tokens (the passage; a chat adds its instruction and template) from the
    built-in `split`, each starting at a line; alternately chat requests (when the tokenizer has a chat template)
    and plain text."""
    text = builtin_text(split)
    starts = [i + 1 for i, c in enumerate(text) if c == "\n" and i + 1 < len(text) and text[i + 1] != "\n"]
    rng = random.Random(seed)
    prompts = []
    for k in range(n):
        start = rng.choice(starts[: len(starts) * 9 // 10])  # leave room for a whole passage
        ids = tokenizer.encode(text[start: start + 8 * prompt_tokens], add_special_tokens=False)[:prompt_tokens]
        passage = tokenizer.decode(ids)
        if tokenizer.chat_template and k % 2 == 0:
            instruction = INSTRUCTIONS[k // 2 % len(INSTRUCTIONS)]
            prompts.append([{"role": "user", "content": f"{instruction}\n\n{passage}"}])
        else:
            prompts.append(passage)
    return prompts


def read_prompts(path) -> list[Prompt]:
    """A JSONL file of prompts: {"prompt": "..."} or {"messages": [...]} a line."""
    if not str(path).lower().endswith(".jsonl"):
        raise LeanLMError(f"{path}: give prompts as JSONL, one {{\"prompt\": ...}} or {{\"messages\": [...]}} a line")
    return read_items(path)


def describe(path) -> str:
    """What a report says the timing prompts were."""
    if path:
        return f"the prompts of {path}"
    return ("passages of the built-in evaluation text, half as chat requests (summarize, rewrite, answer, continue), "
            "half as text to continue")
