"""Structured outputs: a grammar (JSON schema, any JSON object, regex, choice, Lark/GBNF) turned into a per-step
token bitmask that sets every token the grammar forbids to -inf before sampling.

Backed by llguidance 1.9.1 (https://github.com/guidance-ai/llguidance): an Earley parser over a lazily built lexer
DFA, walking the tokenizer's token trie at each step. Chosen over xgrammar 0.2.8 for its per-token mask cost on this
CPU (Intel Xeon, AVX-512 + AMX, 2 vCPUs shared with other jobs; benchmarks/structured.py --section mask --threads 1;
fill + accept in us, mean (p90); "random": greedy random-logits decode, "replay": real JSON documents):

                              nested schema               json_object   compile cold / cached (ms)
                              random      replay          replay        schema
    SmolLM2 (49k)  llguidance  43 (71)     63 (138)        13            1.3 / 0.01 (a copy of the cached matcher)
                   xgrammar    150 (11)    430 (762)       4             200 / 12
    Qwen2.5 (152k) llguidance  127 (249)   108 (259)       20            1.4 / 0.4
                   xgrammar    635 (1023)  1034 (4271)     11            581 / 55

Also: llguidance reads the `tokenizers` tokenizer.json as is (no transformers AutoTokenizer), has no Python
dependencies (xgrammar pulls triton, apache-tvm-ffi, transformers), rolls back any number of tokens, validates a
speculative proposal without changing state, forks in ~10 us, and takes Lark and GBNF grammars and Rust-syntax
regexes. Its torch helper masks logits with a torch.compile'd function (a first compile of 30-110 s on CPU), so
apply_bitmask is our own: one embedding lookup of a [256, 8] table of 0/-inf per bitmask byte, and one add
(26 / 65 us for one row of 49k / 152k logits, xgrammar's C++ CPU kernel 104 / 311 us).

A step: `bitmask = compiler.allocate_bitmask(R)`, `compiler.fill(matchers, bitmask, rows)`,
`apply_bitmask(logits, bitmask, rows)`, sample, then `matcher.accept(token)` for each sequence.
"""

from __future__ import annotations

import functools
import json
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import llguidance
import torch
from tokenizers import decoders

from leanlm.errors import LeanLMError
from leanlm.tokenizer import Tokenizer

KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")
# one JSON layout, as json.dumps writes it: free whitespace lets small models emit newlines until max_tokens
_COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class GrammarSpec:
    """What the output must match. value: the schema as a JSON string (a dict is serialised, key order kept: it is
    the order properties are generated in) for json_schema; "" for json_object; a regex (Rust `regex` syntax,
    matched in full); a tuple of strings for choice; a Lark grammar or a GBNF one (llama.cpp's, as vLLM's
    guided_grammar takes; rules written `name ::= ...`, converted to Lark) for grammar."""

    kind: str
    value: str | tuple[str, ...] = ""

    def __post_init__(self):
        if self.kind not in KINDS:
            raise LeanLMError(f"grammar kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        value = self.value
        if self.kind == "json_schema" and isinstance(value, dict):
            value = json.dumps(value)
        if self.kind == "choice":
            value = (value,) if isinstance(value, str) else tuple(value)
            if not value or not all(isinstance(c, str) and c for c in value):
                raise LeanLMError(f"choice needs a non-empty list of non-empty strings, got {self.value!r}")
        elif not isinstance(value, str) or (self.kind != "json_object" and not value.strip()):
            raise LeanLMError(f"{self.kind} needs its text as a non-empty string, got {self.value!r}")
        object.__setattr__(self, "value", value)

    @classmethod
    def one_of(cls, json_schema: str | dict | None = None, json_object: bool | None = None, regex: str | None = None,
               choice: list[str] | None = None, grammar: str | None = None) -> GrammarSpec | None:
        """The spec of the one constraint given (None for none; LeanLMError for several), as vLLM's
        structured_outputs and leanlm generate --file's per-line fields name them."""
        given = {"json_schema": json_schema, "json_object": "" if json_object else None, "regex": regex,
                 "choice": choice, "grammar": grammar}
        given = {kind: value for kind, value in given.items() if value is not None}
        if len(given) > 1:
            raise LeanLMError(f"give one structured-output constraint, not {', '.join(given)}")
        return cls(*given.popitem()) if given else None


class GrammarCompiler:
    """Compiles specs for one tokenizer and model; compiled grammars are kept by spec (LRU, `cache_size` of them).

    vocab_size is the model's logits width: ids the tokenizer lacks are never allowed. eos_ids (the engine's
    eos ids) are allowed exactly when the grammar can end. threads > 1 fills a batch's masks in parallel.
    """

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_ids: Iterable[int], cache_size: int = 256,
                 json_whitespace: bool = False, threads: int = 1):
        eos = sorted(set(eos_ids))
        if not eos:
            raise LeanLMError("structured outputs need the model's eos token id, and it has none")
        self.vocab_size = max(vocab_size, tokenizer.vocab_size)
        self.width = (self.vocab_size + 31) // 32  # int32 words per bitmask row
        self.eos_ids = tuple(eos)
        # from the serialised Rust tokenizer, added tokens included: ~0.2 s for 49k tokens, ~1.3 s for 152k
        self._tok = llguidance.LLTokenizer(_readable(tokenizer), n_vocab=self.vocab_size, eos_token=eos)
        self._json = None if json_whitespace else _COMPACT
        self._cache: OrderedDict[GrammarSpec, llguidance.LLMatcher] = OrderedDict()  # spec -> fresh matcher
        self._lock = threading.Lock()  # a server checks specs on its own thread while the engine makes matchers
        self.cache_size, self.hits, self.misses = cache_size, 0, 0
        self._executor = llguidance.LLExecutor(threads) if threads > 1 else None

    def compile(self, spec: GrammarSpec) -> None:
        """Check and cache a spec (~1-10 ms when new; a server calls it to reject a bad request early);
        LeanLMError, with what is wrong in one line, if it is invalid."""
        self._template(spec)

    def matcher(self, spec: GrammarSpec, stop_ids: Iterable[int] = ()) -> Matcher:
        """A new sequence's matcher (~10 us once compiled). stop_ids: more ids that end the sequence
        (SamplingParams.stop_token_ids); like eos they are allowed only where the grammar can end."""
        return Matcher(self, spec, self._template(spec).deep_copy(), frozenset(stop_ids) - set(self.eos_ids))

    def _template(self, spec: GrammarSpec) -> llguidance.LLMatcher:
        """The spec's matcher at the start, never advanced itself: each sequence gets a copy."""
        with self._lock:
            template = self._cache.get(spec)
            if template is not None:
                self.hits += 1
                self._cache.move_to_end(spec)
                return template
            self.misses += 1
        try:
            if spec.kind == "json_object":
                text = llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', overrides=self._json)
            elif spec.kind == "json_schema":
                text = llguidance.LLMatcher.grammar_from_json_schema(spec.value, overrides=self._json)
            elif spec.kind == "regex":
                text = llguidance.LLMatcher.grammar_from_regex(spec.value)
            elif spec.kind == "choice":
                text = llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(map(json.dumps, spec.value)))
            else:
                text = llguidance.grammar_from("grammar", spec.value)
        except ValueError as e:  # not JSON, or a GBNF grammar that does not convert
            raise LeanLMError(f"invalid {spec.kind}: {_one_line(str(e))}") from None
        template = llguidance.LLMatcher(self._tok, text, log_level=0)
        if template.is_error():
            error = _one_line(template.get_error())
            if spec.kind != "grammar":  # a position in the Lark text llguidance generated, not in the user's
                error = re.sub(r"^at \d+\(\d+\): ", "", error)
            raise LeanLMError(f"invalid {spec.kind}: {error}")
        with self._lock:
            self._cache[spec] = template
            if len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return template

    def allocate_bitmask(self, rows: int) -> torch.Tensor:
        """An all-allowed bitmask  # [rows, ceil(V/32)] int32, bit j of word w is token 32w + j"""
        return torch.full((rows, self.width), -1, dtype=torch.int32)

    def fill(self, matchers: Sequence[Matcher], bitmask: torch.Tensor, rows: Sequence[int]) -> None:
        """matchers[i]'s next-token mask into bitmask[rows[i]], in parallel when the compiler has threads."""
        self._check(bitmask)
        if self._executor is None or len(matchers) < 2:
            for m, row in zip(matchers, rows):
                m.fill(bitmask, row)
            return
        pairs = [(m._m, row) for m, row in zip(matchers, rows)]
        self._executor.unsafe_compute_mask_ptr(pairs, bitmask.data_ptr(), self.width * 4, bitmask.shape[0])
        for m, row in zip(matchers, rows):
            m._fix(bitmask[row])

    def _check(self, bitmask: torch.Tensor) -> None:
        if bitmask.dtype != torch.int32 or bitmask.dim() != 2 or bitmask.shape[1] != self.width \
                or not bitmask.is_contiguous() or bitmask.device.type != "cpu":
            raise ValueError(f"bitmask must be a contiguous CPU int32 tensor [R, {self.width}], got "
                             f"{bitmask.dtype} {tuple(bitmask.shape)} on {bitmask.device}")


