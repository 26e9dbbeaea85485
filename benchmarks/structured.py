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

    python benchmarks/structured.py --section serve [--model smollm2-135m] [--concurrency 1,32] [--rounds 2]
                                    [--requests N] [--no-profile]

Section `serve`: what structured outputs cost a served model. `leanlm serve MODEL` (default options, started cold
as a user starts it) gets streamed chat requests asking in words for a JSON object of one of 8 schemas (bounded
strings and numbers, enums, arrays with maxItems), max_tokens 128, temperature 0: (A) as they are, (B) the same
with response_format json_schema, (C) A again, each request cut to the length of its B answer (ignore_eos), in
rounds (A, B, C, A, B, C, ... at each concurrency; one server). A row per run as measured, then per concurrency:
output tok/s (tokens / wall time; unconstrained answers run ~2x longer, so B compares with C, not A) and the
median per-request TPOT (per token, B over A). Then (--profile, the default; after the server stopped) the same
structured requests run in process through leanlm.engine.LLM with Engine._mask, Matcher.fill, apply_bitmask and
Matcher.accept timed: the grammar's cost per token and its share of the step time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time

import torch

from leanlm.generation.grammar import GrammarCompiler, GrammarSpec, apply_bitmask
from leanlm.models.config import ModelConfig
from leanlm.models.zoo import DEFAULT_MODEL
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


def _obj(required: list[str], **props) -> dict:
    return {"type": "object", "additionalProperties": False, "required": required, "properties": props}


def _str(n: int, **kw) -> dict:
    return {"type": "string", "maxLength": n, **kw}


def _int(lo: int, hi: int) -> dict:
    return {"type": "integer", "minimum": lo, "maximum": hi}


