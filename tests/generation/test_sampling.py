import pytest
import torch

from leanlm.errors import LeanLMError
from leanlm.generation.sampling import SamplingParams, probabilities, sample, sample_rows


def naive(logits, temperature, top_k, top_p, min_p=0.0):
    """Straight from the definitions, one token at a time: top-k, renormalise, min-p, renormalise, then top-p."""
    p = (logits / temperature).softmax(-1)
    order = sorted(range(len(p)), key=lambda i: -p[i].item())
    keep = order[:top_k] if top_k else order
    p = p / p[keep].sum()
    keep = [i for i in keep if p[i] >= min_p * p[keep].max()]
    p = p / p[keep].sum()
    kept, mass = [], 0.0
    for i in keep:
        kept.append(i)
        mass += p[i].item()
        if mass >= top_p:
            break
    out = torch.zeros_like(p)
    out[kept] = p[kept]
    return out / out.sum()


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (0.9, 10, 0.5)])
def test_probabilities_match_definition(temperature, top_k, top_p):
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(0)) * 3
    ours = probabilities(logits, SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p))
    for row in range(3):
        assert torch.allclose(ours[row], naive(logits[row], temperature, top_k, top_p), atol=1e-6)


def test_greedy_is_argmax_and_seed_repeats():
    logits = torch.randn(4, 50)
    assert torch.equal(sample(logits, SamplingParams(temperature=0)), logits.argmax(-1))
    p = SamplingParams(temperature=1.0)
    a = sample(logits, p, torch.Generator().manual_seed(7))
    b = sample(logits, p, torch.Generator().manual_seed(7))
    assert torch.equal(a, b)


def test_samples_follow_the_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    params = SamplingParams(temperature=1.0, top_k=3)
    g = torch.Generator().manual_seed(0)
    draws = torch.stack([sample(logits, params, g) for _ in range(4000)]).flatten()
    freq = torch.bincount(draws, minlength=4).float() / len(draws)
    assert freq[3] == 0
    assert torch.allclose(freq, probabilities(logits, params)[0], atol=0.03)


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_k=-1), dict(top_p=0), dict(top_p=1.5), dict(max_tokens=0)])
def test_invalid_params(bad):
    with pytest.raises(LeanLMError):
        SamplingParams(**bad)


def seeded(seed):
    return torch.Generator().manual_seed(seed)


def penalised(logits, history, penalty):
    """CTRL's repetition penalty, one seen token at a time."""
    out = logits.clone()
    for t in set(history):
        out[t] = out[t] / penalty if out[t] > 0 else out[t] * penalty
    return out


@pytest.mark.parametrize("temperature,top_k,top_p,min_p",
                         [(1.0, 0, 1.0, 0.1), (0.7, 5, 1.0, 0.3), (1.3, 0, 0.8, 0.05), (0.9, 10, 0.6, 0.2),
                          (1.0, 0, 1.0, 1.0)])
def test_min_p_matches_definition(temperature, top_k, top_p, min_p):
    logits = torch.randn(3, 40, generator=seeded(1)) * 3
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    ours = probabilities(logits, params)
    for row in range(3):
        assert torch.allclose(ours[row], naive(logits[row], temperature, top_k, top_p, min_p), atol=1e-6)


def test_repetition_penalty_matches_definition():
    logits = torch.tensor([[3.0, 2.9, -1.0, -1.1, 0.5, 0.0]])
    history = [0, 2, 0, 5]  # a repeat, a positive, a negative and a zero logit
    before = logits.clone()
    for penalty in (1.5, 0.8):
        want = penalised(logits[0], history, penalty)
        greedy = SamplingParams(temperature=0, repetition_penalty=penalty)
        assert sample_rows(logits, [greedy], [None], [history], [None])[0] == [want.argmax().item()]
        params = SamplingParams(temperature=1.0, repetition_penalty=penalty)
        ours = [sample_rows(logits, [params], [seeded(s)], [history], [None])[0][0] for s in range(20)]
        assert ours == [sample(want[None], params, seeded(s)).item() for s in range(20)]
    assert torch.equal(logits, before)  # the caller's logits are left alone


def test_banned_ids_are_never_drawn():
    logits = torch.tensor([[0.0, 5.0, 3.0, 1.0, 4.9]])
    assert sample_rows(logits, [SamplingParams(temperature=0)], [None], [None], [[1, 4, 99]])[0] == [2]
    rows = 200
    params = [SamplingParams(temperature=2.0)] * rows
    ids, _ = sample_rows(logits.expand(rows, -1), params, [seeded(0)] + [None] * (rows - 1), [None] * rows,
                         [{1, 4}] * rows)
    assert not {1, 4} & set(ids) and len(set(ids)) == 3


