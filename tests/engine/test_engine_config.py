"""EngineConfig: every engine option checked once, with one clear message, before anything is loaded or allocated."""

import dataclasses

import pytest

from leanlm.engine import LLM, Engine, EngineConfig
from leanlm.engine.config import OFFLINE_BATCHED_TOKENS, engine_config
from leanlm.errors import LeanLMError


@pytest.mark.parametrize("options,message", [
    (dict(kv_cache="16"), "use auto"),
    (dict(kv_cache="fp8"), "kv_cache must be auto"),
    (dict(kv_cache_memory="lots"), "memory size 'lots'"),
    (dict(kv_cache_memory=0), "memory size 0"),
    (dict(block_size=0), "block_size must be an integer >= 1"),
    (dict(max_num_seqs=0), "max_num_seqs must be an integer >= 1"),
    (dict(max_num_batched_tokens=-4), "max_num_batched_tokens must be"),
    (dict(prompt_lookup=-1), "prompt_lookup must be an integer >= 0"),
    (dict(num_speculative=1.5), "num_speculative must be an integer"),
    (dict(draft="some-model", prompt_lookup=3), "not both"),
])
def test_bad_options_are_refused_with_one_clear_message(options, message):
    with pytest.raises(LeanLMError, match=message):
        EngineConfig(**options)


def test_keyword_options_build_a_frozen_config():
    config = EngineConfig(block_size=4)
    assert engine_config(config, kv_cache="int8") == EngineConfig(block_size=4, kv_cache="int8")
    assert engine_config() == EngineConfig() and engine_config(config) is config
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.block_size = 8
    with pytest.raises(LeanLMError, match="did you mean kv_cache"):  # the old spelling
        engine_config(kv_cache_dtype="int8")
    with pytest.raises(LeanLMError, match="unknown engine option 'colour'"):
        engine_config(colour="red")


def test_llm_takes_a_config_or_its_fields(tiny):
    model, tok = tiny
    llm = LLM(model, tok, config=EngineConfig(block_size=4, kv_cache_memory=1 << 22), quiet=True, kv_cache="int8")
    assert llm.engine.config == EngineConfig(block_size=4, kv_cache_memory=1 << 22, kv_cache="int8")
    assert llm.engine.pool.int8 and llm.engine.pool.block_size == 4
    with pytest.raises(LeanLMError, match="max_num_seqs"):
        LLM(model, tok, quiet=True, max_num_seqs=0)
    with pytest.raises(LeanLMError, match="loaded draft model"):  # LLM loads a draft by name; Engine does not
        Engine(model, tok, EngineConfig(draft="smollm2-135m"))


def test_llm_without_a_config_takes_the_offline_step_budget(tiny):
    model, tok = tiny
    memory = dict(kv_cache_memory=1 << 22)
    assert LLM(model, tok, quiet=True, **memory).engine.config.max_num_batched_tokens == OFFLINE_BATCHED_TOKENS
    assert OFFLINE_BATCHED_TOKENS != EngineConfig().max_num_batched_tokens
    assert LLM(model, tok, quiet=True, max_num_batched_tokens=64, **memory).engine.config.max_num_batched_tokens == 64
    given = LLM(model, tok, config=EngineConfig(**memory), quiet=True)  # a config says what it wants
    assert given.engine.config.max_num_batched_tokens == EngineConfig().max_num_batched_tokens
