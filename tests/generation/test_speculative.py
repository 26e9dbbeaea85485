import pytest
import torch

from leanlm.generation.decode import generate_ids
from leanlm.generation.sampling import SamplingParams, probabilities
from leanlm.generation.speculative import (DraftProposer, LookupProposer, SpecStats, choose_k, predicted_speedup,
                                           speculative_generate, verify)
from leanlm.models.loading import load_model
from tests.conftest import make_hf_model

CHI2_DF7_P001 = 24.32  # chi-square critical value, 7 degrees of freedom, p = 0.001


def chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def run(target, prompt, params, proposer, k):
    stats = SpecStats(k)
    out = [t for step in speculative_generate(target, prompt, params, proposer, k, stats=stats) for t in step]
    return out, stats


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    target_dir, draft_dir = tmp_path_factory.mktemp("target"), tmp_path_factory.mktemp("draft")
    make_hf_model("llama", target_dir, seed=0)
    make_hf_model("llama", draft_dir, seed=1, num_hidden_layers=1)
    target, draft = load_model(target_dir, torch.float32), load_model(draft_dir, torch.float32)
    with torch.no_grad():  # a draft that mostly agrees with the target, so some proposals are accepted
        draft.lm_head.weight = torch.nn.Parameter(target.lm_head.weight.clone())
        draft.embed_tokens.weight = draft.lm_head.weight
    return target, draft


def plain_greedy(target, prompt, n):
    return [t[0] for t in generate_ids(target, [prompt], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))]


@pytest.mark.parametrize("k", [1, 2, 3, 5, 8])
def test_greedy_draft_equals_target_greedy(models, k):
    target, draft = models
    for prompt in ([5, 9, 11, 3], [7, 7, 7, 7, 7, 7], list(range(20, 45))):
        params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
        out, stats = run(target, prompt, params, DraftProposer(draft, 80, params), k)
        assert out == plain_greedy(target, prompt, 20)
        assert len(out) == 20 and stats.target_forwards == 19 - sum(stats.accepted)


@pytest.mark.parametrize("k", [1, 4, 8])
def test_greedy_prompt_lookup_equals_target_greedy(models, k):
    target, _ = models
    prompt = [5, 9, 11, 3, 5, 9, 11, 3, 5, 9, 12, 4, 5, 9]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    out, stats = run(target, prompt, params, LookupProposer(ngram=3), k)
    assert out == plain_greedy(target, prompt, 24)
    assert sum(stats.reached) > 0


def test_lookup_proposes_what_followed_the_latest_match():
    lookup = LookupProposer(reference=[1, 2, 3, 4, 5], ngram=2)
    assert lookup.propose([9, 2, 3, 8, 7, 2, 3], 3, SpecStats(3))[0] == [8, 7, 2]  # from the sequence itself
    assert lookup.propose([9, 3, 4], 2, SpecStats(2))[0] == [5]  # from the reference
    assert lookup.propose([9, 8], 2, SpecStats(2))[0] == []


def wrong_verify(q, proposal, p, greedy, generator=None):
    """Accepts every proposal: the draft's distribution leaks into the output."""
    k = len(proposal)
    return k, int(torch.multinomial(q[k], 1, generator=generator))


@pytest.mark.parametrize("rule,exact", [(verify, True), (wrong_verify, False)])
def test_rejection_sampling_reproduces_the_target(rule, exact):
    g = torch.Generator().manual_seed(0)
    q = torch.tensor([[0.05, 0.3, 0.1, 0.2, 0.05, 0.1, 0.15, 0.05], [1 / 8] * 8])
    p = torch.tensor([[0.4, 0.05, 0.2, 0.05, 0.1, 0.05, 0.05, 0.1]])
    counts = torch.zeros(8)
    for _ in range(6000):
        x = int(torch.multinomial(p[0], 1, generator=g))
        n, nxt = rule(q, [x], p, False, g)
        counts[x if n == 1 else nxt] += 1
    assert (chi2(counts, q[0]) < CHI2_DF7_P001) == exact


def test_sampled_speculative_tokens_follow_the_target(tmp_path):
    make_hf_model("llama", tmp_path / "t", seed=0, vocab_size=8)
    make_hf_model("llama", tmp_path / "d", seed=3, vocab_size=8, num_hidden_layers=1)
    target, draft = load_model(tmp_path / "t", torch.float32), load_model(tmp_path / "d", torch.float32)
    prompt = [1, 5, 2]
    params = SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True)
    # exact marginal of the second generated token under the target alone
    with torch.no_grad():
        q1 = probabilities(target(torch.tensor([prompt]), torch.arange(3)[None])[0, -1:], params)[0]
        seqs = torch.tensor([prompt + [t] for t in range(8)])
        q2 = probabilities(target(seqs, torch.arange(4)[None].expand(8, -1))[:, -1], params)
        marginal = (q1[:, None] * q2).sum(0)
    counts = torch.zeros(8)
    for seed in range(1500):
        p = SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True, seed=seed)
        out, _ = run(target, prompt, p, DraftProposer(draft, 16, p), 2)
        counts[out[1]] += 1
    assert chi2(counts, marginal) < CHI2_DF7_P001


def test_speedup_formula_and_k_choice():
    assert predicted_speedup(0.0, 4, 0.0) == pytest.approx(1.0)
    assert predicted_speedup(1.0, 4, 0.0) == pytest.approx(5.0)
    assert predicted_speedup(0.8, 4, 0.1) == pytest.approx((1 - 0.8**5) / (0.2 * 1.4))
    assert choose_k(0.0) == 8 and choose_k(0.5) < choose_k(0.05)
