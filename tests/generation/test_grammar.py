"""Structured outputs: a random-logits "model" decoded under the grammar mask always writes what the spec asks."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from leanlm.errors import LeanLMError
from leanlm.generation.grammar import GrammarCompiler, GrammarSpec, apply_bitmask
from leanlm.generation.sampling import SamplingParams, sample_rows
from leanlm.tokenizer import Tokenizer
from tests.conftest import make_tokenizer

EOS = 2
PAD = 6  # the model's logits are wider than the tokenizer's vocabulary, as Qwen2.5's are


def make_json_tokenizer(path, vocab_size: int = 400) -> None:
    """A small byte-level BPE (GPT-2/Qwen style) that can spell any text, with merges learned from JSON."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    docs = [{"name": "Ada Lovelace", "age": 36, "tags": ["math", "poetry"], "address": {"city": "London"}},
            {"id": 12, "items": [{"sku": "AB-123", "qty": 2.5}], "active": True, "note": None},
            {"role": "admin", "score": -0.75, "values": [1, 2, 3], "date": "2024-01-31"}]
    tok.train_from_iterator([json.dumps(d) for d in docs] * 10, trainer)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))


@pytest.fixture(scope="module")
def json_tok(tmp_path_factory):
    path = tmp_path_factory.mktemp("json_tok")
    make_json_tokenizer(path)
    tok = Tokenizer(path)
    assert tok.eos_token_id == EOS
    return tok


@pytest.fixture(scope="module")
def compiler(json_tok):
    return GrammarCompiler(json_tok, json_tok.vocab_size + PAD, {EOS})


@pytest.fixture(scope="module")
def bias(json_tok):
    """The random model leans toward tokens that close strings, arrays and objects, so that decodes end."""
    closing = [any(c in json_tok.decode([i]) for c in '"]}') for i in range(json_tok.vocab_size)]
    return torch.tensor(closing + [False] * PAD) * 3.0


def decode(compiler, tok, spec, bias, seed, greedy, check_end=None, max_tokens=600):
    """Greedy or sampled decode of seeded random logits under the mask -> (text, token ids without eos).
    check_end(text) -> bool, when given, must say whether eos is allowed at every step."""
    matcher, bitmask, eos = compiler.matcher(spec), compiler.allocate_bitmask(2), compiler.eos_ids[0]
    generator = torch.Generator().manual_seed(seed)
    params = SamplingParams(temperature=0 if greedy else 1.0)
    ids: list[int] = []
    while not matcher.done:
        assert len(ids) < max_tokens, tok.decode(ids)
        matcher.fill(bitmask, 1)
        logits = torch.randn(2, compiler.vocab_size, generator=generator) + bias
        apply_bitmask(logits, bitmask, [1])
        assert torch.isfinite(logits[0]).all() and torch.isinf(logits[1, tok.vocab_size:]).all()
        if check_end is not None:
            assert torch.isfinite(logits[1, eos]).item() == check_end(tok.decode(ids)), tok.decode(ids)
        [token], _ = sample_rows(logits[1:], [params], [generator], [None], [None])
        assert matcher.accept(token)
        ids.append(token)
    if ids[-1] == eos:
        ids.pop()
    else:  # the grammar is complete: eos is all that is left
        matcher.fill(bitmask, 0)
        logits = torch.zeros(1, compiler.vocab_size)
        apply_bitmask(logits, bitmask[:1])
        assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == list(compiler.eos_ids)
        assert matcher.accept(eos) and matcher.done and not matcher.accept(eos)
    return tok.decode(ids), ids


def obj(properties: dict, required=None, **extra) -> dict:
    return {"type": "object", "properties": properties, "required": list(properties) if required is None else required,
            "additionalProperties": False, **extra}


