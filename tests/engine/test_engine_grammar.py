"""Structured outputs in the engine: the grammar holds through batching, preemption, n > 1 and prompt lookup, offline
and from `leanlm generate`."""

import json
import re
import subprocess

import pytest

from leanlm.bench.serve import leanlm_command
from leanlm.cache.paged import KVPool
from leanlm.engine import LLM
from leanlm.errors import LeanLMError
from leanlm.generation.grammar import GrammarSpec
from leanlm.generation.sampling import SamplingParams

FOXES = "(the quick brown fox ){2,6}"
PROMPTS = [f"the quick brown fox the quick brown fox {i}" for i in range(10)]


def run(tiny, params, **options) -> tuple[list, LLM]:
    llm = LLM(*tiny, quiet=True, **{"kv_cache_memory": 1 << 22, **options})
    return llm.generate(PROMPTS, params, progress=False), llm


def texts(outputs) -> list[list[str]]:
    return [[c.text for c in o.outputs] for o in outputs]


def test_greedy_under_a_grammar_is_the_same_with_prompt_lookup_and_under_preemption(tiny):
    params = SamplingParams(temperature=0, max_tokens=80, grammar=GrammarSpec("regex", FOXES))
    plain, _ = run(tiny, params)
    assert all(re.fullmatch(FOXES, t) for (t,) in texts(plain))
    lookup, llm = run(tiny, params, prompt_lookup=2)
    assert texts(lookup) == texts(plain) and llm.engine.spec_accepted > 0  # drafted tokens checked by the grammar
    block = KVPool.bytes_per_block(tiny[0].config, 4, tiny[0].dtype)
    pressed, llm = run(tiny, params, block_size=4, kv_cache_memory=40 * block)
    assert texts(pressed) == texts(plain) and llm.engine.scheduler.num_preemptions > 0  # the matcher state survives


def test_sampled_completions_each_keep_to_the_grammar(tiny):
    params = SamplingParams(temperature=1.5, max_tokens=40, n=3, seed=7,
                            grammar=GrammarSpec("choice", ("the quick fox", "the lazy dog", "hello there")))
    outputs, _ = run(tiny, params, prompt_lookup=2)
    assert all(t in ("the quick fox", "the lazy dog", "hello there") for row in texts(outputs) for t in row)
    free = SamplingParams(temperature=1.5, max_tokens=40, n=3, seed=7, grammar=GrammarSpec("regex", "[a-z]{12}"))
    outputs, _ = run(tiny, free)
    assert all(re.fullmatch("[a-z]{12}", t) for row in texts(outputs) for t in row)
    assert all(len(set(row)) > 1 for row in texts(outputs))  # each completion its own draws, from forked matchers


def test_an_invalid_grammar_is_refused_before_anything_runs(tiny):
    llm = LLM(*tiny, quiet=True, kv_cache_memory=1 << 22)
    with pytest.raises(LeanLMError, match="invalid json_schema"):
        llm.generate(PROMPTS, SamplingParams(grammar=GrammarSpec("json_schema", '{"type": "objekt"}')))
    assert not llm.engine.has_work


def test_leanlm_generate_regex_and_a_per_line_field_of_a_file(tiny_dir, tmp_path):
    def leanlm(*args):
        return subprocess.run(leanlm_command(*map(str, args)), capture_output=True, text=True)

    common = ("--threads", "1", "--dtype", "float32", "--max-tokens", "60")
    r = leanlm("generate", tiny_dir, "the quick brown fox", "--regex", FOXES, *common)
    assert r.returncode == 0, r.stderr
    assert re.fullmatch(FOXES, r.stdout.rstrip("\n"))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "hello", "choice": ["hello there", "the lazy dog"]}) + "\n"
                       + json.dumps({"prompt": "the", "regex": "(the ){1,5}"}) + "\n")
    r = leanlm("generate", tiny_dir, "--file", prompts, *common)
    assert r.returncode == 0, r.stderr
    first, second = (json.loads(line)["completions"][0]["text"] for line in r.stdout.splitlines())
    assert first in ("hello there", "the lazy dog") and re.fullmatch("(the ){1,5}", second)
    prompts.write_text(json.dumps({"prompt": "x", "regex": "a", "choice": ["b"]}) + "\n")
    r = leanlm("generate", tiny_dir, "--file", prompts)
    assert r.returncode == 2 and "line 1: give one structured-output constraint" in r.stderr