class Matcher:
    """One sequence's position in its grammar. Not thread-safe; one per sequence (fork() for n > 1)."""

    def __init__(self, compiler: GrammarCompiler, spec: GrammarSpec, m: llguidance.LLMatcher,
                 stops: frozenset[int], ended: bool = False):
        self.compiler, self.spec, self._m, self._stops = compiler, spec, m, stops
        # eos and stop ids are ours to track: llguidance refuses eos once the grammar is complete
        self._ends, self._ended = stops | set(compiler.eos_ids), ended

    def fill(self, bitmask: torch.Tensor, row: int = 0) -> None:
        """The allowed next tokens into bitmask[row]  # [R, ceil(V/32)] int32"""
        self.compiler._check(bitmask)
        self._m.unsafe_compute_mask_ptr(bitmask[row].data_ptr(), self.compiler.width * 4)
        self._fix(bitmask[row])

    def _fix(self, words: torch.Tensor) -> None:
        """Stop ids follow eos; a matcher in error (a parser limit hit) allows only eos, ending the sequence."""
        if self._m.is_error():
            words.zero_()
            _set_bits(words, self.compiler.eos_ids, True)
        elif self._stops:
            _set_bits(words, self._stops, self._m.is_accepting())

    def accept(self, token: int) -> bool:
        """Advance by one sampled token; False (state unchanged) if the grammar does not allow it."""
        if self._ended:
            return False
        if token in self._ends:
            self._ended = self._m.is_accepting()
            return self._ended
        return self._m.try_consume_tokens([token]) == 1

    def validate(self, tokens: Sequence[int]) -> int:
        """How many leading tokens of a proposal the grammar accepts, state unchanged (speculative decoding)."""
        if self._ended:
            return 0
        tokens = list(tokens)
        end = next((i for i, t in enumerate(tokens) if t in self._ends), len(tokens))
        n = self._m.validate_tokens(tokens[:end])
        if n < end or end == len(tokens):
            return n
        self._m.try_consume_tokens(tokens[:end])  # then is eos allowed there?
        can_end = self._m.is_accepting()
        self._m.rollback(end)
        return end + can_end

    def rollback(self, n: int) -> None:
        """Undo the last n accepted tokens (rejected speculative tokens)."""
        if n > 0 and self._ended:
            self._ended, n = False, n - 1
        if n > 0 and not self._m.rollback(n):
            raise LeanLMError(f"cannot roll the grammar back {n} tokens: {_one_line(self._m.get_error())}")

    def fork(self) -> Matcher:
        """An independent copy in the same state (the other completions of an n > 1 request)."""
        return Matcher(self.compiler, self.spec, self._m.deep_copy(), self._stops, self._ended)

    @property
    def done(self) -> bool:
        """The grammar is complete and only eos remains allowed, or eos was accepted."""
        return self._ended or self._m.is_stopped()

    @property
    def error(self) -> str | None:
        """Why the matcher stopped early (a parser resource limit), None while it is healthy."""
        return _one_line(self._m.get_error()) if self._m.is_error() else None