SCHEMAS = [
    obj({"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0, "maximum": 150}}),
    obj({"user": obj({"id": {"type": "integer"}, "name": {"type": "string", "minLength": 1, "maxLength": 8}}),
         "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "minItems": 1, "maxItems": 3}}),
    obj({"items": {"type": "array", "items": obj({"sku": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
                                                   "qty": {"type": "number", "minimum": 0, "maximum": 100}}),
                   "minItems": 2, "maxItems": 4}}),
    obj({"role": {"enum": ["admin", "user", "guest"]}}),
    obj({"value": {"enum": ["a", 1, None, True, 2.5]}}),
    obj({"x": {"type": "number", "exclusiveMinimum": -1, "exclusiveMaximum": 1}}),
    obj({"n": {"type": "integer", "minimum": -10, "maximum": 10}, "m": {"type": "integer", "minimum": 1000}}),
    obj({"ok": {"type": "boolean"}, "nothing": {"type": "null"}}),
    obj({"code": {"type": "string", "minLength": 2, "maxLength": 5}}),
    obj({"id": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3}$"}, "hex": {"type": "string", "pattern": "^[0-9a-f]+$",
                                                                           "maxLength": 8}}),
    obj({"kind": {"const": "point"}, "x": {"type": "integer"}, "y": {"type": "integer"}}),
    obj({"either": {"anyOf": [{"type": "string", "maxLength": 4}, {"type": "integer"}]}}),
    obj({"flags": {"type": "array", "items": {"enum": ["r", "w", "x"]}, "maxItems": 3}}),
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 1, "maxItems": 5},
    obj({"a": obj({"b": obj({"c": obj({"d": {"type": "string", "maxLength": 3}})})})}),
    obj({"id": {"type": "integer"}, "nick": {"type": "string", "maxLength": 5}, "age": {"type": "integer"}},
        required=["id"]),
    {"$defs": {"point": obj({"x": {"type": "number"}, "y": {"type": "number"}})},
     **obj({"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}})},
    {"type": "array", "prefixItems": [{"type": "string", "maxLength": 4}, {"type": "integer"}, {"type": "boolean"}],
     "items": False, "minItems": 3},
    obj({"matrix": {"type": "array", "maxItems": 3,
                    "items": {"type": "array", "items": {"type": "number"}, "minItems": 1, "maxItems": 3}}}),
    obj({"date": {"type": "string", "format": "date"}}),
    obj({"maybe": {"type": ["string", "null"], "maxLength": 5}}),
    obj({"pets": {"type": "array", "maxItems": 3, "items": {"anyOf": [
        obj({"kind": {"const": "cat"}, "lives": {"type": "integer", "minimum": 1, "maximum": 9}}),
        obj({"kind": {"const": "dog"}, "good": {"type": "boolean"}})]}}}),
    {"type": "string", "pattern": "^(yes|no|maybe)$"},
    {"type": "integer", "minimum": 100, "maximum": 99999},
]


@pytest.mark.parametrize("schema", SCHEMAS, ids=[f"schema{i}" for i in range(len(SCHEMAS))])
def test_random_model_writes_valid_json_for_the_schema(compiler, json_tok, bias, schema):
    validator = jsonschema.Draft202012Validator(schema, format_checker=jsonschema.FormatChecker())

    def complete(text: str) -> bool:
        try:
            return validator.is_valid(json.loads(text))
        except ValueError:
            return False

    spec = GrammarSpec("json_schema", json.dumps(schema))
    for seed, greedy in [(0, True), (1, False), (2, False)]:
        text, _ = decode(compiler, json_tok, spec, bias, seed, greedy, check_end=complete)
        validator.validate(json.loads(text))


def test_json_object_is_any_json_object(compiler, json_tok, bias):
    for seed in range(6):
        text, _ = decode(compiler, json_tok, GrammarSpec("json_object"), bias, seed, greedy=seed % 2 == 0)
        assert isinstance(json.loads(text), dict)


@pytest.fixture(scope="module")
def tiny_compiler(tmp_path_factory):
    """The shared tiny Metaspace (SentencePiece-like) tokenizer, whose decoder llguidance needs rewritten."""
    path = tmp_path_factory.mktemp("tiny_tok")
    make_tokenizer(path)
    tok = Tokenizer(path)
    return GrammarCompiler(tok, tok.vocab_size + PAD, {EOS}), tok


def test_regex_and_choice(tiny_compiler):
    compiler, tok = tiny_compiler
    flat = torch.zeros(compiler.vocab_size)
    choices = ("hello world", "the lazy dog", "fox")
    regex = r"the (quick|lazy) (fox|dog)!?"
    seen = set()
    for seed in range(8):
        text, _ = decode(compiler, tok, GrammarSpec("choice", choices), flat, seed, greedy=seed % 2 == 0)
        assert text in choices
        seen.add(text)
        text, _ = decode(compiler, tok, GrammarSpec("regex", regex), flat, seed, greedy=seed % 2 == 0)
        assert text.removesuffix("!") in ("the quick fox", "the quick dog", "the lazy fox", "the lazy dog")
    assert len(seen) > 1


def allowed(matcher) -> list[int]:
    bitmask = matcher.compiler.allocate_bitmask(1)
    matcher.fill(bitmask)
    logits = torch.zeros(1, matcher.compiler.vocab_size)
    apply_bitmask(logits, bitmask)
    return torch.isfinite(logits[0]).nonzero().flatten().tolist()


def test_eos_and_stop_ids_exactly_where_the_grammar_can_end(tiny_compiler):
    compiler, tok = tiny_compiler
    stop = tok.token_id("x")
    # the SentencePiece-style encoder starts a text with a space: " hello"
    m = compiler.matcher(GrammarSpec("regex", " hello( world)?"), stop_ids=[stop])
    assert EOS not in allowed(m) and stop not in allowed(m) and not m.done
    assert not m.accept(EOS) and not m.accept(stop)
    hello, world = tok.encode("hello", add_special_tokens=False), tok.encode("world", add_special_tokens=False)
    assert m.validate(hello + [stop]) == len(hello) + 1 and m.validate(hello[:-1] + [EOS]) == len(hello) - 1
    assert all(m.accept(t) for t in hello)
    assert EOS in allowed(m) and stop in allowed(m) and len(allowed(m)) > 2 and not m.done
    assert all(m.accept(t) for t in world)
    assert allowed(m) == sorted([EOS, stop]) and m.done
    assert m.validate([stop]) == 1 and m.validate([EOS, EOS]) == 1
    assert m.accept(stop) and m.done and not m.accept(EOS) and m.validate([EOS]) == 0
    m.rollback(1 + len(world))
    assert not m.done and EOS in allowed(m)


def test_rollback_validate_and_rejected_tokens(tiny_compiler):
    compiler, tok = tiny_compiler
    m = compiler.matcher(GrammarSpec("regex", "the (quick|lazy) (fox|dog)"))
    states, wrong = [allowed(m)], tok.token_id("x")
    assert m.validate([wrong]) == 0
    # "the" without the leading space the SentencePiece-style encoder puts on it
    proposal = [tok.token_id("the")] + tok.encode(" lazy dog", add_special_tokens=False)
    assert m.validate(proposal + [EOS]) == len(proposal) + 1
    assert m.validate(proposal[:2] + [wrong] + proposal[2:]) == 2
    assert allowed(m) == states[0]  # validate changed nothing
    for t in proposal:
        assert m.accept(t)
        states.append(allowed(m))
    assert not m.accept(wrong) and allowed(m) == states[-1]  # a rejected token changes nothing
    m.rollback(2)
    assert allowed(m) == states[-3]
    m.rollback(len(proposal) - 2)
    assert allowed(m) == states[0]
    for t in proposal + [EOS]:
        assert m.accept(t)
    assert m.done


def test_fork_continues_independently(tiny_compiler):
    compiler, tok = tiny_compiler
    m = compiler.matcher(GrammarSpec("choice", (" the lazy dog", " the lazy fox")))
    assert all(m.accept(t) for t in tok.encode("the lazy", add_special_tokens=False))
    f = m.fork()
    dog, fox = tok.encode("dog", add_special_tokens=False), tok.encode("fox", add_special_tokens=False)
    assert all(m.accept(t) for t in dog) and all(f.accept(t) for t in fox)
    assert m.done and f.done
    assert not m.accept(fox[0])


@pytest.mark.parametrize("kind,value,message", [
    ("json_schema", '{"type": "foo"}', "invalid json_schema: .*foo"),
    ("json_schema", '{"type": "object", "properties": ', "invalid json_schema"),
    ("json_schema", '{"type": "string", "pattern": "(("}', "invalid json_schema: .*unclosed group"),
    ("regex", "(ab", "invalid regex: .*unclosed group"),
    ("regex", r"(a)\1", "invalid regex: .*backreferences"),
    ("grammar", "start: missing", "invalid grammar: .*missing"),
    ("grammar", 'root ::= "a" | b', "invalid grammar: .*'b'"),
    ("choice", (), "choice needs"),
    ("regex", "", "regex needs"),
    ("yaml", "a: 1", "grammar kind must be one of"),
])
def test_invalid_specs_raise_one_line_errors(compiler, kind, value, message):
    with pytest.raises(LeanLMError, match=message) as e:
        compiler.compile(GrammarSpec(kind, value))
    assert "\n" not in str(e.value)


def test_lark_and_gbnf_grammars(tiny_compiler):
    compiler, tok = tiny_compiler
    flat = torch.zeros(compiler.vocab_size)
    lark = 'start: animal (" and " animal)?\nanimal: "fox" | "dog"'
    gbnf = 'root ::= animal (" and " animal)?\nanimal ::= "fox" | "dog"'
    for grammar in (lark, gbnf):
        for seed in range(3):
            text, _ = decode(compiler, tok, GrammarSpec("grammar", grammar), flat, seed, greedy=False)
            assert all(word in ("fox", "dog") for word in text.split(" and ")), text


def test_compile_cache_hits_and_evicts(json_tok):
    compiler = GrammarCompiler(json_tok, json_tok.vocab_size, {EOS}, cache_size=2)
    a = GrammarSpec("json_schema", {"type": "object", "properties": {"a": {"type": "integer"}}})
    same = GrammarSpec("json_schema", json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}}))
    assert a == same and hash(a) == hash(same)
    assert GrammarSpec("choice", ["x", "y"]) == GrammarSpec("choice", ("x", "y"))
    compiler.matcher(a)
    compiler.matcher(same)
    assert (compiler.hits, compiler.misses) == (1, 1)
    compiler.compile(GrammarSpec("regex", "a+"))
    compiler.compile(GrammarSpec("regex", "b+"))  # evicts the schema, the least recently used
    compiler.compile(a)
    assert (compiler.hits, compiler.misses) == (1, 4)


def test_batch_fill_in_parallel_matches_one_by_one(json_tok, compiler):
    threaded = GrammarCompiler(json_tok, json_tok.vocab_size + PAD, {EOS}, threads=2)
    specs = [GrammarSpec("json_schema", json.dumps(s)) for s in SCHEMAS[:6]] + [GrammarSpec("json_object")]
    one, many = [compiler.matcher(s) for s in specs], [threaded.matcher(s) for s in specs]
    prefix = json_tok.encode('{"', add_special_tokens=False)
    for m in one[:3] + many[:3]:
        assert all(m.accept(t) for t in prefix)
    rows = [6, 0, 1, 2, 3, 4, 5]
    a, b = compiler.allocate_bitmask(7), threaded.allocate_bitmask(7)
    compiler.fill(one, a, rows)
    threaded.fill(many, b, rows)
    assert torch.equal(a, b) and not torch.equal(a[0], a[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_bitmask_matches_a_plain_loop(dtype):
    g = torch.Generator().manual_seed(0)
    vocab, rows = 77, [3, 0]
    bitmask = torch.randint(-2**31, 2**31 - 1, (4, 3), dtype=torch.int32, generator=g)
    logits = torch.randn(4, vocab + 5, generator=g).to(dtype)  # wider than the bitmask's 96 ids
    expected = logits.clone()
    for r in rows:
        for t in range(vocab + 5):
            if t >= 96 or not (int(bitmask[r, t // 32]) >> (t % 32)) & 1:
                expected[r, t] = float("-inf")
    got = logits.clone()
    apply_bitmask(got, bitmask, rows)
    assert torch.equal(got, expected)
    got = logits[:, :vocab].clone()
    apply_bitmask(got, bitmask)
    everything = [[t for t in range(vocab) if (int(bitmask[r, t // 32]) >> (t % 32)) & 1] for r in range(4)]
    assert [torch.isfinite(row).nonzero().flatten().tolist() for row in got] == everything


@pytest.mark.real_model
@pytest.mark.parametrize("name", ["smollm2-135m", "qwen2.5-coder-0.5b"])
def test_real_tokenizers(name):
    from leanlm.fetch import cache_dir
    from leanlm.models.config import ModelConfig
    from leanlm.models.zoo import pull

    path = pull(name, progress=False) if name == "smollm2-135m" else cache_dir() / "models" / name
    if not (path / "tokenizer.json").is_file():
        pytest.skip(f"{name} is not in the zoo cache")
    tok = Tokenizer(path)
    vocab = ModelConfig.from_dir(path).vocab_size
    compiler = GrammarCompiler(tok, vocab, {tok.eos_token_id})
    schema = SCHEMAS[2]
    spec = GrammarSpec("json_schema", json.dumps(schema))
    for seed in range(2):
        text, ids = decode(compiler, tok, spec, torch.zeros(vocab), seed, greedy=seed == 0)
        jsonschema.validate(json.loads(text), schema)
    real = tok.encode(json.dumps({"items": [{"sku": "AB-123", "qty": 2.5}, {"sku": "CD-456", "qty": 0}]}),
                      add_special_tokens=False)
    assert compiler.matcher(spec).validate(real + [tok.eos_token_id]) == len(real) + 1
