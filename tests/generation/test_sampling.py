import pytest
import torch

from leanlm.errors import LeanLMError
from leanlm.generation.sampling import SamplingParams, probabilities, sample


def naive(logits, temperature, top_k, top_p):
    """Straight from the definitions, one token at a time: top-k, renormalise, then top-p."""
    p = (logits / temperature).softmax(-1)
    order = sorted(range(len(p)), key=lambda i: -p[i].item())
    keep = order[:top_k] if top_k else order
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