def test_logprobs_are_the_raw_distribution():
    logits = torch.randn(2, 30, generator=seeded(2)).bfloat16()
    params = [SamplingParams(temperature=0.7, top_k=3, repetition_penalty=1.3, logprobs=4),
              SamplingParams(temperature=0, logprobs=0)]
    ids, lps = sample_rows(logits, params, [seeded(0), None], [[1, 2, 3], None], [None, None])
    raw = logits.float().log_softmax(-1)
    for row, (token, lp) in enumerate(zip(ids, lps)):
        assert lp.token == token and lp.logprob == pytest.approx(raw[row, token].item())
        k = params[row].logprobs
        assert [t for t, _ in lp.top] == raw[row].topk(k).indices.tolist()
        assert [v for _, v in lp.top] == pytest.approx(raw[row].topk(k).values.tolist())
    assert [v for _, v in lps[0].top] == sorted((v for _, v in lps[0].top), reverse=True)
    assert sample_rows(logits, [SamplingParams()] * 2, [None] * 2, [None] * 2, [None] * 2)[1] == [None, None]


def test_rows_are_independent_of_their_neighbours():
    logits = torch.randn(6, 50, generator=seeded(3)) * 2
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.8, top_p=0.9),
              SamplingParams(temperature=0.8, top_p=0.9), SamplingParams(temperature=0, repetition_penalty=2.0),
              SamplingParams(temperature=1.2, min_p=0.05, top_k=20, logprobs=2), SamplingParams(temperature=1.0)]
    histories = [None, None, [4, 5], list(range(25)), [7], None]
    banned = [None, [0, 1], None, None, [2], None]
    for trial in range(5):
        seeds = [None, 10 + trial, 20 + trial, None, 30 + trial, None]
        gens = [None if s is None else seeded(s) for s in seeds]
        ids, lps = sample_rows(logits, params, gens, histories, banned)
        for i in range(6):
            if i == 5:
                continue  # unseeded: its draw is torch's default generator's, not repeatable
            gen = None if seeds[i] is None else seeded(seeds[i])
            alone = sample_rows(logits[i:i + 1], [params[i]], [gen], [histories[i]], [banned[i]])
            assert (ids[i], lps[i]) == (alone[0][0], alone[1][0])
        # no penalty and nothing banned: the same draw as sample() with the same seed
        assert ids[2] == sample(logits[2:3], params[2], seeded(seeds[2])).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_all_greedy_is_one_argmax(dtype):
    logits = torch.randn(16, 100, generator=seeded(4)).to(dtype)
    ids, lps = sample_rows(logits, [SamplingParams(temperature=0)] * 16, [None] * 16, [[1, 2]] * 16, [None] * 16)
    assert ids == logits.argmax(-1).tolist() and lps == [None] * 16


def test_new_fields_keep_old_defaults_and_normalise():
    p = SamplingParams(stop_token_ids=[3, 7], seed=5)
    assert (p.min_p, p.repetition_penalty, p.min_tokens, p.n, p.logprobs) == (0.0, 1.0, 0, 1, None)
    assert p.stop_token_ids == (3, 7) and p.seed == 5
    assert SamplingParams(stop_token_ids=2).stop_token_ids == (2,)
    assert SamplingParams(min_tokens=4, max_tokens=4, logprobs=20, n=3).logprobs == 20


@pytest.mark.parametrize("bad", [dict(min_p=-0.1), dict(min_p=1.5), dict(min_p=float("nan")),
                                 dict(repetition_penalty=0), dict(repetition_penalty=-1.0),
                                 dict(repetition_penalty=float("inf")), dict(stop_token_ids=[-1]),
                                 dict(stop_token_ids=["a"]), dict(stop_token_ids=[1.5]), dict(min_tokens=-1),
                                 dict(min_tokens=5, max_tokens=4), dict(min_tokens=1.5), dict(n=0), dict(n=2.0),
                                 dict(logprobs=-1), dict(logprobs=21), dict(logprobs=True), dict(seed="7"),
                                 dict(seed=1.5)])
def test_invalid_new_params_name_the_field(bad):
    with pytest.raises(LeanLMError, match=next(iter(bad))):
        SamplingParams(**bad)
