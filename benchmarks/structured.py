"""Structured outputs: what a grammar costs per token, per library, on this CPU.

    python benchmarks/structured.py --section mask [--models smollm2-135m qwen2.5-coder-0.5b] [--tokens 300]

Section `mask`, one row per library x tokenizer x grammar x decode, printed as measured:
- setup: the library's tokenizer index (once per model); compile cold (first time for a spec) and cached (the
  same spec again, up to a matcher ready to fill), and the first fill after that (lexer states built lazily);
- per token: fill the next-token bitmask, and accept the chosen token (mean and p90 of fill + accept) over
  `--tokens` tokens of a greedy random-logits decode ("random"; a new document whenever one ends) and of real
  JSON documents fed token by token ("replay": a random decode stays inside one string for most of its tokens).
Libraries: leanlm (generation/grammar.py over llguidance), llguidance itself, xgrammar when installed. Grammars:
a nested JSON schema (objects, arrays, enums, numbers with bounds, a pattern, required, additionalProperties
false) and json_object, both in json.dumps' layout (no free whitespace).
Then apply_bitmask (logits [R, V] -> -inf where disallowed) for R = 1 and 32, and a 32-sequence step's fill done
one by one vs in parallel (llguidance's thread pool).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from leanlm.generation.grammar import GrammarCompiler, GrammarSpec, apply_bitmask
from leanlm.models.config import ModelConfig
from leanlm.tokenizer import Tokenizer

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "role", "tags", "address"],
          "properties": {
              "name": {"type": "string", "maxLength": 20},
              "age": {"type": "integer", "minimum": 0, "maximum": 120},
              "score": {"type": "number"},
              "role": {"enum": ["admin", "user", "guest"]},
              "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "minItems": 1, "maxItems": 4},
              "address": {"type": "object", "additionalProperties": False, "required": ["city", "zip"],
                          "properties": {"city": {"type": "string", "maxLength": 15},
                                         "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}},
              "items": {"type": "array", "maxItems": 3, "items": {
                  "type": "object", "additionalProperties": False, "required": ["id", "qty"],
                  "properties": {"id": {"type": "integer"}, "qty": {"type": "number", "minimum": 0}}}}}}
DOCS = [
    {"name": "Ada Lovelace", "age": 36, "score": 9.5, "role": "admin", "tags": ["math", "poetry"],
     "address": {"city": "London", "zip": "10001"}, "items": [{"id": 1, "qty": 2}, {"id": 17, "qty": 0.25}]},
    {"name": "Grace", "age": 85, "role": "user", "tags": ["cobol"], "address": {"city": "Arlington", "zip": "22201"}},
    {"name": "Linus T.", "age": 54, "score": -3.0, "role": "guest", "tags": ["git", "linux", "kernel"],
     "address": {"city": "Portland", "zip": "97201"}, "items": []},
]
ANY_DOCS = [{"model": "qwen", "ok": True, "n": [1, 2.5, -3e-2], "nested": {"a": None, "b": {"c": "text with spaces"}}},
            {"id": "x-1", "values": [{"k": "v"}, {"k": "w", "extra": [True, False]}], "count": 12345}]
GRAMMARS = {"schema": (GrammarSpec("json_schema", json.dumps(SCHEMA)), DOCS),
            "json_object": (GrammarSpec("json_object"), ANY_DOCS)}


class Leanlm:
    name = "leanlm"

    def __init__(self, tok: Tokenizer, vocab: int, eos: list[int]):
        self.c = GrammarCompiler(tok, vocab, eos)

    def compile(self, spec):
        self.c.compile(spec)
        return spec

    def matcher(self, compiled):
        return self.c.matcher(compiled)

    def fill(self, m, bitmask):
        m.fill(bitmask, 0)

    def accept(self, m, token):
        return m.accept(token)

    def done(self, m):
        return m.done


class LLGuidance(Leanlm):
    name = "llguidance"

    def __init__(self, tok: Tokenizer, vocab: int, eos: list[int]):
        import llguidance

        self.llg = llguidance
        self.tok = llguidance.LLTokenizer(tok._tok.to_str(), n_vocab=vocab, eos_token=eos)

    def compile(self, spec):
        options = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
        schema = spec.value if spec.kind == "json_schema" else '{"type": "object"}'
        grammar = self.llg.LLMatcher.grammar_from_json_schema(schema, overrides=options)
        self.matcher(grammar)
        return grammar

    def matcher(self, grammar):
        m = self.llg.LLMatcher(self.tok, grammar, log_level=0)
        assert not m.is_error(), m.get_error()
        return m

    def fill(self, m, bitmask):
        m.unsafe_compute_mask_ptr(bitmask.data_ptr(), bitmask.shape[1] * 4)

    def accept(self, m, token):
        return m.consume_token(token)

    def done(self, m):
        return m.is_stopped()


class XGrammar(Leanlm):
    name = "xgrammar"

    def __init__(self, tok: Tokenizer, vocab: int, eos: list[int]):
        import xgrammar

        self.xgr = xgrammar
        pieces = [""] * vocab
        for piece, i in tok._tok.get_vocab(with_added_tokens=True).items():
            pieces[i] = piece
        meta = xgrammar.TokenizerInfo._detect_metadata_from_hf(tok._tok.to_str())
        info = xgrammar.TokenizerInfo(pieces, meta["vocab_type"], vocab_size=vocab, stop_token_ids=eos,
                                      add_prefix_space=meta["add_prefix_space"])
        self.c = xgrammar.GrammarCompiler(info, max_threads=2)

    def compile(self, spec):
        if spec.kind == "json_object":
            return self.c.compile_json_schema('{"type": "object"}', any_whitespace=False, separators=(", ", ": "))
        return self.c.compile_json_schema(spec.value, any_whitespace=False, separators=(", ", ": "))

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, m, bitmask):
        m.fill_next_token_bitmask(bitmask, 0)

    def accept(self, m, token):
        return m.accept_token(token)

    def done(self, m):
        return m.is_terminated()


def libraries() -> list[type]:
    libs = [Leanlm, LLGuidance]
    try:
        import xgrammar  # noqa: F401
        libs.append(XGrammar)
    except ImportError:
        print("xgrammar is not installed: its rows are skipped", file=sys.stderr)
    return libs


def ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1e3


def per_token(lib, compiled, vocab: int, eos: int, tokens: int, replay: list[list[int]] | None, seed: int = 0):
    """fill + accept times over `tokens` tokens: a greedy random-logits decode, or replayed documents."""
    width = (vocab + 31) // 32
    bitmask = torch.full((1, width), -1, dtype=torch.int32)
    g = torch.Generator().manual_seed(seed)
    fills, accepts, docs, m, queue = [], [], 0, lib.matcher(compiled), []
    while len(fills) < tokens:
        if replay is not None and not queue:
            queue = list(replay[docs % len(replay)]) + [eos]
            m = lib.matcher(compiled)
        t0 = time.perf_counter()
        lib.fill(m, bitmask)
        t1 = time.perf_counter()
        if replay is None:
            logits = torch.randn(1, vocab, generator=g)
            apply_bitmask(logits, bitmask)
            token = int(logits.argmax())
        else:
            token = queue.pop(0)
        t2 = time.perf_counter()
        ok = token == eos or lib.accept(m, token)  # eos ends a document; libraries differ on accepting it
        t3 = time.perf_counter()
        assert ok, f"{lib.name} rejected token {token}"
        fills.append(t1 - t0)
        accepts.append(t3 - t2)
        if token == eos or lib.done(m):
            docs += 1
            m, queue = lib.matcher(compiled), []
    total = sorted(f + a for f, a in zip(fills, accepts))
    return (statistics.mean(fills) * 1e6, statistics.mean(accepts) * 1e6, statistics.mean(total) * 1e6,
            total[int(0.9 * len(total))] * 1e6, docs)


def section_mask(args) -> None:
    from leanlm.fetch import cache_dir
    from leanlm.models.zoo import pull

    print(f"# torch threads {torch.get_num_threads()}; times in ms (compile) and us (per token)", flush=True)
    head = (f"{'library':10} {'tokenizer':18} {'grammar':11} {'decode':6} {'setup ms':>8} {'cold ms':>8} "
            f"{'cached ms':>9} {'1st fill':>8} {'fill us':>8} {'accept':>7} {'mean us':>8} {'p90 us':>7} {'docs':>4}")
    print(head, flush=True)
    vocabs = {}
    for name in args.models:
        path = pull(name, progress=False) if name == "smollm2-135m" else cache_dir() / "models" / name
        if not (path / "tokenizer.json").is_file():
            path = pull(name, progress=False)
        tok, vocab = Tokenizer(path), ModelConfig.from_dir(path).vocab_size
        vocabs[name] = vocab
        eos = sorted({tok.eos_token_id, *ModelConfig.from_dir(path).eos_token_ids} - {None})
        for lib_cls in libraries():
            t0 = time.perf_counter()
            lib = lib_cls(tok, vocab, eos)
            setup = ms(t0)
            for grammar, (spec, docs) in GRAMMARS.items():
                t0 = time.perf_counter()
                compiled = lib.compile(spec)
                lib.matcher(compiled)
                cold = ms(t0)
                t0 = time.perf_counter()
                m = lib.matcher(lib.compile(spec))
                cached = ms(t0)
                bitmask = torch.full((1, (vocab + 31) // 32), -1, dtype=torch.int32)
                t0 = time.perf_counter()
                lib.fill(m, bitmask)
                first = ms(t0)
                replay = [tok.encode(json.dumps(d), add_special_tokens=False) for d in docs]
                for decode, feed in (("random", None), ("replay", replay)):
                    # the least disturbed of three runs (this machine is shared); lazy lexer states are warm by then
                    runs = [per_token(lib, compiled, vocab, eos[0], args.tokens, feed) for _ in range(3)]
                    fill, accept, mean, p90, n = min(runs, key=lambda r: r[2])
                    print(f"{lib.name:10} {name:18} {grammar:11} {decode:6} {setup:8.0f} {cold:8.1f} {cached:9.2f} "
                          f"{first:8.2f} {fill:8.1f} {accept:7.1f} {mean:8.1f} {p90:7.1f} {n:4}", flush=True)
                    setup = float("nan")
        section_batch(tok, vocab, eos, name)
    section_apply(sorted(set(vocabs.values())))


def section_batch(tok: Tokenizer, vocab: int, eos: list[int], name: str, rows: int = 32, steps: int = 60) -> None:
    """Steps of 32 sequences replaying documents from different offsets: fill them all, one by one or in
    llguidance's thread pool, then accept each one's next token."""
    spec = GrammarSpec("json_schema", json.dumps(SCHEMA))
    docs = [tok.encode(json.dumps(d), add_special_tokens=False) for d in DOCS]
    for threads in (1, 2):
        c = GrammarCompiler(tok, vocab, eos, threads=threads)
        bitmask, best = c.allocate_bitmask(rows), float("inf")
        for _ in range(3):
            matchers, queues, times = [], [], []
            for i in range(rows):
                doc = docs[i % len(docs)]
                matchers.append(c.matcher(spec))
                for t in doc[: (i * 7) % len(doc)]:
                    assert matchers[-1].accept(t)
                queues.append(doc[(i * 7) % len(doc):])
            for _ in range(steps):
                t0 = time.perf_counter()
                c.fill(matchers, bitmask, list(range(rows)))
                times.append(time.perf_counter() - t0)
                for i, m in enumerate(matchers):
                    if not queues[i]:
                        matchers[i], queues[i] = c.matcher(spec), list(docs[i % len(docs)])
                    assert matchers[i].accept(queues[i].pop(0))
            best = min(best, statistics.mean(times))
        print(f"# fill {rows} sequences (schema, replay), {name}, {threads} thread(s): {best * 1e6:.0f} us per step "
              f"({best * 1e6 / rows:.1f} us per sequence)", flush=True)


def section_apply(vocabs: list[int]) -> None:
    try:
        import xgrammar
    except ImportError:
        xgrammar = None
    shifts = torch.arange(32, dtype=torch.int32)

    def unpacked_fill(logits, bitmask):  # the plain way: unpack bits, masked_fill
        allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).view(bitmask.shape[0], -1)[:, : logits.shape[1]].bool()
        logits.masked_fill_(~allowed, float("-inf"))

    def median_us(f, logits, n=20):  # the lowest of three medians: this machine is shared
        f(logits)
        best = float("inf")
        for _ in range(3):
            times = []
            for _ in range(n):
                t0 = time.perf_counter()
                f(logits)
                times.append(time.perf_counter() - t0)
            best = min(best, statistics.median(times))
        return best * 1e6

    print(f"{'apply_bitmask':36} {'V':>7} {'R':>3} {'dtype':9} {'us':>8}", flush=True)
    g = torch.Generator().manual_seed(0)
    for vocab in vocabs:
        for rows in (1, 32):
            for dtype in (torch.float32, torch.bfloat16):
                bitmask = torch.randint(-2**31, 2**31 - 1, (rows, (vocab + 31) // 32), dtype=torch.int32, generator=g)
                logits = torch.randn(rows, vocab, generator=g).to(dtype)
                half = list(range(0, rows, 2)) or [0]
                ways = [("leanlm apply_bitmask", lambda x: apply_bitmask(x, bitmask)),
                        ("leanlm apply_bitmask, every 2nd row", lambda x: apply_bitmask(x, bitmask, half)),
                        ("unpack + masked_fill_ (torch)", lambda x: unpacked_fill(x, bitmask))]
                if xgrammar is not None:
                    ways.append(("xgrammar CPU kernel", lambda x: xgrammar.apply_token_bitmask_inplace(x, bitmask)))
                for label, f in ways:
                    us = median_us(f, logits)
                    print(f"{label:36} {vocab:7} {rows:3} {str(dtype)[6:]:9} {us:8.0f}", flush=True)


SECTIONS = {"mask": section_mask}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--section", choices=sorted(SECTIONS), default="mask")
    ap.add_argument("--models", nargs="+", default=["smollm2-135m", "qwen2.5-coder-0.5b"])
    ap.add_argument("--tokens", type=int, default=300, help="tokens per per-token row")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    SECTIONS[args.section](args)


if __name__ == "__main__":
    main()
