"""The default zoo model against transformers on the same converted weights (pulled on first use)."""

import math

import pytest
import torch

from leanlm.eval.datasets import builtin_text
from leanlm.eval.perplexity import perplexity, windows
from leanlm.generation.decode import decode_step, prefill
from leanlm.models.loading import load_model
from leanlm.models.zoo import DEFAULT_MODEL, pull

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def pair():
    from transformers import AutoModelForCausalLM

    path = pull(DEFAULT_MODEL, progress=False)
    ours = load_model(path, torch.float32)
    theirs = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    from leanlm.tokenizer import Tokenizer

    return ours, theirs, Tokenizer(path)


def test_logits_match_transformers(pair):
    ours, theirs, tok = pair
    ids = torch.tensor([tok.encode("The capital of France is Paris, and the capital of Italy is")])
    a = ours(ids, torch.arange(ids.shape[1])[None])
    with torch.no_grad():
        b = theirs(ids).logits
    assert (a - b).abs().max() < 1e-3
    assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_cached_greedy_equals_full_recompute(pair):
    ours, _, tok = pair
    prompt = tok.encode("def fibonacci(n):")
    logits, cache = prefill(ours, [prompt], 24)
    cached = [int(logits.argmax(-1))]
    for _ in range(23):
        cached.append(int(decode_step(ours, cache, torch.tensor(cached[-1:])).argmax(-1)))
    ids = list(prompt)
    for _ in range(24):
        ids.append(int(ours(torch.tensor([ids]), torch.arange(len(ids))[None])[0, -1].argmax()))
    assert cached == ids[len(prompt):]


def test_perplexity_agrees_with_transformers(pair):
    ours, theirs, tok = pair
    ids = torch.tensor(tok.encode(builtin_text("evaluation"))[:2048])
    window, stride = 512, 256
    nll, count = 0.0, 0
    with torch.no_grad():
        for begin, end, first in windows(len(ids), window, stride):
            logits = theirs(ids[None, begin:end]).logits[0, first - begin - 1 : end - begin - 1]
            nll += torch.nn.functional.cross_entropy(logits, ids[first:end], reduction="sum").item()
            count += end - first
    reference = math.exp(nll / count)
    result = perplexity(ours, ids, window, stride)
    assert result.tokens == count
    assert abs(result.perplexity / reference - 1) < 0.005