# (name, schema, the request in words with a {} for the subject, subjects): request i asks for schema i % 8 about
# subject i // 8, so prompts differ while the schemas repeat (a server's compiled-grammar cache sees 8 specs)
WORKLOAD = [
    ("person", _obj(["name", "age", "email", "occupation"], name=_str(30), age=_int(0, 120), email=_str(40),
                    occupation=_str(30)),
     "Describe {} as a JSON object with their name, age, email address and occupation.",
     ["a retired sailor from Lisbon", "a young software engineer in Nairobi", "a baker in Lyon", "a nurse in Osaka",
      "a physics teacher in Toronto", "a jazz pianist in New Orleans", "a farmer in Iowa", "a pilot in Dubai"]),
    ("address", _obj(["street", "city", "postal_code", "country"], street=_str(40), city=_str(25),
                     postal_code=_str(10, pattern="^[0-9]{5}$"), country=_str(25)),
     "Write the postal address of {} as a JSON object with street, city, postal_code (5 digits) and country.",
     ["a small bookshop", "a dentist's office", "a city library", "a pizza restaurant", "a primary school",
      "a bicycle repair shop", "a museum of modern art", "a flower market"]),
    ("order", _obj(["order_id", "customer", "items", "total"], order_id=_str(12, pattern="^ORD-[0-9]{4,6}$"),
                   customer=_str(30), items={"type": "array", "minItems": 1, "maxItems": 2, "items": _obj(
                       ["product", "quantity", "price"], product=_str(20), quantity=_int(1, 10),
                       price={"type": "number", "minimum": 0, "maximum": 1000})},
                   total={"type": "number", "minimum": 0, "maximum": 5000}),
     "Create a JSON object for an online order placed by {}: an order_id, the customer, up to two items with "
     "product, quantity and price, and the total.",
     ["a student buying school supplies", "a chef buying knives", "a gardener", "a gamer", "a new parent",
      "a runner", "a photographer", "a coffee lover"]),
    ("weather", _obj(["city", "temperature", "unit", "conditions", "humidity"], city=_str(25),
                     temperature={"type": "number", "minimum": -60, "maximum": 60},
                     unit={"enum": ["celsius", "fahrenheit"]},
                     conditions={"enum": ["sunny", "cloudy", "rainy", "snowy", "windy", "foggy"]},
                     humidity=_int(0, 100)),
     "Give today's weather report for {} as a JSON object: city, temperature, unit, conditions and humidity.",
     ["Oslo", "Cairo", "Seattle", "Mumbai", "Buenos Aires", "Reykjavik", "Singapore", "Denver"]),
    ("book", _obj(["title", "author", "year", "genres", "rating"], title=_str(40), author=_str(30),
                  year=_int(1400, 2030), genres={"type": "array", "maxItems": 3, "items": {"enum": [
                      "fiction", "mystery", "science", "history", "fantasy", "romance", "biography"]}},
                  rating={"type": "number", "minimum": 0, "maximum": 5}),
     "Recommend {} and answer with a JSON object with its title, author, year, genres and rating out of 5.",
     ["a classic novel", "a book about space", "a detective story", "a history of Rome", "a fantasy epic",
      "a biography of a scientist", "a love story", "a book for children"]),
    ("event", _obj(["name", "date", "location", "attendees"], name=_str(40),
                   date=_str(10, pattern="^[0-9]{4}-[0-9]{2}-[0-9]{2}$"), location=_str(30), attendees=_int(0, 100000)),
     "Announce {} as a JSON object with the event name, date (YYYY-MM-DD), location and expected attendees.",
     ["a music festival", "a tech conference", "a marathon", "a chess tournament", "a food fair",
      "a science fair", "a charity gala", "a film premiere"]),
    ("review", _obj(["product", "rating", "pros", "cons", "recommend"], product=_str(30), rating=_int(1, 5),
                    pros={"type": "array", "maxItems": 3, "items": _str(30)},
                    cons={"type": "array", "maxItems": 3, "items": _str(30)}, recommend={"type": "boolean"}),
     "Review {} as a JSON object: product, rating from 1 to 5, pros, cons and whether you recommend it.",
     ["a pair of headphones", "an electric kettle", "a budget smartphone", "a hiking backpack", "a desk lamp",
      "a robot vacuum", "a mechanical keyboard", "a camping tent"]),
    ("recipe", _obj(["name", "servings", "ingredients", "prep_minutes", "vegetarian"], name=_str(30),
                    servings=_int(1, 12),
                    ingredients={"type": "array", "minItems": 1, "maxItems": 5, "items": _str(25)},
                    prep_minutes=_int(0, 240), vegetarian={"type": "boolean"}),
     "Give a recipe for {} as a JSON object with its name, servings, ingredients, prep_minutes and vegetarian.",
     ["pancakes", "a tomato soup", "a chicken curry", "a green salad", "banana bread", "fried rice",
      "a mushroom risotto", "guacamole"]),
]


