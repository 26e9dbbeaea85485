import math

import pytest
import torch
import torch.nn.functional as F

from leanlm.errors import LeanLMError
from leanlm.eval.perplexity import agreement, perplexity, windows
from leanlm.models.loading import load_model
from tests.conftest import make_hf_model


@pytest.mark.parametrize("n,window,stride", [(50, 16, 8), (50, 16, 16), (17, 16, 5), (5, 16, 8), (2, 2, 1)])
def test_windows_score_every_token_once(n, window, stride):
    scored = []
    for begin, end, first in windows(n, window, stride):
        assert begin < first <= end and end - begin <= window
        scored += range(first, end)
    starts = set(range(stride, n, stride)) if stride == window else set()
    assert scored == [i for i in range(1, n) if i not in starts]


def test_bad_windows():
    with pytest.raises(LeanLMError):
        list(windows(10, 8, 9))
    with pytest.raises(LeanLMError, match="at least 2 tokens"):
        list(windows(1, 8, 4))


def test_perplexity_matches_transformers_naive(tmp_path):
    ref = make_hf_model("llama", tmp_path)
    model = load_model(tmp_path, torch.float32)
    ids = torch.randint(0, 128, (70,), generator=torch.Generator().manual_seed(0))
    # naive definition with transformers: one window per scored token, full context up to `window` tokens
    window, stride = 32, 8
    nll = []
    with torch.no_grad():
        for begin, end, first in windows(70, window, stride):
            logits = ref(ids[None, begin:end]).logits[0]
            for t in range(first, end):
                nll.append(F.cross_entropy(logits[t - begin - 1], ids[t]).item())
    ours = perplexity(model, ids, window, stride)
    assert ours.tokens == 69
    assert math.isclose(ours.perplexity, math.exp(sum(nll) / len(nll)), rel_tol=1e-5)


def test_agreement_self_is_perfect_and_noise_is_not(tmp_path):
    make_hf_model("qwen2", tmp_path)
    model = load_model(tmp_path, torch.float32)
    ids = torch.randint(0, 128, (40,), generator=torch.Generator().manual_seed(0))
    same = agreement(model, model, ids, 16, 8)
    assert same.kl == pytest.approx(0, abs=1e-6) and same.top1 == 1.0
    other = load_model(tmp_path, torch.float32)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    diff = agreement(other, model, ids, 16, 8)
    assert diff.kl > 0.01 and diff.top1 < 1.0
