import math

import pytest
import torch
import torch.nn.functional as F

from leanlm.errors import LeanLMError
from leanlm.eval.perplexity import DP_QUANTILES, agreement, perplexity, windows
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
    # dp: the change in the next token's probability, as llama.cpp's KL statistics report it; here one window
    logits_o, logits_m = (m(ids[None], torch.arange(40)[None])[0, :-1].softmax(-1) for m in (other, model))
    naive = (logits_o.gather(-1, ids[1:, None]) - logits_m.gather(-1, ids[1:, None]))[:, 0]
    one = agreement(other, model, ids, 40, 40)
    assert same.dp == pytest.approx([0.0] * len(DP_QUANTILES), abs=1e-6)
    assert one.dp[0] == pytest.approx(naive.min().item(), abs=1e-5) and one.dp[-1] == pytest.approx(naive.max().item(), abs=1e-5)
    assert one.dp[3] == pytest.approx(naive.quantile(0.5).item(), abs=1e-5)
    assert one.dp_rms == pytest.approx(naive.square().mean().sqrt().item(), rel=1e-4)


def test_an_int8_kv_cache_changes_the_scores_a_little(tmp_path):
    from leanlm.cache.int8 import Int8KVCache
    from leanlm.eval.perplexity import score

    make_hf_model("llama", tmp_path)
    model = load_model(tmp_path, torch.float32)
    ids = torch.randint(0, 128, (60,), generator=torch.Generator().manual_seed(1))
    plain, _ = score(model, ids, window=32, stride=16)
    int8, agree = score(model, ids, model, window=32, stride=16, cache_cls=Int8KVCache)
    assert int8.tokens == plain.tokens and int8.perplexity != plain.perplexity
    assert int8.perplexity == pytest.approx(plain.perplexity, rel=0.02) and 0 < agree.kl < 1e-3