def serve_requests(n: int, structured: bool, max_tokens: int = 128, lengths: list[int] | None = None) -> list[dict]:
    """The chat request bodies (stream, usage, greedy), with response_format json_schema when structured; with
    lengths, unconstrained and exactly lengths[i] tokens long (ignore_eos)."""
    bodies = []
    for i in range(n):
        name, schema, ask, subjects = WORKLOAD[i % len(WORKLOAD)]
        body = {"messages": [{"role": "user", "content": ask.format(subjects[i // len(WORKLOAD) % len(subjects)])}],
                "max_tokens": max_tokens, "temperature": 0, "ignore_eos": False, "stream": True,
                "stream_options": {"include_usage": True}}
        if structured:
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}
        if lengths is not None:
            body.update(max_tokens=max(1, lengths[i]), ignore_eos=True)
        bodies.append(body)
    return bodies


async def _chat_one(http, url: str, body: dict):
    """One streamed chat completion: (bench.serve's RequestResult, the answer's text, its finish_reason)."""
    from leanlm.bench.serve import RequestResult

    result, text, chunks, finish = RequestResult(False, 0), [], 0, None
    start = last = time.perf_counter()
    async with http.stream("POST", url, json=body) as r:
        if r.status_code != 200:
            result.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
            return result, "", None
        async for line in r.aiter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            data = json.loads(line[5:])
            if usage := data.get("usage"):
                result.output_tokens, result.prompt_tokens = usage["completion_tokens"], usage["prompt_tokens"]
            if data.get("choices"):
                now = time.perf_counter()
                text.append(data["choices"][0].get("delta", {}).get("content") or "")
                finish = data["choices"][0].get("finish_reason") or finish
                if chunks == 0:
                    result.ttft = now - start
                else:
                    result.itl.append(now - last)
                last, chunks = now, chunks + 1
    result.latency, result.ok = last - start, chunks > 0
    result.output_tokens = result.output_tokens or chunks
    return result, "".join(text), finish


async def chat_load(base_url: str, model: str, bodies: list[dict], concurrency: int) -> tuple[list, list, float]:
    """Every body at `concurrency` in flight (bench.serve.run_load sends /v1/completions bodies only);
    (results, [(text, finish_reason)], seconds)."""
    import httpx

    url = base_url + "/v1/chat/completions"
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=concurrency),
                                 timeout=httpx.Timeout(900.0, connect=30.0)) as http:
        async def limited(body):
            async with gate:
                return await _chat_one(http, url, {"model": model, **body})

        start = time.perf_counter()
        done = await asyncio.gather(*(limited(b) for b in bodies))
        seconds = time.perf_counter() - start
    return [r for r, _, _ in done], [(t, f) for _, t, f in done], seconds


def _valid_json(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def _median_ms(values: list[float]) -> float:
    return statistics.median(values) * 1e3 if values else float("nan")


MODES = ("unconstr.", "structured", "len-matched")  # A, B, and A cut to B's lengths (run after B, in its round)


def section_serve(args) -> None:
    from leanlm.bench.serve import LocalServer, free_port, leanlm_command, served_model
    from leanlm.models.zoo import pull

    path = pull(args.model, progress=False)
    levels = [int(c) for c in args.concurrency.split(",")]
    runs = {c: args.requests or (16 if c == 1 else 2 * c) for c in levels}
    port = free_port()
    t0 = time.perf_counter()
    with LocalServer(leanlm_command("serve", str(path), "--port", str(port)), port) as server:
        print(f"# leanlm serve {path.name} (default options) ready in {time.perf_counter() - t0:.1f} s; "
              f"{os.cpu_count()} CPUs; {args.rounds} round(s) per concurrency of: unconstrained, structured "
              "(response_format json_schema), len-matched (unconstrained, ignore_eos, each request as long as its "
              "structured answer)", flush=True)
        model = served_model(server.url)
        # warm-up: every schema compiled once (the server caches compiled grammars), both kinds, full length
        asyncio.run(chat_load(server.url, model, serve_requests(8, True) + serve_requests(8, False), 8))
        print(f"{'round':>5} {'conc':>4} {'mode':12} {'reqs':>4} {'out tok':>7} {'tok/req':>7} {'secs':>6} "
              f"{'tok/s':>6} {'TTFT p50 ms':>11} {'TPOT p50 ms':>11} {'JSON ok':>7} {'at max':>6} {'failed':>6}",
              flush=True)
        measured = {}  # (concurrency, mode) -> [(results, seconds)], a pair per round
        for rnd in range(args.rounds):
            for c in levels:
                for mode in MODES:
                    lengths = None
                    if mode == "len-matched":
                        lengths = [r.output_tokens for r in measured[(c, "structured")][-1][0]]
                    results, answers, seconds = asyncio.run(chat_load(
                        server.url, model, serve_requests(runs[c], mode == "structured", lengths=lengths), c))
                    measured.setdefault((c, mode), []).append((results, seconds))
                    ok = [r for r in results if r.ok]
                    tokens = sum(r.output_tokens for r in ok)
                    valid = sum(_valid_json(t) for r, (t, _) in zip(results, answers) if r.ok)
                    capped = sum(f == "length" for _, f in answers)
                    print(f"{rnd + 1:5} {c:4} {mode:12} {len(results):4} {tokens:7} {tokens / max(1, len(ok)):7.1f} "
                          f"{seconds:6.1f} {tokens / seconds:6.1f} {_median_ms([r.ttft for r in ok]):11.0f} "
                          f"{_median_ms([r.tpot for r in ok if r.output_tokens > 1]):11.1f} "
                          f"{valid:3}/{len(ok):<3} {capped:6} {len(results) - len(ok):6}", flush=True)
                    for i, (r, (text, finish)) in enumerate(zip(results, answers)):
                        if not r.ok:
                            print(f"# failed: {r.error}", file=sys.stderr)
                        elif mode == "structured" and (finish == "length" or not _valid_json(text)):
                            print(f"# {WORKLOAD[i % len(WORKLOAD)][0]}: {finish}, {text[-80:]!r}", file=sys.stderr)
    profile = {c: profile_mask(path, c, runs[c]) for c in levels} if args.profile else {}
    print(f"\n# {path.name}, {args.rounds} round(s). tok/s: output tokens / wall time (unconstrained answers run "
          "longer: compare structured with len-matched, the same requests cut to the structured answers' lengths); "
          "TPOT, TTFT: medians over requests; ratios structured / unconstrained, > 1 is slower per token (per "
          "round in brackets); grammar us per token from the in-process profile (mask = fill + apply_bitmask + "
          "bitmask allocation)", flush=True)
    head = ["concurrency", "unconstr. tok/s", "structured tok/s", "ratio", "len-matched tok/s", "str / matched",
            "TPOT ms (unc / str)", "TPOT ratio", "TTFT ms (unc / str)", "mask us/token", "accept us/token",
            "grammar % of step"]
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for c in levels:
        tps, tpot, ttft = {}, {}, {}
        for mode in MODES:
            pairs = measured[(c, mode)]
            ok = [r for results, _ in pairs for r in results if r.ok]
            tps[mode] = sum(r.output_tokens for r in ok) / sum(s for _, s in pairs)
            tpot[mode] = _median_ms([r.tpot for r in ok if r.output_tokens > 1])
            ttft[mode] = _median_ms([r.ttft for r in ok])
        per_round = [_median_ms([r.tpot for r in b if r.ok and r.output_tokens > 1]) /
                     _median_ms([r.tpot for r in a if r.ok and r.output_tokens > 1])
                     for (a, _), (b, _) in zip(measured[(c, "unconstr.")], measured[(c, "structured")])]
        a, b, m = (tps[mode] for mode in MODES)
        cells = [str(c), f"{a:.1f}", f"{b:.1f}", f"{b / a:.2f}", f"{m:.1f}", f"{b / m:.2f}",
                 f"{tpot['unconstr.']:.1f} / {tpot['structured']:.1f}",
                 f"{tpot['structured'] / tpot['unconstr.']:.2f} [{', '.join(f'{x:.2f}' for x in per_round)}]",
                 f"{ttft['unconstr.']:.0f} / {ttft['structured']:.0f}"]
        if c in profile:
            p = profile[c]
            cells += [f"{p['mask'] / p['rows'] * 1e6:.0f} (fill {p['fill'] / p['rows'] * 1e6:.0f}, apply "
                      f"{p['apply'] / p['rows'] * 1e6:.0f})", f"{p['accept'] / p['accepts'] * 1e6:.0f}",
                      f"{(p['mask'] + p['accept']) / p['step'] * 100:.1f}"]
        else:
            cells += ["-", "-", "-"]
        print("| " + " | ".join(cells) + " |", flush=True)


def profile_mask(path, concurrency: int, n: int) -> dict:
    """The structured requests through an in-process LLM (the server's engine defaults), `concurrency` at a time,
    with the engine's grammar work timed by wrapping it: seconds in _mask (fill, apply_bitmask), accept and step."""
    import leanlm.engine.engine as engine_mod
    from leanlm.engine import LLM
    from leanlm.generation import grammar
    from leanlm.generation.grammar import GrammarSpec
    from leanlm.generation.sampling import SamplingParams

    totals = dict.fromkeys(("mask", "fill", "apply", "accept", "step", "rows", "accepts", "steps"), 0)

    def timed(key, f, count=None):
        def wrapper(*a, **kw):
            t0 = time.perf_counter()
            try:
                return f(*a, **kw)
            finally:
                totals[key] += time.perf_counter() - t0
                if count:
                    totals[count] += 1
        return wrapper

    originals = (engine_mod.Engine._mask, engine_mod.Engine.step, engine_mod.apply_bitmask, grammar.Matcher.fill,
                 grammar.Matcher.accept)
    mask, step, apply, fill, accept = originals

    def mask_rows(self, logits, constrained):
        totals["rows"] += sum(len(rows) for _, rows in constrained)
        return mask(self, logits, constrained)

    engine_mod.Engine._mask = timed("mask", mask_rows)
    engine_mod.Engine.step = timed("step", step, "steps")
    engine_mod.apply_bitmask = timed("apply", apply)
    grammar.Matcher.fill = timed("fill", fill)
    grammar.Matcher.accept = timed("accept", accept, "accepts")
    try:
        llm = LLM(path, kv_cache_memory="2GiB", quiet=True)  # `leanlm serve`'s default budget
        bodies = serve_requests(n, True)
        prompts = [b["messages"] for b in bodies]
        params = [SamplingParams(temperature=0, max_tokens=b["max_tokens"], grammar=GrammarSpec(
            "json_schema", b["response_format"]["json_schema"]["schema"])) for b in bodies]
        llm.generate(prompts[:8], params[:8], chat=True, progress=False)  # compile the 8 grammars, warm up
        for key in totals:
            totals[key] = 0
        t0 = time.perf_counter()
        for i in range(0, n, concurrency):
            llm.generate(prompts[i : i + concurrency], params[i : i + concurrency], chat=True, progress=False)
        wall = time.perf_counter() - t0
    finally:
        (engine_mod.Engine._mask, engine_mod.Engine.step, engine_mod.apply_bitmask, grammar.Matcher.fill,
         grammar.Matcher.accept) = originals
    print(f"# profile, concurrency {concurrency}: {n} structured requests in process in {wall:.1f} s, "
          f"{totals['steps']} steps, {totals['rows']} masked rows: _mask {totals['mask'] / totals['rows'] * 1e6:.0f} "
          f"us/row (fill {totals['fill'] / totals['rows'] * 1e6:.0f}, apply_bitmask "
          f"{totals['apply'] / totals['rows'] * 1e6:.0f}), accept "
          f"{totals['accept'] / max(1, totals['accepts']) * 1e6:.0f} us/token, step "
          f"{totals['step'] / totals['steps'] * 1e3:.1f} ms; grammar "
          f"{(totals['mask'] + totals['accept']) / totals['step'] * 100:.1f}% of step time", flush=True)
    return totals


SECTIONS = {"mask": section_mask, "serve": section_serve}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--section", choices=sorted(SECTIONS), default="mask")
    ap.add_argument("--models", nargs="+", default=["smollm2-135m", "qwen2.5-coder-0.5b"])
    ap.add_argument("--tokens", type=int, default=300, help="tokens per per-token row")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--model", default=DEFAULT_MODEL, help="serve: the zoo model served")
    ap.add_argument("--concurrency", default="1,32", help="serve: requests in flight, comma-separated")
    ap.add_argument("--rounds", type=int, default=2, help="serve: rounds of (unconstrained, structured) runs")
    ap.add_argument("--requests", type=int, default=None,
                    help="serve: requests per run (default 16 at concurrency 1, else 2x the concurrency)")
    ap.add_argument("--profile", action=argparse.BooleanOptionalAction, default=True,
                    help="serve: time the engine's grammar work in process after the server runs")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    SECTIONS[args.section](args)


if __name__ == "__main__":
    main()
