"""Draft-model speculation in the engine: greedy output equals the target's alone (batched, chunked, preempted);
sampled output follows the target's distribution (exact rejection sampling)."""

import pytest
import torch

from tests.conftest import make_hf_model, make_tokenizer
from tests.engine.test_engine import blocks_for, one_by_one, prompts, repetitive
from tests.generation.test_speculative import CHI2_DF7_P001, chi2

from leanlm.engine import Engine, EngineConfig, LLM
from leanlm.errors import LeanLMError
from leanlm.generation.sampling import SamplingParams, probabilities
from leanlm.models.loading import load_model
from leanlm.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(target, its tokenizer, a one-layer draft sharing its embeddings, so that it mostly agrees)."""
    target_dir, draft_dir = tmp_path_factory.mktemp("target"), tmp_path_factory.mktemp("draft")
    make_hf_model("llama", target_dir, seed=0, max_position_embeddings=512)
    make_hf_model("llama", draft_dir, seed=1, num_hidden_layers=1, max_position_embeddings=512)
    make_tokenizer(target_dir)
    target, draft = load_model(target_dir, torch.float32), load_model(draft_dir, torch.float32)
    with torch.no_grad():
        draft.lm_head.weight = torch.nn.Parameter(target.lm_head.weight.clone())
        draft.embed_tokens.weight = draft.lm_head.weight
    return target, Tokenizer(target_dir), draft


def run(engine: Engine, ps, params) -> list[list[int]]:
    seqs = [engine.add_request(str(i), p, params)[0] for i, p in enumerate(ps)]
    while engine.has_work:
        engine.step()
    return [s.output_ids for s in seqs]


@pytest.mark.parametrize("blocks,preempts", [(None, False), (60, True)])
def test_greedy_with_a_draft_equals_the_target_alone(pair, blocks, preempts):
    target, tok, draft = pair
    ps = repetitive(6, seed=4) + prompts(6)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    memory = 1 << 24 if blocks is None else blocks_for(target, blocks) + blocks_for(draft, blocks)
    engine = Engine(target, tok, EngineConfig(block_size=4, kv_cache_memory=memory, draft=draft, num_speculative=3,
                                              max_num_batched_tokens=48))
    assert run(engine, ps, params) == one_by_one(target, ps, params)
    assert 0 < engine.spec_accepted <= engine.spec_proposed and engine.spec_drafts > 0
    assert sum(engine.spec_accepted_per_pos) == engine.spec_accepted
    assert (engine.scheduler.num_preemptions > 0) == preempts
    assert engine.blocks.num_free == engine.blocks.num_blocks


def test_sampled_tokens_with_a_draft_follow_the_target(tmp_path):
    make_hf_model("llama", tmp_path / "t", seed=0, vocab_size=8)
    make_hf_model("llama", tmp_path / "d", seed=3, vocab_size=8, num_hidden_layers=1)
    make_tokenizer(tmp_path / "t")
    target, draft = load_model(tmp_path / "t", torch.float32), load_model(tmp_path / "d", torch.float32)
    prompt = [1, 5, 3]
    params = SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True)
    with torch.no_grad():  # the exact marginal of the second generated token under the target alone
        q1 = probabilities(target(torch.tensor([prompt]), torch.arange(3)[None])[0, -1:], params)[0]
        seqs = torch.tensor([prompt + [t] for t in range(8)])
        q2 = probabilities(target(seqs, torch.arange(4)[None].expand(8, -1))[:, -1], params)
        marginal = (q1[:, None] * q2).sum(0)
    engine = Engine(target, Tokenizer(tmp_path / "t"), EngineConfig(block_size=4, kv_cache_memory=1 << 24,
                                                                    draft=draft, num_speculative=2))
    counts = torch.zeros(8)
    for seed in range(0, 1500, 250):  # 250 sequences per batch, each with its own seed
        seqs = [engine.add_request(str(s), prompt, SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True,
                                                                  seed=s))[0] for s in range(seed, seed + 250)]
        while engine.has_work:
            engine.step()
        for s in seqs:
            counts[s.output_ids[1]] += 1
    assert engine.spec_drafts > 0 and engine.spec_proposed > engine.spec_accepted > 0  # some rejected
    assert chi2(counts, marginal) < CHI2_DF7_P001


def test_a_draft_with_another_vocabulary_or_beside_prompt_lookup_is_refused(pair, tiny_dir):
    target, tok, draft = pair
    with pytest.raises(LeanLMError, match="not both"):
        Engine(target, tok, EngineConfig(kv_cache_memory=1 << 24, draft=draft, prompt_lookup=3))
    make_tokenizer(tiny_dir, vocab_size=50)  # another vocabulary
    with pytest.raises(LeanLMError, match="tokenizer is not the target's"):
        LLM(target, tok, quiet=True, kv_cache_memory=1 << 24, draft=str(tiny_dir))


def test_a_draft_under_a_grammar_proposes_only_what_it_allows(pair):
    """Constrained drafting: every proposal fits the grammar, so the greedy output is the one without a draft."""
    import re

    from leanlm.generation.grammar import GrammarSpec

    target, tok, draft = pair
    foxes = "(the quick brown fox ){2,6}"
    params = SamplingParams(temperature=0, max_tokens=80, grammar=GrammarSpec("regex", foxes))
    ps = [f"the quick brown fox {i}" for i in range(4)]
    outputs = []
    for options in ({}, {"draft": draft, "num_speculative": 3}):
        llm = LLM(target, tok, quiet=True, kv_cache_memory=1 << 24, **options)
        outputs.append([o.outputs[0].text for o in llm.generate(ps, params, progress=False)])
    assert outputs[0] == outputs[1] and all(re.fullmatch(foxes, t) for t in outputs[1])
    assert llm.engine.spec_accepted > 0
