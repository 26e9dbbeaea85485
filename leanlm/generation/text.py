"""Text in, text out: prompts (plain or chat) -> completions, streamed or batched, with stop strings."""

from __future__ import annotations

from collections.abc import Iterator

from leanlm.cache.static import StaticCache
from leanlm.generation.decode import Completion, generate_ids
from leanlm.generation.sampling import SamplingParams
from leanlm.generation.speculative import speculative_generate
from leanlm.models.transformer import Transformer
from leanlm.tokenizer import Tokenizer


def encode_prompt(tokenizer: Tokenizer, prompt: str | list[dict], chat: bool) -> list[int]:
    """Token ids of a plain prompt, or of a chat (a string becomes one user message) rendered by the template."""
    if chat:
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        return tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False)
    return tokenizer.encode(prompt)


def eos_ids(model: Transformer, tokenizer: Tokenizer) -> set[int]:
    ids = set(model.config.eos_token_ids)
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


class Detokenizer:
    """One sequence's generated text, decoded incrementally; emits only text that can no longer become a stop string.

    Each token decodes a short window of ids, as vLLM's incremental detokenizer does: `ids[prefix:read]` were
    decoded already, `ids[read:]` are new; the new text is decode(ids[prefix:]) minus decode(ids[prefix:read]), so
    a tokenizer that decodes a window's first token differently (SentencePiece/ByteLevel spaces) cancels out. The
    offsets move on only once the new text is a whole character (no trailing U+FFFD), so they always sit at
    character boundaries and `text` is exactly tokenizer.decode(ids) at every step.
    """

    def __init__(self, prompt_ids: list[int], stops: tuple[str, ...], eos: set[int]):
        self.prompt_ids, self.ids, self.stops, self.eos = prompt_ids, [], stops, eos
        self.text, self.emitted, self.finish_reason = "", 0, None
        self.prefix = self.read = 0  # ids[prefix:read] give the text just before text[done:]
        self.done = 0  # text[:done] is final: its ids are before `read`

    def add(self, token: int, tokenizer: Tokenizer) -> str:
        if token in self.eos:  # kept in the token ids, never in the text
            self.ids.append(token)
            self.finish_reason = "stop"
            return self.flush(len(self.text))
        self.ids.append(token)
        before = tokenizer.decode(self.ids[self.prefix : self.read])
        window = tokenizer.decode(self.ids[self.prefix :])
        new = window[len(before) :]
        self.text = self.text[: self.done] + new
        if len(window) > len(before) and not window.endswith("\ufffd"):
            self.prefix, self.read, self.done = self.read, len(self.ids), len(self.text)
        for stop in self.stops:
            at = self.text.find(stop, max(0, self.emitted - len(stop)))
            if at >= 0:
                self.text, self.finish_reason = self.text[:at], "stop"
                return self.flush(at)
        # an incomplete UTF-8 character waits for its next token (text[:done] never ends in one)
        safe = len(self.text) - len(new) + len(new.rstrip("\ufffd"))
        for stop in self.stops:
            for n in range(min(len(stop) - 1, safe), 0, -1):
                if self.text.endswith(stop[:n], 0, safe):
                    safe -= n
                    break
        return self.flush(safe)

    def flush(self, upto: int) -> str:
        delta = self.text[self.emitted : max(upto, self.emitted)]
        self.emitted = max(upto, self.emitted)
        return delta


def stream_rows(model: Transformer, tokenizer: Tokenizer, prompts: list, params: SamplingParams,
                chat: bool = False, compiled=None, cache_cls: type = StaticCache) -> Iterator[tuple[int, str] | list[Completion]]:
    """Yield (row, new text) as it is generated, then the list of finished Completions."""
    prompt_ids = [encode_prompt(tokenizer, p, chat) for p in prompts]
    eos = set() if params.ignore_eos else eos_ids(model, tokenizer)
    rows = [Detokenizer(ids, params.stop, eos) for ids in prompt_ids]
    for step in generate_ids(model, prompt_ids, params, eos, compiled, cache_cls):
        for i, (row, token) in enumerate(zip(rows, step)):
            if row.finish_reason is None:
                delta = row.add(token, tokenizer)
                if delta:
                    yield i, delta
        if all(r.finish_reason for r in rows):
            break
    for i, row in enumerate(rows):
        if row.finish_reason is None:
            row.finish_reason = "length"
            if delta := row.flush(len(row.text)):
                yield i, delta
    yield [Completion(r.prompt_ids, r.ids, r.text, r.finish_reason) for r in rows]


def generate(model: Transformer, tokenizer: Tokenizer, prompts: str | list, params: SamplingParams,
             chat: bool = False, compiled=None, cache_cls: type = StaticCache) -> list[Completion]:
    """Complete a batch of prompts (of any lengths) together."""
    prompts = [prompts] if isinstance(prompts, str) else prompts
    *_, completions = stream_rows(model, tokenizer, prompts, params, chat, compiled, cache_cls)
    return completions


def stream(model: Transformer, tokenizer: Tokenizer, prompt, params: SamplingParams, chat: bool = False,
           compiled=None, cache_cls: type = StaticCache) -> Iterator[str]:
    """Text pieces of one prompt's completion as they are generated."""
    for item in stream_rows(model, tokenizer, [prompt], params, chat, compiled, cache_cls):
        if isinstance(item, tuple):
            yield item[1]


def stream_speculative(model: Transformer, tokenizer: Tokenizer, prompt, params: SamplingParams, proposer, k: int,
                       chat: bool = False, stats=None) -> Iterator[str]:
    """Text pieces of one prompt's completion, decoded speculatively (generation.speculative)."""
    ids = encode_prompt(tokenizer, prompt, chat)
    eos = set() if params.ignore_eos else eos_ids(model, tokenizer)
    row = Detokenizer(ids, params.stop, eos)
    for tokens in speculative_generate(model, ids, params, proposer, k, eos, stats):
        for token in tokens:
            if row.finish_reason is None and (delta := row.add(token, tokenizer)):
                yield delta
        if row.finish_reason:
            return
    if delta := row.flush(len(row.text)):
        yield delta
