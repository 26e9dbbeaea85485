"""The server's prompt compression: a request's prompt (or its chat's last user message) cut by prompt.compressor
before it reaches the engine, with the original and compressed sizes reported in `usage`.

With "auto": true a prompt is compressed only where that pays for itself: when the prefill time its compression
saves the served model exceeds the time compressing takes. Both are measured on this machine the first time a
method is asked for (`BreakEven`: the served model's prefill at two lengths, the compressor at two lengths), and
each prompt is held against the length from which compressing at its rate pays."""

from __future__ import annotations

import asyncio
import math
import random
import time
from dataclasses import dataclass

from leanlm.errors import LeanLMError
from leanlm.generation.text import encode_prompt
from leanlm.prompt.compressor import PromptCompressor

PROBE_TOKENS = 1024  # both sides are timed at this many tokens and at a quarter of it (or the model's limit)


@dataclass(frozen=True)
class BreakEven:
    """Measured costs, n in the served model's tokens: its prefill takes a n + b n^2 seconds (the quadratic term is
    attention), a compression c0 + c n."""

    a: float
    b: float
    c0: float
    c: float

    def pays_from(self, rate: float) -> float:
        """The shortest prompt whose prefill saving at `rate` (the share kept) exceeds its compression time
        (math.inf: none). saving - cost = b (1 - r^2) n^2 + (a (1 - r) - c) n - c0, zero at n = 0 or negative
        there, and convex: it pays past its larger root."""
        A, B = self.b * (1 - rate ** 2), self.a * (1 - rate) - self.c
        if A <= 0:
            return self.c0 / B if B > 0 else math.inf
        return (-B + math.sqrt(B * B + 4 * A * self.c0)) / (2 * A)


def fit(lengths: tuple[int, int], seconds: tuple[float, float], quadratic: bool) -> tuple[float, float]:
    """(a, b) of a n + b n^2 through two points (quadratic), or (c0, c) of c0 + c n; never negative."""
    (n1, n2), (t1, t2) = lengths, seconds
    if quadratic:
        b = max((t2 / n2 - t1 / n1) / (n2 - n1), 0.0)
        return max(t1 / n1 - b * n1, 0.0), b
    c = max((t2 - t1) / (n2 - n1), 0.0)
    return max(t1 - c * n1, 0.0), c


def probe_text(tok, tokens: int, seed: int = 0) -> str:
    """About `tokens` of the served tokenizer's tokens of word-like text in paragraphs (what the compressors time
    on: their cost does not depend on what the words say)."""
    rng = random.Random(seed)
    vocab = [w for w in (tok.decode([i]) for i in range(min(tok.vocab_size, 20000))) if w.strip().isalpha()]
    words = [rng.choice(vocab).strip() for _ in range(tokens)]
    text = "\n\n".join(" ".join(words[i:i + 40]) + "." for i in range(0, len(words), 40))
    ids = tok.encode(text, add_special_tokens=False)[:tokens]
    return tok.decode(ids)


class PromptCompression:
    """One scorer (a model name, loaded on first use, or a PromptCompressor); one compression at a time, off the
    event loop. `prefill_seconds(n)`: the served model's time to prefill n tokens (an engine front end's), which
    "auto" weighs compressing against; `window`: its context window."""

    def __init__(self, scorer, prefill_seconds=None, window: int | None = None):
        self.scorer, self.lock, self.prefill_seconds, self.window = scorer, asyncio.Lock(), prefill_seconds, window
        self.compressor = None if isinstance(scorer, str) else scorer
        self.prefill_curve = None  # (a, b) of the served model
        self.costs: dict[str, BreakEven] = {}  # by method

    async def _compressor(self) -> PromptCompressor:
        if self.compressor is None:
            self.compressor = await asyncio.to_thread(PromptCompressor, self.scorer, progress=False)
        return self.compressor

    async def compress(self, text: str, options) -> tuple[str, float]:
        async with self.lock:
            compressor = await self._compressor()
            result = await asyncio.to_thread(compressor.compress, text, **options.options())
        return result.text, result.seconds

    def prepare(self, method: str, tok) -> float:
        """Before the server answers: the scorer loaded, `method`'s model made or loaded (the classifier trains on
        first use) and its break-even measured, so that no request waits on them. Returns the seconds it took."""
        start = time.perf_counter()
        if self.compressor is None:
            self.compressor = PromptCompressor(self.scorer, progress=True)
        self.costs[method] = self._measure(self.compressor, method, tok)
        return time.perf_counter() - start

    async def break_even(self, method: str, tok) -> BreakEven:
        """The costs for `method`, measured on first use (the classifier made first if it is not yet cached)."""
        async with self.lock:
            if method not in self.costs:
                compressor = await self._compressor()
                self.costs[method] = await asyncio.to_thread(self._measure, compressor, method, tok)
        return self.costs[method]

    def _measure(self, compressor: PromptCompressor, method: str, tok) -> BreakEven:
        if self.prefill_seconds is None:
            raise LeanLMError("auto compression needs the served model to time its prefill")
        top = min(PROBE_TOKENS, self.window - 1)
        lengths = (top // 4, top)
        if self.prefill_curve is None:
            self.prefill_seconds(16)  # first-call costs out of the timing
            self.prefill_curve = fit(lengths, tuple(self.prefill_seconds(n) for n in lengths), True)
        texts = [probe_text(tok, n) for n in lengths]
        if method == "classifier":
            compressor.classifier  # made or loaded outside the timing
        compressor.compress(texts[0], rate=0.5, method=method)  # warm
        seconds = tuple(min(compressor.compress(t, rate=0.5, method=method).seconds for _ in range(2)) for t in texts)
        return BreakEven(*self.prefill_curve, *fit(lengths, seconds, False))

    async def apply(self, options, prompts: list, chat: bool, tok) -> tuple[list, dict]:
        """The prompts compressed (with auto, those long enough that it pays), and the usage fields:
        original_prompt_tokens (in the served model's tokens) and compression_seconds; with auto also
        compressed_prompts and break_even_tokens (the length from which compressing at the request's rate pays)."""
        seconds, out, usage = 0.0, [], {}
        for prompt in prompts:
            if chat:
                users = [i for i, m in enumerate(prompt) if m["role"] == "user"]
                if not users:
                    raise LeanLMError("compress_prompt needs a user message to compress")
                text = prompt[users[-1]]["content"]
            elif isinstance(prompt, str):
                text = prompt
            else:
                raise LeanLMError("compress_prompt needs text prompts, not token ids")
            whole = text.rstrip("\n") + "\n\n" + options.question if options.question else text  # as compressed
            if options.auto:
                n = len(tok.encode(whole, add_special_tokens=False))
                rate = options.target_tokens / n if options.target_tokens else options.options()["rate"]
                pays = (await self.break_even(options.options()["method"], tok)).pays_from(min(rate, 1.0))
                usage["break_even_tokens"] = round(pays) if math.isfinite(pays) else None
                usage["compressed_prompts"] = usage.get("compressed_prompts", 0) + (n >= pays)
            if options.auto and n < pays:
                text = whole  # sent whole, the question after the text where compression puts it
            else:
                text, s = await self.compress(text, options)
                seconds += s
            out.append([*prompt[:users[-1]], {**prompt[users[-1]], "content": text}, *prompt[users[-1] + 1:]]
                       if chat else text)
        original = sum(len(encode_prompt(tok, p, chat)) for p in prompts)
        return out, {"original_prompt_tokens": original, "compression_seconds": round(seconds, 4), **usage}