def mask_rows(logits: torch.Tensor, constrained: list[tuple[Matcher, list[int], Sequence[int]]]) -> None:
    """Each matcher's disallowed tokens to -inf in its rows, in place: row j by its state after tokens[:j] (a
    proposal's rows), the state as it was afterwards  # logits [R, V]; (matcher, its rows, the tokens between)"""
    if not constrained:
        return
    bitmask = constrained[0][0].compiler.allocate_bitmask(len(logits))
    rows = []
    for m, own, tokens in constrained:
        for j, row in enumerate(own):
            m.fill(bitmask, row)
            if j < len(own) - 1:
                m.accept(tokens[j])
        m.rollback(len(own) - 1)
        rows += own
    apply_bitmask(logits, bitmask, rows)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int] | None = None) -> None:
    """Set the logits of disallowed tokens to -inf, in place  # logits [R, V], bitmask [R, W] int32 (W*32 >= V)

    rows: the rows of both that are constrained (None: all). Done as an add of 0/-inf per token, looked up per
    bitmask byte: 5x faster than a masked_fill with the unpacked mask on CPU. A disallowed +inf or NaN logit
    becomes NaN, never a finite value."""
    if rows is not None and len(rows) == 0:
        return
    width = min(logits.shape[-1], bitmask.shape[-1] * 32)
    if rows is not None and list(rows) != list(range(logits.shape[0])):
        index = torch.as_tensor(rows, dtype=torch.long)
        logits.index_add_(0, index.to(logits.device), _bias(bitmask[index], logits, width))
    else:
        logits.add_(_bias(bitmask, logits, width))


def _bias(bitmask: torch.Tensor, logits: torch.Tensor, width: int) -> torch.Tensor:
    """0 for an allowed token, -inf for a disallowed one  # bitmask [R, W] -> [R, logits V] in logits' dtype"""
    table = _byte_bias(logits.dtype, logits.device)
    codes = bitmask.contiguous().view(torch.uint8).to(device=logits.device, dtype=torch.long)  # [R, 4W]
    bias = torch.nn.functional.embedding(codes, table).view(bitmask.shape[0], -1)[:, :width]
    if width < logits.shape[-1]:  # logits wider than the bitmask: those ids are unknown to the grammar
        bias = torch.nn.functional.pad(bias, (0, logits.shape[-1] - width), value=float("-inf"))
    return bias


@functools.cache
def _byte_bias(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[256, 8]: bit j of a bitmask byte -> 0 (allowed) or -inf; bytes are little-endian, byte k = tokens 8k..8k+7"""
    bits = (torch.arange(256)[:, None] >> torch.arange(8)) & 1
    return torch.zeros(256, 8, dtype=dtype).masked_fill_(bits == 0, float("-inf")).to(device)


def _readable(tokenizer: Tokenizer) -> str:
    """The tokenizer.json llguidance reads. It takes a token's bytes from the decoder, and knows SentencePiece's as
    Replace + ByteFallback, not as one Metaspace decoder: that one is swapped for the equivalent (the leading space
    Metaspace drops does not matter to a mask)."""
    text = tokenizer._tok.to_str()
    if not isinstance(tokenizer._tok.decoder, decoders.Metaspace):
        return text
    spec = json.loads(text)
    space = spec["decoder"].get("replacement", "\u2581")
    spec["decoder"] = {"type": "Sequence", "decoders": [
        {"type": "Replace", "pattern": {"String": space}, "content": " "}, {"type": "ByteFallback"}, {"type": "Fuse"}]}
    return json.dumps(spec)


def _set_bits(words: torch.Tensor, ids: Iterable[int], on: bool) -> None:
    for t in ids:
        if t // 32 < words.shape[0]:
            bit = 1 << (t % 32)
            word = int(words[t // 32]) & 0xFFFFFFFF
            word = word | bit if on else word & ~bit
            words[t // 32] = word - (1 << 32) if word >= 1 << 31 else word


def _one_line(message: str) -> str:
    """llguidance's multi-line error (with the grammar source quoted under a caret) as one short line."""
    lines = [s.strip() for s in message.splitlines()]
    keep = [s for s in lines if s and not set(s) <= {"^", " "} and not s.split("|")[0].strip().isdigit()]
    return " ".join(keep)[:300]
