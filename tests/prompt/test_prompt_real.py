"""Prompt compression with the zoo scorer on a real text: the issue's guarantees on a real tokenizer."""

import pytest

from leanlm.prompt.compressor import PromptCompressor
from leanlm.eval.datasets import builtin_text

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def setup():
    text = builtin_text("evaluation")
    start = text.index("Enter three Witches.")  # Macbeth, act I
    return PromptCompressor(progress=False), text[start:start + 5000]


@pytest.mark.parametrize("method", ["llmlingua", "selective", "random"])
@pytest.mark.parametrize("rate", [0.5, 0.2])
def test_rate_met_within_ten_percent_and_deterministic(setup, method, rate):
    scorer, text = setup
    out = scorer.compress(text, rate=rate, method=method)
    assert out.original_tokens > 1000
    assert abs(out.compressed_tokens / out.original_tokens - rate) <= 0.1 * rate
    assert scorer.compress(text, rate=rate, method=method).text == out.text


def test_question_aware_keeps_forced_names_and_the_question(setup):
    scorer, text = setup
    question = "Who greets Macbeth as Thane of Cawdor?"
    out = scorer.compress(text, question=question, rate=0.25, force=("MACBETH", "BANQUO"), method="longllmlingua")
    assert out.text.endswith("\n\n" + question)
    assert out.text.count("MACBETH") == text.count("MACBETH") and out.text.count("BANQUO") == text.count("BANQUO")
    assert abs(out.compressed_tokens / out.original_tokens - 0.25) <= 0.025
