"""The one-pass keep/drop classifier (prompt/classifier.py): made by its recipe from the zoo scorer, read in
windows, and used by compress(method="classifier") with the guarantees of the other methods."""

import dataclasses
import json

import pytest
import torch

from leanlm.eval.datasets import builtin_text
from leanlm.prompt.classifier import KeepClassifier, Recipe, classifier_dir, labels, load_classifier
from leanlm.prompt.compressor import PromptCompressor

pytestmark = pytest.mark.real_model

TINY = Recipe(layers=2, window=128, prose_windows=3, code_windows=3, epochs=6, batch=2)


@pytest.fixture(scope="module")
def scorer(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LEANLM_CACHE", str(tmp_path_factory.mktemp("cache")))
        pc = PromptCompressor(progress=False)
        pc._classifier = load_classifier(pc, TINY, progress=False)
        yield pc


def test_made_once_by_its_recipe_and_cached(scorer):
    folder = classifier_dir(scorer, TINY)
    assert json.loads((folder / "recipe.json").read_text()) == {"scorer": scorer.name, **json.loads(
        json.dumps(dataclasses.asdict(TINY)))}
    again = load_classifier(scorer, TINY, progress=False)  # from the cache: the same weights
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), scorer.classifier.state_dict().values()))
    assert classifier_dir(scorer, dataclasses.replace(TINY, epochs=7)) != folder


def test_learns_the_iterative_pass_decisions(scorer):
    """On windows of its training recipe the classifier's top tokens are the iterative pass's far more often than
    chance (the labels are what it was fitted to)."""
    from leanlm.prompt.classifier import training_texts
    import random
    texts = training_texts(TINY, TINY.window * 4, random.Random(TINY.seed))
    hits = total = 0
    for ids, target in labels(scorer, texts, TINY.rates):
        p = scorer.classifier.keep_probability(ids)
        ref = target >= 0.5
        top = torch.zeros_like(ref)
        top[p.topk(int(ref.sum())).indices] = True
        hits, total = hits + int((top & ref).sum()), total + int(ref.sum())
    assert hits / total > 0.5 + 0.15  # chance is the share kept (~0.4)


def test_windows_read_alone(scorer):
    """A long prompt is read in windows of the training length: each window's probabilities are its own."""
    ids = scorer.tok.encode_spans(builtin_text("evaluation")[:3000])[0][:300]
    whole = scorer.classifier.keep_probability(ids)
    parts = torch.cat([scorer.classifier.keep_probability(ids[a:a + TINY.window]) for a in range(0, 300, TINY.window)])
    assert whole.shape == (300,) and torch.allclose(whole, parts, atol=1e-2)


@pytest.mark.parametrize("rate", [0.5, 0.33, 0.2])
def test_classifier_method_meets_the_rate_keeps_forced_and_is_deterministic(scorer, rate):
    text = builtin_text("evaluation")
    text = text[text.index("Enter three Witches."):][:5000]
    question = "Who greets Macbeth as Thane of Cawdor?"
    out = scorer.compress(text, question=question, rate=rate, method="classifier", force=("MACBETH",))
    assert out.original_tokens > 1000 and out.method == "classifier"
    assert abs(out.compressed_tokens / out.original_tokens - rate) <= 0.1 * rate
    assert out.text.endswith("\n\n" + question) and out.text.count("MACBETH") == text.count("MACBETH")
    assert scorer.compress(text, question=question, rate=rate, method="classifier", force=("MACBETH",)).text == out.text


def test_bidirectional(scorer):
    """A token's probability depends on the words after it (the layers attend both ways)."""
    ids = scorer.tok.encode_spans("The witches meet Macbeth upon the heath at night.")[0]
    a = scorer.classifier.keep_probability(ids)
    b = scorer.classifier.keep_probability(ids[:-3] + scorer.tok.encode_spans(" in the rain")[0])
    assert not torch.allclose(a[:len(ids) - 3], b[:len(ids) - 3])
    assert isinstance(scorer.classifier, KeepClassifier)
